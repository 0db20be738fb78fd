"""A lazy engine's served outputs on the GPU: never overwritten by the capture thread.

Every served step's outputs are read outside graphflow's lock, after the thread had its
chance to warm up or verify the next descriptor on the static buffers, and compared bit
for bit with the model's own step (outside graphflow) on the same rows; only steps
served while the thread was capturing count. Also prints what the copy into the
runner's own outputs costs per step.
"""

from __future__ import annotations

import time

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.plan import Mode
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan
from tests.lazy_steps import own_step

pytestmark = pytest.mark.cuda

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
STEPS = 1000



@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
def test_outputs_read_outside_the_lock_while_the_thread_captures_are_the_steps_own(full):
    plan = toy_plan(2, full=full, modes=(Mode.FULL,) if full else (Mode.PIECEWISE,), sizes=SIZES)
    generator = torch.Generator("cuda").manual_seed(0)
    served = engines = 0
    wrong: list[int] = []
    while served < STEPS:
        model = build_toy(2, device="cuda")
        engine = run_pipeline(plan, RunOptions(backend="cuda", lazy=True), model=model)
        engines += 1
        try:
            runner = Runner(engine)
            while not engine.background.done and served < STEPS:
                batch = 1 + served % SIZES[-1]
                x = torch.randn(batch, 32, device="cuda", generator=generator)
                (got,) = runner.run(x)
                want = own_step(model, runner, x, full)
                time.sleep(0.0005)  # the lock is free: the thread takes its next phase now
                if not torch.equal(got, want):  # syncs this thread's stream, not the capturing one
                    wrong.append(served)
                served += 1
            assert engine.background.wait(60) and engine.background.failures == {}
        finally:
            engine.close()
    print(f"{served} steps served while capturing, over {engines} lazy engines, {len(wrong)} wrong")
    assert wrong == []


def test_what_the_copy_of_the_outputs_costs_a_step():
    """Printed, not asserted: the copy (the largest output, [16, 64] float32 here) beside
    the step it follows."""
    engine = run_pipeline(toy_plan(2, full=True, modes=(Mode.FULL,), sizes=(16,)), RunOptions(backend="cuda"),
                          model=build_toy(2, device="cuda"))
    try:
        runner = Runner(engine)
        x = torch.randn(16, 32, device="cuda")
        (out,) = runner.run(x)
        mine = torch.empty_like(out)
        for label, body in (("step", lambda: runner.run(x)), ("copy", lambda: mine.copy_(out)),
                            ("step + copy", lambda: (runner.run(x), mine.copy_(out)))):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(1000):
                body()
            torch.cuda.synchronize()
            print(f"{label}: {(time.perf_counter() - start) * 1e3:.1f} us a step (host and device, 1000 steps)")
    finally:
        engine.close()
