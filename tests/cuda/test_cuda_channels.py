"""Channels over NCCL on one GPU: a collective captured in a CUDA graph through its handle.

World size 1 with a real NCCL process group (``init_process_group("nccl", store=FileStore,
rank=0, world_size=1)``): the same channel code as on several GPUs. Warmup runs the
real collective eagerly (which also creates the NCCL communicator, something capture
cannot do), capture records it into the graph, and replay with new inputs gives the
reduced result; the trace says ``captured`` with the stream capturing.
"""

from __future__ import annotations

import datetime

import pytest
import torch

from graphflow.dist.channels import ChannelRuntime
from graphflow.events import EventKind, Phase
from graphflow.plan import (Buffer, BufferRole, CaptureSettings, Channel, ChannelKind, Descriptor, Mode, Plan, Segment,
                            SegmentKind, Stream)
from graphflow.dist.trace import Tracer, read_trace
from locus_driver import LocusDriver

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)
D = Descriptor(Mode.FULL, 8)


@pytest.fixture(scope="module")
def nccl(tmp_path_factory):
    import torch.distributed as dist

    torch.cuda.set_device(CUDA)
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=60),
                            device_id=CUDA)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _plan() -> Plan:
    return Plan(
        name="nccl1",
        streams=[Stream("s0", "cuda:0")],
        buffers=[Buffer("x", ("B", 256), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("y", ("B", 256), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        channels=[Channel("tp_ar", ChannelKind.ALL_REDUCE, "tp", 1, "target")],
        segments=[Segment("step", SegmentKind.GRAPH, "step", reads=["x"], writes=["y"], stream="s0",
                          channels=["tp_ar"])],
        capture=CaptureSettings(modes=[Mode.FULL], sizes=[8, 4], warmup_iters=2),
    )


class Model:
    def __init__(self, channels):
        self.channels = channels

    def step(self, x, y):
        torch.mul(x, 2.0, out=y)
        self.channels["tp_ar"].all_reduce(y)
        y.add_(1.0)


class TestCapturedAllReduce:
    def test_all_reduce_captured_through_the_handle_replays_with_new_inputs(self, nccl, tmp_path):
        runtime = ChannelRuntime(_plan(), tracer=Tracer(tmp_path, 0))
        model = Model(runtime.handles)
        x = torch.randn(8, 256, device=CUDA)
        y = torch.empty_like(x)

        walk = LocusDriver()  # the engine's locus, moved by hand: the runtime reads it between events

        def emit(kind, **fields):
            runtime.on_event(walk.event(kind, defer=lambda *_: None, **fields))
            walk.after(kind)

        emit(EventKind.PIPELINE_BEGIN)
        emit(EventKind.PHASE_BEGIN, phase=Phase.WARMUP)
        emit(EventKind.DESCRIPTOR_BEGIN, phase=Phase.WARMUP, descriptor=D)
        model.step(x, y)
        torch.cuda.synchronize()
        emit(EventKind.DESCRIPTOR_END, phase=Phase.WARMUP, descriptor=D)
        emit(EventKind.PHASE_END, phase=Phase.WARMUP)
        emit(EventKind.PHASE_BEGIN, phase=Phase.CAPTURE)
        emit(EventKind.DESCRIPTOR_BEGIN, phase=Phase.CAPTURE, descriptor=D)
        emit(EventKind.REGION_BEGIN, phase=Phase.CAPTURE, descriptor=D, region="target:step")
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(device=CUDA)
        with torch.cuda.graph(graph, stream=stream):
            model.step(x, y)
        emit(EventKind.REGION_END, phase=Phase.CAPTURE, descriptor=D, region="target:step")
        emit(EventKind.DESCRIPTOR_END, phase=Phase.CAPTURE, descriptor=D)
        emit(EventKind.PHASE_END, phase=Phase.CAPTURE)
        emit(EventKind.PIPELINE_END)

        for _ in range(3):
            x.copy_(torch.randn(8, 256, device=CUDA))
            y.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(y, x * 2.0 + 1.0)
        runtime.close()
        calls = [e for e in read_trace(tmp_path / "rank0.jsonl") if e["event"] == "collective"]
        assert [(c["phase"], c["path"], c["capturing"]) for c in calls] == [
            ("warmup", "eager_warmup", False), ("capture", "captured", True)]
        assert (calls[1]["shape"], calls[1]["bytes"], calls[1]["segment"]) == ([8, 256], 8 * 256 * 4, "step")
        graph.reset()


class TestEnginePipeline:
    @pytest.mark.parametrize("detectors", [False, True], ids=["detectors-off", "detectors-on"])
    def test_engine_captures_the_nccl_collective_and_verify_passes(self, nccl, tmp_path, detectors):
        from graphflow.engine import RunOptions
        from graphflow.session import Session

        session = Session(_plan(), RunOptions(backend="cuda", detectors=detectors), trace=str(tmp_path))
        engine = session.capture(Model(session.handles))
        assert engine.report.graphs == 2
        assert all(v.bit_exact for v in engine.report.verify)
        views = engine.buffers.views(4)
        views["x"].copy_(torch.arange(4 * 256, dtype=torch.float32, device=CUDA).view(4, 256))
        for call in engine.programs[Descriptor(Mode.FULL, 4)]:
            call()
        torch.cuda.synchronize()
        assert torch.equal(views["y"], views["x"] * 2.0 + 1.0)
        session.close()
        events = read_trace(tmp_path / "rank0.jsonl")
        # Verify replays the graph (no Python: the collective runs inside it, unseen) against
        # warmup's run, which communicated.
        paths = {(e["phase"], e["path"], e["capturing"]) for e in events if e["event"] == "collective"}
        assert paths == {("warmup", "eager_warmup", False), ("capture", "captured", True)}
