"""Concurrent streams inside captured regions on a real GPU: fork, events, join.

Two branches (``left`` on s0, ``right`` on s1, which first spins for milliseconds) join
into ``merge`` on s0. A missing wait would let ``merge`` read ``right``'s output before
it is written, so every result is compared bit for bit with the same math run serially.
Concurrency is shown on the graph's structure (its DOT dump), never by timing.
"""

from __future__ import annotations

import re

import networkx as nx
import pytest
import torch

from graphflow.engine.detectors import Check, Detectors
from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from graphflow.runtime import Runner
from test_cuda_engine import TrackingBackend
from tests.cuda.memory import allocated as baseline

pytestmark = pytest.mark.cuda

P, F = Mode.PIECEWISE, Mode.FULL
MiB = 1 << 20
SPIN = 20_000_000  # cycles: ~10 ms on an H200, far longer than left's kernels


class Branches(torch.nn.Module):
    def __init__(self, fault: str | None = None):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(64, 64, generator=g).cuda(), requires_grad=False)
        self.w2 = torch.nn.Parameter(torch.randn(64, 64, generator=g).cuda(), requires_grad=False)
        self.fault = fault
        self.phase = None

    def on_event(self, event):
        if event.kind is EventKind.PHASE_BEGIN:
            self.phase = event.phase

    def left(self, x, a):
        torch.tanh(x @ self.w1, out=a)

    def right(self, x, b):
        if self.phase is Phase.CAPTURE and self.fault == "raise":
            raise RuntimeError("injected in right")
        torch.cuda._sleep(SPIN)
        if self.phase is Phase.CAPTURE and self.fault == "item":
            float(x.sum().item())  # a host sync on the side stream: invalidates the capture
        torch.sigmoid(x @ self.w2, out=b)

    def merge(self, a, b, y):
        torch.add(a, b, out=y)

    def scale(self, y, z):
        torch.mul(y, 3, out=z)

    def tail(self, z, out):
        torch.neg(z, out=out)


def branches_plan(modes=(P, F), side="s1", piecewise_break=False) -> Plan:
    def graph(name, reads, writes, stream="s0"):
        return Segment(name, SegmentKind.GRAPH, name, reads=reads, writes=writes, stream=stream)

    shape = ("B", 64)
    segments = [graph("left", ["x"], ["a"]), graph("right", ["x"], ["b"], side), graph("merge", ["a", "b"], ["y"])]
    outputs = ["y"]
    if piecewise_break:
        segments += [Segment("scale", SegmentKind.EAGER, "scale", reads=["y"], writes=["z"], stream=side),
                     graph("tail", ["z"], ["out"], side)]
        outputs = ["y", "out"]
    names = ["x", "a", "b", "y", *(["z", "out"] if piecewise_break else [])]
    roles = {"x": BufferRole.INPUT, **{n: BufferRole.OUTPUT for n in outputs}}
    return Plan("branches", streams=[Stream("s0", "cuda:0"), Stream("s1", "cuda:0")],
                buffers=[Buffer(n, shape, "float32", "cuda:0", role=roles.get(n, BufferRole.INTERNAL)) for n in names],
                segments=segments, capture=CaptureSettings(modes=modes, sizes=(8, 16), warmup_iters=2))


def serial(model: Branches, x: torch.Tensor, size: int) -> torch.Tensor:
    """The step's math on one stream, on ``x`` padded to the descriptor's size as the
    runner pads it (cuBLAS may pick another kernel for another row count)."""
    padded = torch.zeros(size, 64, device="cuda")
    padded[:len(x)] = x
    return (torch.tanh(padded @ model.w1) + torch.sigmoid(padded @ model.w2))[:len(x)]


class TestReplay:
    @pytest.mark.parametrize("modes", [(P,), (F,)], ids=["piecewise", "full"])
    def test_bit_exact_and_equal_to_the_serial_math(self, modes):
        model = Branches()
        with run_pipeline(branches_plan(modes), RunOptions(backend="cuda"), model=model, listeners=[model]) as engine:
            assert all(r.bit_exact for r in engine.report.verify)
            runner = Runner(engine)
            for batch in (3, 16):
                x = torch.randn(batch, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(batch))
                (y,) = runner.run(x)
                torch.cuda.synchronize()
                assert torch.equal(y, serial(model, x, runner.descriptor_for(batch).size)), batch

    @pytest.mark.parametrize("modes", [(P,), (F,)], ids=["piecewise", "full"])
    def test_each_segment_runs_on_its_stream_and_the_callers_stream_comes_back(self, modes):
        seen: dict[tuple[Phase, str], set] = {}

        class Watching(Branches):
            def _saw(self, name):
                seen.setdefault((self.phase, name), set()).add(torch.cuda.current_stream().cuda_stream)

            def left(self, x, a):
                self._saw("left")
                super().left(x, a)

            def right(self, x, b):
                self._saw("right")
                super().right(x, b)

            def merge(self, a, b, y):
                self._saw("merge")
                super().merge(a, b, y)

        model = Watching()
        caller = torch.cuda.Stream()
        with torch.cuda.stream(caller):
            with run_pipeline(branches_plan(modes), RunOptions(backend="cuda"), model=model, listeners=[model]):
                assert torch.cuda.current_stream() == caller
        for phase in (Phase.WARMUP, Phase.CAPTURE):
            origin, side, merge = (seen[phase, n] for n in ("left", "right", "merge"))
            assert len(origin) == len(side) == 1 and origin == merge and origin != side, (phase, seen)
            assert torch.cuda.default_stream().cuda_stream not in origin | side | {caller.cuda_stream}
        assert seen[Phase.WARMUP, "right"] == seen[Phase.CAPTURE, "right"]

    def test_an_eager_break_on_the_side_stream_between_regions(self):
        model = Branches()
        with run_pipeline(branches_plan((P,), piecewise_break=True), RunOptions(backend="cuda"), model=model, listeners=[model]) as engine:
            assert all(r.bit_exact for r in engine.report.verify)
            x = torch.randn(8, 64, device="cuda")
            y, out = (t.clone() for t in Runner(engine).run(x))
            torch.cuda.synchronize()
            want = serial(model, x, 8)
            assert torch.equal(y, want) and torch.equal(out, -(want * 3))


