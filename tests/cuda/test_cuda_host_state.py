"""Host state on a GPU: what the warmup check refuses really breaks a graph.

A step whose kernels are launched with a Python int that advances every step (a write
position kept on the host) replays the position it saw at capture. The check names it
before capture; with the check off, verify (against the same eager step) refuses the
capture, and replays really do write the captured position again and again.
"""

from __future__ import annotations

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream

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


def test_the_check_names_the_host_position_before_capture():
    with pytest.raises(CaptureError, match=r"position: \d+ -> \d+") as info:
        run_pipeline(plan(), RunOptions(backend="cuda"), model=HostPosition())
    assert info.value.phase == "warmup"


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
