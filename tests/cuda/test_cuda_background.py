"""Lazy capture on the GPU: steps served from the main thread while the capture thread
records graphs between them (thread-local capture mode, the plan's streams, a pool of its
own), each descriptor checked against the eager step on its first batch."""

from __future__ import annotations

import time

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.plan import Descriptor, Mode
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan

pytestmark = pytest.mark.cuda

SIZES = (1, 2, 4, 8)


def eager(runner: Runner, batch: int, x: torch.Tensor, full: bool) -> torch.Tensor:
    """The model's own step on the batch alone, outside graphflow (no padding, no graphs)."""
    want = torch.empty(batch, 64, device="cuda")
    runner.engine.model.step(x.clone(), want, full=full)
    return want


@pytest.mark.parametrize("full", [False, True])
def test_steps_served_while_the_thread_captures_equal_the_models_own_step(full):
    plan = toy_plan(3, full=full, modes=(Mode.FULL,) if full else (Mode.PIECEWISE,), sizes=SIZES)
    model = build_toy(3, device="cuda")
    engine = run_pipeline(plan, RunOptions(backend="cuda", lazy=True, verify="all"), model=model)
    try:
        runner = Runner(engine)
        generator = torch.Generator("cuda").manual_seed(0)
        served, on_graphs, deadline, serving = 0, 0, time.monotonic() + 120, set()
        while (not engine.background.done or served < 20) and time.monotonic() < deadline:
            batch = SIZES[served % len(SIZES)] - (served // len(SIZES)) % 2 or 1
            x = torch.randn(batch, 32, device="cuda", generator=generator)
            (got,) = runner.run(x)
            got = got.clone()
            torch.cuda.current_stream().synchronize()  # not the device: the thread may be capturing
            assert torch.allclose(got, eager(runner, batch, x, full), atol=1e-5, rtol=1e-5), f"step {served}, batch {batch}"
            on_graphs += runner.descriptor_for(batch) is not None
            serving.add(runner.descriptor_for(batch))
            served += 1
        assert engine.background.wait(60) and engine.background.failures == {}
        mode = Mode.FULL if full else Mode.PIECEWISE
        assert sorted(engine.programs) == sorted(Descriptor(mode, s) for s in SIZES)
        assert on_graphs > 0
        for batch in (1, 3, 8, 2):  # every size live now: each batch replays
            x = torch.randn(batch, 32, device="cuda", generator=generator)
            (got,) = runner.run(x)
            assert runner.descriptor_for(batch) is not None
            serving.add(runner.descriptor_for(batch))
            assert torch.allclose(got, eager(runner, batch, x, full), atol=1e-5, rtol=1e-5)
        checked = {r.descriptor for r in engine.background.verified}
        assert checked == serving - {None}, "each descriptor checked on its first batch"
        assert all(r.bit_exact for r in engine.background.verified)
    finally:
        engine.close()


def test_a_lazy_run_on_the_gpu_leaves_the_callers_frozen_heap_frozen():
    """A server freezes its heap after start-up (vLLM does); a lazy run once left every
    object of the process unfrozen (205,272 before it, 0 after, on the GPU too)."""
    import gc

    heap = [{"server": "state"}]
    gc.freeze()
    try:
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cuda", lazy=True),
                              model=build_toy(2, device="cuda"))
        try:
            runner = Runner(engine)
            runner.run(torch.randn(3, 32, device="cuda"))
            assert engine.background.wait(60) and engine.background.failures == {}
            runner.run(torch.randn(3, 32, device="cuda"))  # its first batch: the check
        finally:
            engine.close()
        assert not any(o is heap for o in gc.get_objects()), "the caller's frozen heap was unfrozen"
        assert torch.is_grad_enabled()
    finally:
        gc.unfreeze()
