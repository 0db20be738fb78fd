"""Host state on a GPU: what the warmup check refuses really breaks a graph, and the
CUDA backend gives the CPU backend's verdict on every case of tests/test_host_state.py.

A step whose kernels are launched with a Python int that advances every step (a write
position kept on the host) replays the position it saw at capture. The check names it
before capture; with the check off, verify (against the same eager step) refuses the
capture, and replays really do write the captured position again and again. What the
check lets through (a value that follows the batch size, a counter an eager segment or a
break keeps) is captured, and verify finds every replay equal to the eager step. The
CUDA backend runs one more warmup step than the CPU backend on a mode's first
descriptor (its pool probe): the verdicts must not depend on it.
"""

from __future__ import annotations

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from tests.test_host_state import (AttrsMeta, Broken, Meta, SlottedMeta, Split, Stepper, batch_update, broken_plan,
                                   counter_update, lens_update, split_plan, stepper_plan, with_update)

pytestmark = pytest.mark.cuda


class HostPosition(torch.nn.Module):
    """Writes each step's row at ``self.position``, a Python int it advances."""

    def __init__(self):
        super().__init__()
        self.position = 0
        self.register_buffer("cache", torch.zeros(2, 64, 8, device="cuda"))

    def forward_step(self, x, y):
        self.cache[:, self.position % 64].copy_(x)
        self.position += 1
        torch.sum(self.cache, dim=1, out=y)


def plan(**options) -> Plan:
    return Plan("host-position", buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                                          Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("step", SegmentKind.GRAPH, "forward_step", reads=("x",), writes=("y",),
                                  stream="s0")],
                capture=CaptureSettings(modes=(Mode.FULL,), sizes=(2,)))


def on_gpu(model):
    return model.to("cuda")


def run(plan, model, **options):
    """Capture on the CUDA backend; verify (on unless ``options`` say otherwise) compares
    the replays with the eager step."""
    run_pipeline(plan, RunOptions(backend="cuda", **options), model=on_gpu(model)).close()


def refusal(plan, model, **options) -> CaptureError:
    with pytest.raises(CaptureError) as info:
        run(plan, model, **options)
    assert info.value.phase == "warmup"
    return info.value


def eagerly(model, size: int) -> None:
    with torch.no_grad():
        model.forward_step(torch.zeros(size, 8, device="cuda"), torch.zeros(size, 8, device="cuda"))


def test_the_check_names_the_host_position_before_capture():
    error = refusal(plan(), HostPosition())
    assert error.segment == "step" and "in step, position: 0 -> 1, then 1 -> 2" in error.message


def test_with_the_check_off_the_graph_replays_the_captured_position():
    model = HostPosition()
    with pytest.raises(CaptureError) as info:
        run_pipeline(plan(), RunOptions(backend="cuda", disabled_checks={"host_state"}), model=model)
    assert info.value.phase == "verify"
    model = HostPosition()
    engine = run_pipeline(plan(), RunOptions(backend="cuda", disabled_checks={"host_state"}, verify=False),
                          model=model)
    try:
        model.cache.zero_()
        replay = engine.programs[next(iter(engine.programs))]
        x = engine.buffers.tensors["x"]
        for step in range(3):
            x.fill_(float(step + 1))
            for call in replay:
                call()
        torch.cuda.synchronize()
        written = (model.cache[0].abs().sum(dim=1) > 0).nonzero().flatten().tolist()
        assert len(written) == 1, f"three replays wrote rows {written}: one position, the captured one"
    finally:
        engine.close()


def test_a_counter_in_a_graph_segment_a_list_and_a_dataclass_is_refused():
    assert "cache.layers[0].position: 0 -> 1, then 1 -> 2" in refusal(stepper_plan(), Stepper()).message
    model = with_update(Stepper, lens_update)
    model.lens = [3, 7]
    assert "lens[0]: 3 -> 4, then 4 -> 5" in refusal(stepper_plan(), model).message
    for meta in (Meta, SlottedMeta, AttrsMeta):
        model = with_update(Stepper, lambda self, x: setattr(self.meta, "steps", self.meta.steps + 1))
        model.meta = meta()
        assert "meta.steps: 0 -> 1, then 1 -> 2" in refusal(stepper_plan(), model).message


@pytest.mark.parametrize("before", [None, 1, 3])
@pytest.mark.parametrize("detectors", ["first", "all"])
def test_a_value_that_follows_the_batch_size_passes_and_replays_as_the_eager_step(before, detectors):
    model = on_gpu(with_update(Stepper, batch_update))
    if before is not None:
        eagerly(model, before)
    run(stepper_plan(sizes=(8, 2)), model, detectors=detectors, verify="all")


def test_a_counter_an_eager_segment_keeps_passes_and_replays_as_the_eager_step():
    model = with_update(Split, counter_update, ["mix"])
    model.count = 0
    run(split_plan(), model, detectors="all", verify="all")
    assert model.count > 0


def test_a_counter_in_a_break_passes_in_piecewise_and_is_refused_in_full():
    run(broken_plan(Mode.PIECEWISE), Broken(), detectors="all", verify="all")
    assert "in step, attn.position: 0 -> 1, then 1 -> 2" in refusal(broken_plan(Mode.FULL), Broken()).message


@pytest.mark.parametrize("iters", [1, 2])
def test_the_verdict_does_not_depend_on_the_warmup_steps_or_the_size_run_before(iters):
    for before in (None, 1, 5):
        for update, passes in ((lens_update, False), (batch_update, True)):
            model = on_gpu(with_update(Stepper, update))
            model.lens = [3]
            if before is not None:
                eagerly(model, before)
            if passes:
                run(stepper_plan(sizes=(8, 2), warmup_iters=iters), model)
            else:
                refusal(stepper_plan(sizes=(8, 2), warmup_iters=iters), model)