def _dot_graph(path) -> tuple[nx.DiGraph, dict[str, str]]:
    """Nodes, edges and node labels of a ``cudaGraphDebugDotPrint`` file."""
    text = open(path, encoding="utf-8").read()
    # A node is a line '"graph_N_node_M"[... label="..."];' (edges read '"a" -> "b" [...]').
    labels = dict(re.findall(r'^\s*"(graph_\d+_node_\d+)"\[(.*?)\];\s*$', text, re.M | re.S))
    dag = nx.DiGraph()
    dag.add_nodes_from(labels)
    dag.add_edges_from(re.findall(r'"(graph_\d+_node_\d+)"\s*->\s*"(graph_\d+_node_\d+)"', text))
    return dag, labels


class TestConcurrentInTheGraph:
    @pytest.mark.parametrize("side,concurrent", [("s1", True), ("s0", False)])
    def test_no_path_between_the_branches_kernels(self, tmp_path, side, concurrent):
        """On two streams the branches' kernels are unordered in the graph; on one stream
        (the control) they form a chain, so this check can fail."""
        model = Branches()
        backend = TrackingBackend(debug_graphs=True)
        with run_pipeline(branches_plan((F,), side=side), RunOptions(sizes=[8]), backend=backend, model=model, listeners=[model]):
            (graph,) = backend.graphs
            path = tmp_path / "graph.dot"
            graph.graph.debug_dump(str(path))
        dag, labels = _dot_graph(path)
        left = [n for n, label in labels.items() if "tanh" in label]
        right = [n for n, label in labels.items() if "sigmoid" in label or "spin" in label]
        assert left and right, open(path, encoding="utf-8").read()[:4000]
        ordered = any(nx.has_path(dag, a, b) or nx.has_path(dag, b, a) for a in left for b in right)
        assert ordered is not concurrent


def assert_clean(backend: TrackingBackend, start: int):
    assert all(g.graph is None for g in backend.graphs), "a graph was not reset"
    for stream in backend.streams:
        with torch.cuda.stream(stream):
            assert not torch.cuda.is_current_stream_capturing(), stream
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    after = baseline()
    assert abs(after - start) <= MiB, (after, start)


class TestRollback:
    @pytest.mark.parametrize("fault", ["raise", "item"])
    @pytest.mark.parametrize("modes", [(P,), (F,)], ids=["piecewise", "full"])
    def test_a_fault_on_the_side_stream_leaves_no_stream_capturing(self, fault, modes):
        model = Branches(fault)
        before = baseline()
        backend = TrackingBackend()
        with pytest.raises(CaptureError) as info:
            run_pipeline(branches_plan(modes), RunOptions(detectors=False), backend=backend, model=model, listeners=[model])
        assert (info.value.phase, info.value.segment) == ("capture", "right")
        assert len(backend.streams) == 2
        assert_clean(backend, before)
        # and the device still captures afterwards
        with run_pipeline(branches_plan(modes), RunOptions(backend="cuda"), model=Branches(), listeners=[Branches()]) as engine:
            assert all(r.bit_exact for r in engine.report.verify)


class TestDetectors:
    def test_the_joined_side_stream_is_not_flagged(self):
        model = Branches()
        with run_pipeline(branches_plan((P, F)), RunOptions(backend="cuda", detectors=True, verify="all"), model=model, listeners=[model]) as engine:
            assert len(engine.report.verify) == 4

    def test_a_stream_outside_the_capture_is_still_flagged(self):
        det = Detectors(checks=[Check.UNCAPTURED_KERNEL])
        joined, outside = torch.ones(16, device="cuda"), torch.ones(16, device="cuda")
        origin, side, other = (torch.cuda.Stream() for _ in range(3))
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=origin):
            side.wait_stream(origin)
            with torch.cuda.stream(side), det.watch("joined", Phase.CAPTURE, True, joined.device):
                joined.mul_(2)
            with torch.cuda.stream(other), det.watch("outside", Phase.CAPTURE, True, outside.device):
                outside.mul_(3)
            origin.wait_stream(side)
        torch.cuda.synchronize()
        graph.reset()
        assert [(f.segment, f.check) for f in det.findings] == [("outside", Check.UNCAPTURED_KERNEL)]
