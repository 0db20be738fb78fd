"""Fork/join schedules over streams (``graphflow.plan.schedule``), and the pipeline running them."""

from __future__ import annotations

import random

import attrs
import networkx as nx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphflow.engine import CpuBackend, RunOptions, run_pipeline
from graphflow.plan.schedule import Dependency, Hazard, Schedule, Step, build_schedule, dependencies
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from strategies import valid_plans


def graph(name, reads=(), writes=(), stream="s0", call=None, **kwargs):
    return Segment(name, SegmentKind.GRAPH, call or f"m.{name}", reads=reads, writes=writes, stream=stream, **kwargs)


def buffers(*names, alias=None):
    made = [Buffer(n, ("B",), "float32", "cuda:0") for n in names]
    if alias:
        made += [Buffer(view, ("B",), "float32", "cuda:0", alias_of=target) for view, target in alias.items()]
    return made


def plan_of(segments, names, alias=None):
    return Plan("p", buffers=buffers(*names, alias=alias), segments=segments)


def schedule_of(segments, names=("x", "a", "b", "y"), alias=None) -> Schedule:
    plan = plan_of(segments, names, alias)
    return build_schedule([s.name for s in segments], [s.stream for s in segments], dependencies(plan, segments))


class TestDependencies:
    def test_raw_war_waw_and_after(self):
        segments = [graph("w1", writes=["a"]), graph("r", reads=["a"], writes=["b"]),
                    graph("w2", writes=["a"]), graph("w3", writes=["a"]), graph("z", writes=["y"], after=["r"])]
        found = {(d.source, d.target, d.hazard) for d in dependencies(plan_of(segments, "aby"), segments)}
        assert found == {("w1", "r", Hazard.RAW), ("r", "w2", Hazard.WAR), ("w1", "w2", Hazard.WAW),
                         ("w2", "w3", Hazard.WAW), ("r", "z", Hazard.AFTER)}

    def test_a_view_conflicts_with_its_target(self):
        segments = [graph("w", writes=["a"]), graph("r", reads=["a.v"], writes=["b"])]
        deps = dependencies(plan_of(segments, "ab", alias={"a.v": "a"}), segments)
        assert deps == (Dependency("w", "r", Hazard.RAW, "a.v"),)

    def test_a_segment_left_out_hides_no_edge(self):
        # On this rank the middle in-place update does not run: the reader reads w's write.
        segments = [graph("w", writes=["a"]), graph("r", reads=["a"], writes=["b"])]
        assert dependencies(plan_of(segments, "ab"), segments) == (Dependency("w", "r", Hazard.RAW, "a"),)


