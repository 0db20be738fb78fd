"""What a lazy engine's ``run`` returns is the caller's until its next ``run``.

A server reads the logits after ``run`` returns, without graphflow's lock, while the
capture thread warms up and verifies the next descriptor on the same static buffers.
These tests read every served step's outputs outside the lock, after letting the
thread run, and compare them with the model's own step (outside graphflow) on the same
rows. On the CPU backend the thread's warmup and verify really write the static buffers
beside the reader, as on a GPU; tests/cuda/test_cuda_served_outputs.py does the same
with graphs.
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

SIZES = (1, 2, 3, 4, 6, 8, 12, 16)
STEPS = 1000



@pytest.mark.parametrize("full", [False, True], ids=["piecewise", "full"])
def test_outputs_read_outside_the_lock_while_the_thread_captures_are_the_steps_own(full):
    """Every step equals the model's own step on the same rows, bit for bit, read after
    the thread had the lock; only steps served while the thread was capturing count."""
    plan = toy_plan(2, full=full, modes=(Mode.FULL,) if full else (Mode.PIECEWISE,), sizes=SIZES)
    generator = torch.Generator().manual_seed(0)
    served = engines = 0
    wrong: list[int] = []
    while served < STEPS:
        model = build_toy(2)
        engine = run_pipeline(plan, RunOptions(backend="cpu", lazy=True, detectors=False), model=model)
        engines += 1
        try:
            runner = Runner(engine)
            while not engine.background.done and served < STEPS:
                batch = 1 + served % SIZES[-1]
                x = torch.randn(batch, 32, generator=generator)
                (got,) = runner.run(x)
                want = own_step(model, runner, x, full)
                time.sleep(0.0005)  # the lock is free: the thread takes its next phase now
                if not torch.equal(got, want):
                    wrong.append(served)
                served += 1
        finally:
            engine.close()
    assert wrong == [], f"{len(wrong)} of {served} served outputs were overwritten (over {engines} engines)"


def test_after_the_thread_is_done_outputs_are_the_static_buffers_again():
    """The copy costs a step only while the thread may write: once it is done, ``run``
    returns views of the static buffers, as a foreground engine's does."""
    engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu", lazy=True, detectors=False))
    try:
        assert engine.background.wait(60)
        runner = Runner(engine)
        (got,) = runner.run(torch.randn(2, 32))
        assert got.data_ptr() == engine.buffers.tensors["logits"].data_ptr()
    finally:
        engine.close()
