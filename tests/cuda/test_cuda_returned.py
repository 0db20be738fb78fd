"""Outputs kept where the graph returns them, on the GPU: a model that returns its result
is captured without the copy into its buffer, and every size's step, run in any order,
gives the model's own result (``graphflow.engine.model.returned``)."""

from __future__ import annotations

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.plan import Buffer, BufferRole, Mode, Segment, SegmentKind
from graphflow.runtime import Runner
from tests.test_real_models import MLP, plan_of
from tests.test_returned import HEAD

pytestmark = pytest.mark.cuda

SIZES = (1, 2, 4)


def inside(tensor: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    return start <= tensor.data_ptr() < start + buffer.numel() * buffer.element_size()


@pytest.mark.parametrize("mode", [Mode.FULL, Mode.PIECEWISE])
@pytest.mark.parametrize("detectors", ["first", "all"])
def test_the_runner_returns_the_graphs_own_output_and_each_size_equals_the_model(mode, detectors):
    model = MLP().eval().cuda()
    plan = plan_of(HEAD, sizes=SIZES, modes=(mode,))
    with run_pipeline(plan, RunOptions(backend="cuda", detectors=detectors, verify="all"), model=model) as engine:
        assert all(v.bit_exact for v in engine.report.verify) and len(engine.report.verify) == len(SIZES)
        runner = Runner(engine)
        generator = torch.Generator("cuda").manual_seed(0)
        for batch in (4, 1, 2, 4, 1, 2, 2, 4):  # the graphs share one pool: any order
            x = torch.randn(batch, 8, device="cuda", generator=generator)
            (y,) = runner.run(x)
            assert not inside(y, engine.buffers.tensors["y"]), "no copy into the static buffer"
            with torch.no_grad():
                want = model(x)
            assert torch.allclose(y, want, atol=1e-6, rtol=1e-6), f"batch {batch}"


def test_an_output_a_later_segment_reads_is_still_copied_into_its_buffer():
    class Twice(MLP):
        def double(self, y, z):
            torch.mul(y, 2, out=z)

    model = Twice().eval().cuda()
    plan = plan_of(HEAD, Segment("double", SegmentKind.GRAPH, "double", reads=("y",), writes=("z",), stream="s0"),
                   buffers=(Buffer("z", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT),),
                   sizes=(2,), modes=(Mode.FULL,))
    with run_pipeline(plan, RunOptions(backend="cuda"), model=model) as engine:
        runner = Runner(engine)
        x = torch.randn(2, 8, device="cuda")
        y, z = runner.run(x)
        assert inside(y, engine.buffers.tensors["y"])
        with torch.no_grad():
            assert torch.allclose(z, 2 * model(x), atol=1e-6, rtol=1e-6)