class TestWaits:
    @pytest.mark.parametrize("second", [
        graph("b", reads=["a"], writes=["b"], stream="s1"),  # RAW
        graph("b", writes=["x"], stream="s1"),  # WAR on x
        graph("b", writes=["a"], stream="s1"),  # WAW
        graph("b", writes=["b"], stream="s1", after=["a"]),  # after
    ], ids=["raw", "war", "waw", "after"])
    def test_an_edge_across_streams_makes_a_wait_and_an_event(self, second):
        first = graph("a", reads=["x"], writes=["a"])
        schedule = schedule_of([first, second])
        assert schedule.steps == (Step("a", "s0", (), 1), Step("b", "s1", ("a",), 2))
        assert (schedule.origin, schedule.fork, schedule.join, schedule.events) == ("s0", ("s1",), ("b",),
                                                                                    ("s0", "s0", "s1"))

    def test_edges_on_one_stream_make_no_wait_no_event_no_fork(self):
        schedule = schedule_of([graph("a", writes=["a"]), graph("b", reads=["a"], writes=["b"]),
                                graph("c", reads=["b"], writes=["a"])])
        assert all(s.waits == () and s.event is None for s in schedule.steps)
        assert (schedule.fork, schedule.join, schedule.events, schedule.fork_event) == ((), (), (), None)

    def test_independent_branches_wait_only_at_the_join(self):
        schedule = schedule_of([graph("a", reads=["x"], writes=["a"]), graph("b", reads=["x"], writes=["b"], stream="s1"),
                                graph("y", reads=["a", "b"], writes=["y"])])
        assert schedule.steps == (Step("a", "s0"), Step("b", "s1", (), 1), Step("y", "s0", ("b",)))
        assert schedule.join == ()  # y already waited for s1's last segment

    def test_waits_are_reduced_to_the_latest_per_stream(self):
        segments = [graph("b1", writes=["a"], stream="s1"), graph("b2", writes=["b"], stream="s1"),
                    graph("c", reads=["a", "b"], writes=["y"], stream="s0")]
        schedule = schedule_of(segments)
        assert schedule.step("c").waits == ("b2",)
        assert schedule.step("b1").event is None and schedule.step("b2").event is not None

    def test_a_wait_covers_what_its_source_waited_for(self):
        # c on s2 needs a (s0) and b (s1); b already waited for a, so c waits for b only.
        segments = [graph("a", writes=["a"]), graph("b", reads=["a"], writes=["b"], stream="s1"),
                    graph("c", reads=["a", "b"], writes=["y"], stream="s2")]
        schedule = schedule_of(segments)
        assert [s.waits for s in schedule.steps] == [(), ("a",), ("b",)]
        assert schedule.fork == ("s1", "s2") and schedule.join == ("b", "c")

    def test_events_only_where_waited_on_or_joined(self):
        segments = [graph("a", writes=["a"]), graph("s", writes=["x"], stream="s1"),
                    graph("t", reads=["x"], writes=["b"], stream="s1")]
        schedule = schedule_of(segments)
        assert [s.event for s in schedule.steps] == [None, None, 1]
        assert schedule.join == ("t",) and schedule.events == ("s0", "s1")

    def test_an_empty_sequence_has_no_origin(self):
        assert build_schedule([], [], []) == Schedule(None, (), (), (), ())

    @pytest.mark.parametrize("edges,message", [
        ([("b", "a")], "edge b -> a points backwards in the sequence"),
        ([("a", "z")], "edge a -> z names a segment outside the sequence"),
    ])
    def test_bad_edges_are_refused(self, edges, message):
        with pytest.raises(ValueError) as info:
            build_schedule(["a", "b"], ["s0", "s1"], edges)
        assert str(info.value) == message


def happens_before(schedule: Schedule) -> nx.DiGraph:
    """What the schedule guarantees: stream order, fork, waits and join, as a graph whose
    paths are the orderings a device must respect ("start" and "end" on the origin)."""
    order = nx.DiGraph()
    order.add_node("start")
    last = {schedule.origin: "start", **{s: "start" for s in schedule.fork}}
    for step in schedule.steps:
        order.add_edge(last[step.stream], step.name)
        for source in step.waits:
            order.add_edge(source, step.name)
        last[step.stream] = step.name
    for stream, tail in last.items():
        if stream == schedule.origin or tail in schedule.join:
            order.add_edge(tail, "end")
    return order


@st.composite
def streamed_plans(draw):
    """A valid plan whose graph segments run on random streams (s0..s2)."""
    plan = draw(valid_plans())
    streams = draw(st.lists(st.sampled_from(["s0", "s1", "s2"]), min_size=len(plan.segments),
                            max_size=len(plan.segments)))
    return [attrs.evolve(s, stream=key) for s, key in zip(plan.segments, streams)], plan


@settings(max_examples=150)
@given(streamed_plans())
def test_every_dag_edge_is_kept_by_the_schedule(drawn):
    segments, plan = drawn
    plan = attrs.evolve(plan, segments=segments)
    names = [s.name for s in segments]
    schedule = build_schedule(names, [s.stream for s in segments], dependencies(plan, segments))
    position = {n: i for i, n in enumerate(names)}
    recorded = {s.name for s in schedule.steps if s.event is not None}
    for step in schedule.steps:
        assert len({schedule.step(w).stream for w in step.waits}) == len(step.waits), "one wait per stream"
        for source in step.waits:
            assert position[source] < position[step.name], "a wait points forward"
            assert schedule.step(source).stream != step.stream and source in recorded
    assert {s.name for s in schedule.steps if s.event is not None} == (
        {w for s in schedule.steps for w in s.waits} | set(schedule.join))
    assert set(schedule.fork) == {s.stream for s in segments} - {schedule.origin}
    order = happens_before(schedule)
    closure = nx.transitive_closure_dag(order)
    dag = plan.dag()
    for source, target in dag.edges:
        assert closure.has_edge(source, target), f"{source} -> {target} is not ordered"
    for dependency in dependencies(plan, segments):
        assert closure.has_edge(dependency.source, dependency.target), dependency
    assert all(closure.has_edge(n, "end") for n in names), "a segment is not joined"
    # Any serial run consistent with the schedule (every topological order) keeps every edge:
    # checked on a few interleavings, each built by picking a random ready segment.
    for seed in range(3):
        done, ready_order = set(), []
        graph_ = order.subgraph(names)
        pending = {n: set(graph_.predecessors(n)) for n in names}
        rng = random.Random(seed)
        while len(done) < len(names):
            ready = sorted(n for n in names if n not in done and pending[n] <= done)
            pick = rng.choice(ready)
            done.add(pick)
            ready_order.append(pick)
        at = {n: i for i, n in enumerate(ready_order)}
        assert all(at[u] < at[v] for u, v in dag.edges)


