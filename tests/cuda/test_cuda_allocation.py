"""On a GPU: what ``show`` and the validator report is what the engine allocates there, and
an alias of an alias captures, replays and verifies as views of one storage.

The CPU twins are in ``tests/test_allocation.py``; these run the CUDA backend, so the
buffers are real device allocations and the regions real graphs.
"""

from __future__ import annotations

import pytest

from graphflow.engine import RunOptions, run_pipeline
from graphflow.plan.rules import validate
from tests.allocation_plans import CACHE_BYTES, Cache, Chain, cache_plan, chain_plan, shown_static_bytes

pytestmark = pytest.mark.cuda

CUDA_RUN = RunOptions(backend="cuda")


def test_show_reports_the_bytes_the_gpu_allocates_for_a_capacity():
    plan = cache_plan()
    with run_pipeline(plan, CUDA_RUN, model=Cache()) as engine:
        assert engine.report.captures_graphs
        cache = engine.buffers.tensors["cache"]
        assert cache.shape == (64, 8, 16) and cache.is_cuda
        assert engine.buffers.nbytes() == shown_static_bytes(plan) == CACHE_BYTES


def test_an_alias_chain_captures_and_verifies_as_one_storage():
    plan = chain_plan()
    assert validate(plan).diagnostics == ()
    with run_pipeline(plan, CUDA_RUN, model=Chain()) as engine:
        tensors = engine.buffers.tensors
        assert tensors["c"].data_ptr() == tensors["b"].data_ptr() == tensors["a"].data_ptr()
        assert engine.report.verify and all(r.bit_exact for r in engine.report.verify)
