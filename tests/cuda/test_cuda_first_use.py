"""Every descriptor checked before it serves, on the GPU: a model right at every batch
size but one (B=10 of 1..16, not in verify's sample before ready), whose graph segment
reads a Python float that advances each call. Its graph replays the value frozen at
capture; with the defaults it once served that value at 20 of 20 steps of B=10 on the
H100. Now the first batch at B=10 serves the eager step, the graph is rolled back and
named, and later batches of B=10 replay B=11's graph, which is right."""

from __future__ import annotations

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.context import sample
from graphflow.plan import Descriptor, Mode
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan
from tests.first_use_model import drifting_toy

pytestmark = pytest.mark.cuda

SIZES = tuple(range(1, 17))
WRONG = 10


def _own(batch: int, x: torch.Tensor, full: bool) -> torch.Tensor:
    want = torch.empty(batch, 64, device="cuda")
    build_toy(2, device="cuda").step(x.clone(), want, full=full)
    return want


@pytest.mark.parametrize("full", [False, True])
def test_a_graph_wrong_at_one_unsampled_size_never_serves_a_wrong_value(full):
    mode = Mode.FULL if full else Mode.PIECEWISE
    plan = toy_plan(2, full=full, modes=(mode,), sizes=SIZES)
    assert Descriptor(mode, WRONG) not in sample(plan.descriptors())
    model, drift = drifting_toy(2, WRONG, device="cuda")
    engine = run_pipeline(plan, RunOptions(backend="cuda"), model=model)
    try:
        runner = Runner(engine)
        generator = torch.Generator("cuda").manual_seed(1)
        for step in range(20):
            x = torch.randn(WRONG, 32, device="cuda", generator=generator)
            (out,) = runner.run(x)
            want = _own(WRONG, x, full)  # build_toy's weights are seeded: the engine's model's
            if step == 0:  # served by the eager step: the model's value of this call
                # The capture ran the head once (its graph adds 1.0 for good), the eager step once more.
                assert torch.allclose(out, want + drift[0], atol=1e-5), "the first batch serves the eager step"
                error = engine.first_use.failures[Descriptor(mode, WRONG)]
                assert f"{mode.value}(B=10) differs from the eager step on its first batch" in error.message
                assert error.segment == "head"
            else:
                assert runner.descriptor_for(WRONG) == Descriptor(mode, 11)
                assert torch.allclose(out, want, atol=1e-5), f"step {step} served a wrong value"
        assert runner.checks.failed == 1 and Descriptor(mode, WRONG) not in engine.programs
    finally:
        engine.close()