class LoggingBackend(CpuBackend):
    """The CPU backend, logging every fork, join, record and wait by stream name."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple] = []
        self.names: dict[int, str] = {}
        self.labels: dict[int, str] = {}

    def new_stream(self, device):
        stream = super().new_stream(device)
        self.names[id(stream)] = f"stream{len(self.names)}"
        return stream

    def new_event(self, device):
        event = object()  # distinct, so the log can name it
        self.labels[id(event)] = f"e{len(self.labels)}"
        return event

    def name(self, stream):
        return self.names[id(stream)]

    def fork(self, origin, streams, event):
        self.log.append(("fork", self.name(origin), tuple(map(self.name, streams))))
        super().fork(origin, streams, event)

    def join(self, origin, events):
        self.log.append(("join", self.name(origin), tuple(self.labels[id(e)] for e in events)))
        super().join(origin, events)

    def record(self, event, stream):
        self.log.append(("record", self.labels[id(event)], self.name(stream)))

    def wait(self, stream, event):
        self.log.append(("wait", self.name(stream), self.labels[id(event)]))

    def capture(self, calls, recording, stream, pool, side=()):
        self.log.append(("capture", self.name(stream), tuple(map(self.name, side))))
        return super().capture(calls, recording, stream, pool, side)


class Branches(torch.nn.Module):
    def __init__(self, log):
        super().__init__()
        self.log = log

    def left(self, x, a):
        self.log.append("left")
        torch.mul(x, 2, out=a)

    def right(self, x, b):
        self.log.append("right")
        torch.add(x, 1, out=b)

    def merge(self, a, b, y):
        self.log.append("merge")
        torch.add(a, b, out=y)


def branches_plan(modes=(Mode.PIECEWISE,)):
    return Plan(
        "branches", streams=[Stream("s0", "cuda:0"), Stream("s1", "cuda:0")],
        buffers=[Buffer("x", ("B", 4), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("a", ("B", 4), "float32", "cuda:0"), Buffer("b", ("B", 4), "float32", "cuda:0"),
                 Buffer("y", ("B", 4), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        segments=[graph("left", ["x"], ["a"], call="left"), graph("right", ["x"], ["b"], stream="s1", call="right"),
                  graph("merge", ["a", "b"], ["y"], call="merge")],
        capture=CaptureSettings(modes=modes, sizes=(2,), warmup_iters=1))


class TestPipelineRunsTheSchedule:
    def test_two_streams_fork_wait_record_and_capture_with_the_side_stream(self):
        backend, calls = LoggingBackend(), []
        with run_pipeline(branches_plan(), RunOptions(detectors=False), backend=backend, model=Branches(calls)) as engine:
            assert all(r.bit_exact for r in engine.report.verify)
        eager = [("fork", "stream0", ("stream1",)), ("record", "e0", "stream0"), ("wait", "stream1", "e0"),
                 ("record", "e1", "stream1"), ("wait", "stream0", "e1")]
        # warmup (one iteration, verify's reference too); capture, whose recording runs the same schedule
        assert backend.log == [*eager, ("capture", "stream0", ("stream1",)), *eager]
        assert calls[:3] == ["left", "right", "merge"]

    def test_events_are_made_once_in_allocate(self):
        backend = LoggingBackend()
        with run_pipeline(branches_plan((Mode.PIECEWISE, Mode.FULL)), RunOptions(detectors=False), backend=backend, model=Branches([])):
            pass
        assert sorted(backend.labels.values()) == ["e0", "e1"]  # fork + one record, shared by every run

    def test_one_stream_forks_and_waits_nothing(self):
        backend = LoggingBackend()
        plan = branches_plan()
        plan = attrs.evolve(plan, segments=[attrs.evolve(s, stream="s0") for s in plan.segments])
        with run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=Branches([])):
            pass
        assert backend.log == [("capture", "stream0", ())]
        assert backend.labels == {}
