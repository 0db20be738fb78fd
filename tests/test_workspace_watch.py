"""cuBLAS's workspaces cleared under graphflow's live graphs: a warning that names the fix.

Only the bookkeeping is tested here (which pools are held, when the clear warns); the
clear itself is torch's CUDA call, replaced by a recording stand-in on a CPU build.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from graphflow.engine import backend
from graphflow.engine.backend import WorkspaceClearedWarning


@pytest.fixture
def cleared(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: calls.append("cleared"), raising=False)
    yield calls
    backend.workspace_watch.reset()


def test_a_clear_while_a_pool_is_held_warns_and_still_clears(cleared):
    backend.workspace_watch.hold("pool-a")
    with pytest.warns(WorkspaceClearedWarning, match="warm torch.compile"):
        torch._C._cuda_clearCublasWorkspaces()
    assert cleared == ["cleared"]


def test_a_clear_after_the_last_pool_is_released_is_silent_and_unwrapped(cleared):
    original = torch._C._cuda_clearCublasWorkspaces
    backend.workspace_watch.hold("pool-a")
    backend.workspace_watch.hold("pool-b")
    backend.workspace_watch.release("pool-a")
    assert torch._C._cuda_clearCublasWorkspaces is not original  # pool-b is still held
    backend.workspace_watch.release("pool-b")
    assert torch._C._cuda_clearCublasWorkspaces is original
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch._C._cuda_clearCublasWorkspaces()
    assert cleared == ["cleared"]


def test_without_the_cuda_call_nothing_is_watched(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    backend.workspace_watch.hold("pool-a")
    backend.workspace_watch.release("pool-a")
    assert not hasattr(torch._C, "_cuda_clearCublasWorkspaces")


def test_a_wrapper_kept_past_the_release_still_clears(cleared):
    backend.workspace_watch.hold("pool-a")
    kept = torch._C._cuda_clearCublasWorkspaces
    backend.workspace_watch.release("pool-a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept()
    assert cleared == ["cleared"]
