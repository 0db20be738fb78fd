"""Device memory as the CUDA rollback and close tests count it."""

from __future__ import annotations

import gc
import warnings

import torch

from graphflow.engine.backend import WorkspaceClearedWarning


def allocated() -> int:
    """Allocated bytes now, after collecting garbage and without cuBLAS's per-stream
    workspaces: they are cuBLAS's cache, which the engine leaves because other live graphs
    replay into theirs (torch's own leak checks leave them out the same way). The test's
    graphs are not replayed after this count, so the warning a clear raises while pools
    are held is not for them."""
    gc.collect()
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", WorkspaceClearedWarning)
        torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()
