"""The capture pipeline on the CPU backend: phases, events, verify, rollback at every phase.

The CPU backend runs the same phases as CUDA with each region replayed eagerly, so the
pipeline's wiring and its rollback guarantees are tested here; ``tests/cuda`` proves the
same on a GPU with real graphs.
"""

from __future__ import annotations

import gc
import weakref

import attrs
import pytest
import torch

from graphflow.engine import CpuBackend, Outcome, RunOptions, run_pipeline
from graphflow.engine.backend import Graph
from graphflow.errors import CaptureError, InvalidPlanError, PlanError
from graphflow.events import EventKind, Phase
from graphflow.plan import (Buffer, BufferRole, CaptureSettings, Channel, ChannelKind, Descriptor, Mode, Plan,
                            Prewarm, Segment, SegmentKind, Stream, WarmupPolicy)
from graphflow.toy import build_toy, toy_plan

P, F = Mode.PIECEWISE, Mode.FULL
SEGMENT_EVENTS = (EventKind.SEGMENT_BEGIN, EventKind.SEGMENT_END)


class RecordingBackend(CpuBackend):
    """The CPU backend, remembering every graph and pool so tests can see them released."""

    def __init__(self, broken_destroys: int = 0):
        super().__init__()
        self.graphs: list[Graph] = []
        self.destroyed: list[Graph] = []
        self.pools: list[object] = []
        self.released: list[object] = []
        self.broken_destroys = broken_destroys

    def capture(self, calls, recording, stream, pool, side=()):
        graph = super().capture(calls, recording, stream, pool, side)
        destroy = graph.destroy

        def recorded_destroy():
            self.destroyed.append(graph)
            destroy()
            if self.broken_destroys:
                self.broken_destroys -= 1
                raise OSError("driver refused to free the graph")

        graph.destroy = recorded_destroy
        self.graphs.append(graph)
        return graph

    def new_pool(self, device):
        pool = super().new_pool(device)
        self.pools.append(pool)
        return pool

    def release_pool(self, pool):
        self.released.append(pool)


@attrs.define
class Rig:
    """A listener that tracks the phase, and wraps the model's segments to watch and fault them."""

    faults: dict = attrs.field(factory=dict)  # (phase, segment) -> exception to raise
    drift: set = attrs.field(factory=set)  # segments whose output changes at every verify call
    phase: Phase | None = None
    events: list = attrs.field(factory=list)
    calls: list = attrs.field(factory=list)  # (phase, segment, batch rows)
    refs: list = attrs.field(factory=list)  # weak references to every buffer a segment saw

    def on_event(self, event):
        self.events.append(event)
        if event.kind is EventKind.PHASE_BEGIN:
            self.phase = event.phase

    def wrap(self, name, fn):
        def segment(*args):
            self.calls.append((self.phase, name, args[0].shape[0]))
            self.refs.extend(weakref.ref(a if a._base is None else a._base) for a in args)
            fault = self.faults.get((self.phase, name))
            if fault is not None:
                raise fault
            fn(*args)
            if name in self.drift and self.phase is Phase.VERIFY:
                args[-1].add_(len(self.calls))

        return segment

    def kinds(self, phase=None):
        return [e.kind for e in self.events if phase is None or e.phase is phase]


def rigged(layers=3, rig=None, **plan_args):
    """The toy plan and model, with every segment wrapped by the rig."""
    rig = rig or Rig()
    plan = toy_plan(layers, device="cuda:0", **plan_args)
    model = build_toy(layers)
    for segment in plan.segments:
        *path, attr = segment.call.split(".")
        owner = model
        for part in path:
            owner = owner[int(part)] if part.isdigit() else getattr(owner, part)
        setattr(owner, attr, rig.wrap(segment.name, getattr(owner, attr)))
    return plan, model, rig


def run(plan, model, rig, backend=None, **options):
    options.setdefault("detectors", False)
    return run_pipeline(plan, RunOptions(**options), backend=backend or RecordingBackend(), model=model,
                        listeners=[rig])


def assert_rolled_back(backend: RecordingBackend, rig: Rig):
    assert backend.graphs, "the fault came after capture began, so graphs existed"
    assert set(map(id, backend.destroyed)) == set(map(id, backend.graphs))
    assert backend.released == backend.pools and backend.pools
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert rig.refs and all(ref() is None for ref in rig.refs), "static buffers are still alive"


class TestAllocate:
    def test_buffers_are_allocated_once_at_the_largest_size(self):
        plan, model, rig = rigged(sizes=(1, 2, 4, 8))
        with run(plan, model, rig) as engine:
            x = engine.buffers.tensors["x"]
            assert x.shape == (8, 32)
            assert engine.buffers.view("x", 2).shape == (2, 32)
            assert engine.buffers.view("x", 2).data_ptr() == x.data_ptr()

    def test_capacity_sets_the_allocation_and_caps_descriptors(self):
        plan, model, rig = rigged(sizes=(1, 2))
        cache = Buffer("cache", ("B", 4), "float32", "cpu", role=BufferRole.STATE, capacity={"B": 16})
        plan = attrs.evolve(plan, buffers=(*plan.buffers, cache))
        with run(plan, model, rig) as engine:
            assert engine.buffers.tensors["cache"].shape == (16, 4)
        small = Buffer("cache", ("B", 4), "float32", "cpu", role=BufferRole.STATE, capacity={"B": 1})
        events = len(rig.events)
        with pytest.raises(InvalidPlanError) as info:
            run(attrs.evolve(plan, buffers=(*plan.buffers[:-1], small)), model, rig)
        assert [d.code for d in info.value.report.errors] == ["GF604"]
        assert len(rig.events) == events, "refused before anything ran"

    def test_missing_call_path_names_the_segment_and_path(self):
        plan, model, rig = rigged()
        segments = list(plan.segments)
        segments[4] = attrs.evolve(segments[4], call="layers.1.mixx")
        with pytest.raises(CaptureError) as info:
            run(attrs.evolve(plan, segments=segments), model, rig)
        error = info.value
        assert (error.phase, error.segment) == ("allocate", "L1.mix")
        assert isinstance(error.__cause__, PlanError)
        assert str(error.__cause__) == ("segment L1.mix: call 'layers.1.mixx': layers.1 (ToyLayer) has no attribute "
                                        "'mixx' — fix the call path or the model")

    def test_index_out_of_range_in_call_path(self):
        plan, model, rig = rigged()
        segments = list(plan.segments)
        segments[0] = attrs.evolve(segments[0], call="layers.7.pre")
        with pytest.raises(CaptureError) as info:
            run(attrs.evolve(plan, segments=segments), model, rig)
        assert "layers (ModuleList) has no item '7'" in str(info.value.__cause__)

    def test_factory_gets_model_args_and_only_the_keywords_it_accepts(self):
        plan = toy_plan(2, device="cuda:0")
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False)) as engine:
            assert len(engine.model.layers) == 2
            assert engine.report.remapped == (("cuda:0", "cpu"),)
            assert not engine.report.captures_graphs

    def test_factory_receives_device_rank_world_size_and_plan(self, monkeypatch):
        seen = {}

        def factory(layers, *, device, rank, plan, **rest):
            seen.update(device=device, rank=rank, plan=plan, rest=rest)
            return build_toy(layers)

        import graphflow.toy

        monkeypatch.setattr(graphflow.toy, "factory_for_test", factory, raising=False)
        plan = attrs.evolve(toy_plan(2, device="cuda:0"), model="graphflow.toy:factory_for_test", model_args={"layers": 2})
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), rank=0, world_size=1):
            pass
        assert seen["device"] == torch.device("cpu") and seen["rank"] == 0 and seen["plan"] is plan
        assert seen["rest"] == {"world_size": 1}

    def test_channels_handles_go_to_the_factory_and_the_runtime_listens(self, monkeypatch):
        class Channels:
            handles = {"tp": "handle"}
            kinds: list = []

            def on_event(self, event):
                self.kinds.append(event.kind)

        got = {}

        def factory(channels):
            got["channels"] = channels
            return build_toy(2)

        import graphflow.toy

        monkeypatch.setattr(graphflow.toy, "factory_for_test", factory, raising=False)
        plan = attrs.evolve(toy_plan(2, device="cuda:0"), model="graphflow.toy:factory_for_test", model_args={})
        channels = Channels()
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), channels=channels):
            pass
        assert got["channels"] == {"tp": "handle"}
        assert channels.kinds[0] is EventKind.PIPELINE_BEGIN and channels.kinds[-1] is EventKind.PIPELINE_END

    def test_full_mode_with_an_eager_segment_is_refused(self):
        plan, model, rig = rigged(modes=(P, F))
        with pytest.raises(InvalidPlanError) as info:
            run(plan, model, rig)
        assert info.value.report.codes() == ("GF601",)
        assert "GF601 error segment L0.mix: FULL region of family target contains eager segment(s)" in str(info.value)

    def test_int_input_needs_values_for_verify(self):
        plan, model, rig = rigged()
        tokens = Buffer("tokens", ("B",), "int64", "cpu", role=BufferRole.INPUT)
        with pytest.raises(CaptureError) as info:
            run(attrs.evolve(plan, buffers=(*plan.buffers, tokens)), model, rig)
        assert info.value.message == "input buffer 'tokens' is int64 and declares no values"
        with run(attrs.evolve(plan, buffers=(*plan.buffers, tokens)), model, rig, verify=False):
            pass

    def test_sizes_restrict_descriptors(self):
        plan, model, rig = rigged()
        with run(plan, model, rig, sizes=[4, 1]) as engine:
            assert engine.descriptors == (Descriptor(P, 4), Descriptor(P, 1))
            assert engine.buffers.tensors["x"].shape == (4, 32)
        with pytest.raises(ValueError, match=r"sizes \[3\] are not among the plan's sizes \[1, 2, 4, 8\]"):
            run(plan, model, rig, sizes=[3])


class TestWarmup:
    def test_runs_every_segment_warmup_iters_times_per_descriptor_largest_first(self):
        plan, model, rig = rigged(layers=2, sizes=(2, 1, 4), warmup_iters=3)
        with run(plan, model, rig):
            pass
        warm = [(name, rows) for phase, name, rows in rig.calls if phase is Phase.WARMUP]
        step = [s.name for s in plan.segments]
        assert warm == [(n, size) for size in (4, 2, 1) for _ in range(3) for n in step]


class TestPrewarm:
    def test_hooks_run_once_per_size_or_once(self):
        plan, model, rig = rigged(sizes=(1, 4, 2), prewarm=(Prewarm("jit", "jit_prewarm"),
                                                           Prewarm("once", "setup", per_size=False)))
        seen = []
        model.jit_prewarm = lambda size: seen.append(("jit", size))
        model.setup = lambda: seen.append(("once", None))
        with run(plan, model, rig) as engine:
            assert engine.report.phase(Phase.PREWARM).outcome is Outcome.PASSED
        assert seen == [("jit", 4), ("jit", 2), ("jit", 1), ("once", None)]

    def test_without_hooks_the_phase_is_skipped(self):
        plan, model, rig = rigged()
        with run(plan, model, rig) as engine:
            assert engine.report.phase(Phase.PREWARM).outcome is Outcome.SKIPPED


class TestCapture:
    def test_piecewise_then_full_largest_first(self):
        plan, model, rig = rigged(layers=2, full=True, modes=(F, P), sizes=(1, 4, 2))
        with run(plan, model, rig):
            pass
        order = [e.descriptor for e in rig.events if e.kind is EventKind.DESCRIPTOR_BEGIN and e.phase is Phase.CAPTURE]
        assert order == [Descriptor(P, 4), Descriptor(P, 2), Descriptor(P, 1),
                         Descriptor(F, 4), Descriptor(F, 2), Descriptor(F, 1)]

    def test_one_graph_per_region_per_descriptor(self):
        plan, model, rig = rigged(layers=3, sizes=(1, 2))
        backend = RecordingBackend()
        with run(plan, model, rig, backend=backend) as engine:
            # regions: [L0.pre] [L0.post L1.pre] [L1.post L2.pre] [L2.post head]; 3 eager mixes between
            assert engine.report.graphs == len(backend.graphs) == 8
            assert len(engine.programs[Descriptor(P, 2)]) == 7
            regions = [e.region for e in rig.events if e.kind is EventKind.REGION_BEGIN]
            assert regions[:4] == ["target:L0.pre", "target:L0.post..L1.pre", "target:L1.post..L2.pre",
                                   "target:L2.post..head"]

    def test_gc_is_frozen_during_capture_only(self):
        plan, model, rig = rigged(layers=1, sizes=(1,))
        frozen = {}
        model.layers[0].pre = (lambda pre: lambda x, h: (frozen.setdefault(rig.phase, gc.get_freeze_count()),
                                                         pre(x, h)))(model.layers[0].pre)
        with run(plan, model, rig):
            assert gc.get_freeze_count() == 0
        assert frozen[Phase.CAPTURE] > 0 and frozen[Phase.WARMUP] == 0

    def test_close_destroys_graphs_and_releases_pools(self):
        plan, model, rig = rigged()
        backend = RecordingBackend()
        engine = run(plan, model, rig, backend=backend)
        engine.close()
        assert_rolled_back(backend, rig)
        assert engine.programs == {}


class TestVerify:
    def test_replay_equals_eager_bit_for_bit(self):
        plan, model, rig = rigged()
        with run(plan, model, rig) as engine:
            results = engine.report.verify
            assert [r.descriptor.size for r in results] == [8, 4, 2, 1]
            assert all(r.bit_exact and r.max_abs_diff == 0.0 for r in results)
            assert results[0].buffers == ("h0", "m0", "h1", "m1", "h2", "m2", "x", "logits")

    def test_eager_and_replay_start_from_the_same_random_inputs(self):
        plan, model, rig = rigged(layers=1, sizes=(2,))
        seen = []
        pre = model.layers[0].pre
        model.layers[0].pre = lambda x, h: (seen.append((rig.phase, x.clone())), pre(x, h))
        with run(plan, model, rig):
            pass
        verify = [x for phase, x in seen if phase is Phase.VERIFY]
        assert len(verify) == 2 and torch.equal(verify[0], verify[1])
        assert verify[0].abs().sum() > 0, "inputs were filled randomly"

    def test_int_inputs_are_drawn_from_values(self):
        plan, model, rig = rigged(layers=1, sizes=(8,))
        tokens = Buffer("tokens", ("B", 64), "int64", "cuda:0", role=BufferRole.INPUT, values=(3, 7))
        ids = Buffer("ids", ("B", 64), "int64", "cuda:0")
        seen = []
        model.lookup = lambda t, i: (seen.append(t.clone()), i.copy_(t))
        plan = attrs.evolve(plan, buffers=(*plan.buffers, tokens, ids), segments=(
            *plan.segments, Segment("lookup", SegmentKind.GRAPH, "lookup", reads=("tokens",), writes=("ids",),
                                    stream="s0")))
        with run(plan, model, rig):
            pass
        drawn = seen[-1]
        assert int(drawn.min()) == 3 and int(drawn.max()) == 6

    def test_state_buffers_are_restored_after_verify(self):
        plan, model, rig = rigged(layers=1, sizes=(2,))
        cache = Buffer("cache", ("B", 32), "float32", "cuda:0", role=BufferRole.STATE)
        seen = {}

        def append(x, c):
            c.add_(x)
            seen["cache"] = c
            seen.setdefault(rig.phase, []).append(c.clone())

        model.append = append
        plan = attrs.evolve(plan, buffers=(*plan.buffers, cache), segments=(
            *plan.segments, Segment("append", SegmentKind.GRAPH, "append", reads=("x", "cache"), writes=("cache",),
                                    stream="s0")))

        class Snapshot:
            def on_event(self, event):
                if event.phase is Phase.VERIFY and event.kind in (EventKind.PHASE_BEGIN, EventKind.PHASE_END):
                    seen[event.kind] = seen["cache"].clone()

        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[rig, Snapshot()]):
            pass
        assert torch.equal(seen[EventKind.PHASE_BEGIN], seen[EventKind.PHASE_END])
        eager, replay = seen[Phase.VERIFY]
        assert torch.equal(eager, replay) and not torch.equal(eager, seen[EventKind.PHASE_END])

    def test_mismatch_fails_naming_descriptor_buffer_and_segment(self):
        plan, model, rig = rigged()
        rig.drift.add("L1.post")
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        error = info.value
        # L1.post adds a different constant to x in each run; h2 = pre(x) normalizes it away,
        # so the first buffer in final-write order that differs is x itself, last written by
        # L2.post; replaying one region at a time from the eager step's values finds L1.post.
        assert (error.phase, error.descriptor, error.segment) == ("verify", Descriptor(P, 8), "L1.post")
        assert error.message.startswith("graph replay of PIECEWISE(B=8) differs from eager in buffer 'x' (last "
                                        "written by L2.post; it or an earlier segment diverged): 256 of 256 elements, "
                                        "max |diff| ")
        assert error.message.endswith("; replayed from the eager step's own values, region target:L1.post..L2.pre "
                                      "first differs in segment L1.post ('x')")
        assert error.hint.startswith("look in L1.post for work whose result a graph does not replay")
        assert "atol" not in error.hint  # the drift is no float rounding
        assert_rolled_back(backend, rig)

    def test_tolerance_accepts_small_differences(self):
        plan, model, rig = rigged(atol=1e9)
        rig.drift.add("L1.post")
        with run(plan, model, rig) as engine:
            assert not engine.report.verify[0].bit_exact and engine.report.verify[0].max_abs_diff > 0

    def test_no_verify_skips_the_phase(self):
        plan, model, rig = rigged()
        rig.drift.add("L1.post")
        with run(plan, model, rig, verify=False) as engine:
            assert engine.report.phase(Phase.VERIFY).outcome is Outcome.SKIPPED and engine.report.verify == ()


class TestEvents:
    def test_sequence_for_one_descriptor(self):
        plan, model, rig = rigged(layers=1, sizes=(2,))
        with run(plan, model, rig):
            pass
        K = EventKind
        assert [k for k in rig.kinds() if k not in SEGMENT_EVENTS] == [
            K.PIPELINE_BEGIN,
            K.PHASE_BEGIN, K.PHASE_END,  # allocate
            K.PHASE_BEGIN, K.DESCRIPTOR_BEGIN, K.DESCRIPTOR_END, K.PHASE_END,  # warmup
            K.PHASE_BEGIN, K.PHASE_END,  # prewarm
            K.PHASE_BEGIN, K.DESCRIPTOR_BEGIN, K.REGION_BEGIN, K.REGION_END, K.REGION_BEGIN, K.REGION_END,
            K.DESCRIPTOR_END, K.PHASE_END,  # capture: [L0.pre], eager mix, [L0.post, head]
            K.PHASE_BEGIN, K.DESCRIPTOR_BEGIN, K.DESCRIPTOR_END, K.PHASE_END,  # verify
            K.PHASE_BEGIN, K.PHASE_END,  # commit
            K.PIPELINE_END,
        ]
        assert [e.phase for e in rig.events if e.kind is K.PHASE_BEGIN] == [
            Phase.ALLOCATE, Phase.WARMUP, Phase.PREWARM, Phase.CAPTURE, Phase.VERIFY, Phase.COMMIT]

    def test_events_carry_rank_index_total_and_elapsed(self):
        plan, model, rig = rigged(layers=1, sizes=(1, 2))
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[rig], rank=3, world_size=4):
            pass
        assert {e.rank for e in rig.events} == {3}
        ends = [e for e in rig.events if e.kind is EventKind.DESCRIPTOR_END and e.phase is Phase.CAPTURE]
        assert [(e.index, e.total, e.descriptor) for e in ends] == [(1, 2, Descriptor(P, 2)), (2, 2, Descriptor(P, 1))]
        assert all(e.elapsed_s >= 0 for e in ends)

    def test_segments_of_other_ranks_are_left_out(self):
        plan, model, rig = rigged(layers=1, sizes=(1,))
        segments = list(plan.segments)
        segments[1] = attrs.evolve(segments[1], ranks=(1,))
        # Rank 1's mix is all that writes m0, so the plan's dataflow is broken on rank 0:
        # GF201 is skipped to see the engine leave the segment out.
        plan = attrs.evolve(plan, segments=segments, world_size=2)
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False, skip_rules={"GF201"}), model=model,
                          listeners=[rig], rank=0, world_size=2):
            pass
        assert "L0.mix" not in {name for _, name, _ in rig.calls}

    def test_defer_registers_an_undo_run_at_close(self):
        plan, model, rig = rigged(layers=1, sizes=(1,))
        released = []

        class Taker:
            def on_event(self, event):
                if event.kind is EventKind.PIPELINE_BEGIN:
                    event.defer("give back the channel", lambda: released.append("channel"))

        engine = run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[Taker()])
        assert released == []
        engine.close()
        assert released == ["channel"]


class TestSegmentEvents:
    def test_every_segment_call_is_bracketed_by_events_naming_it(self):
        plan, model, rig = rigged(layers=1, sizes=(2,), warmup_iters=1)

        class Interleave:  # segment events into the rig's call log, to see them around the calls
            def on_event(self, event):
                if event.kind in SEGMENT_EVENTS:
                    rig.calls.append((event.phase, event.kind, event.segment))

        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[rig, Interleave()]):
            pass
        B, E = EventKind.SEGMENT_BEGIN, EventKind.SEGMENT_END

        def bracketed(phase, *names):
            return [step for n in names for step in ((phase, B, n), (phase, "call", n), (phase, E, n))]

        log = [(c[0], "call", c[1]) if len(c) == 3 and isinstance(c[2], int) else c for c in rig.calls]
        step = ("L0.pre", "L0.mix", "L0.post", "head")
        assert log == [
            *bracketed(Phase.WARMUP, *step),
            *bracketed(Phase.CAPTURE, "L0.pre", "L0.post", "head"),  # the eager mix is not run in capture
            *bracketed(Phase.VERIFY, *step),  # the eager step
            # the replay: regions run as one call each; the eager break between them is bracketed
            (Phase.VERIFY, "call", "L0.pre"), *bracketed(Phase.VERIFY, "L0.mix"),
            (Phase.VERIFY, "call", "L0.post"), (Phase.VERIFY, "call", "head"),
        ]

    def test_segment_events_carry_descriptor_and_region(self):
        plan, model, rig = rigged(layers=1, sizes=(2,), warmup_iters=1)
        with run(plan, model, rig):
            pass
        first, second = [e.region for e in rig.events if e.kind is EventKind.REGION_BEGIN]
        begins = [e for e in rig.events if e.kind is EventKind.SEGMENT_BEGIN]
        assert {e.descriptor for e in begins} == {Descriptor(P, 2)}
        assert [(e.segment, e.region) for e in begins if e.phase is Phase.CAPTURE] == [
            ("L0.pre", first), ("L0.post", second), ("head", second)]
        assert {e.region for e in begins if e.phase is not Phase.CAPTURE} == {None}

    def test_without_listeners_no_event_is_built(self, monkeypatch):
        import graphflow.engine.context as context

        built = []
        real = context.Event

        def counting(kind, **fields):
            built.append(kind)
            return real(kind, **fields)

        monkeypatch.setattr(context, "Event", counting)
        plan, model, _ = rigged(layers=1, sizes=(2,), warmup_iters=1)
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model):
            pass
        assert built == []
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[Rig()]):
            pass
        assert built.count(EventKind.SEGMENT_BEGIN) == built.count(EventKind.SEGMENT_END) == 4 + 3 + 4 + 1

    def test_a_failing_segment_has_no_end_and_the_rollback_names_it(self):
        plan, model, rig = rigged(layers=1, sizes=(2,), rig=Rig(faults=_fault(Phase.CAPTURE, "L0.post")))
        with pytest.raises(CaptureError):
            run(plan, model, rig)
        last, rollback = [e for e in rig.events if e.kind in (*SEGMENT_EVENTS, EventKind.ROLLBACK)][-2:]
        assert (last.kind, last.phase, last.segment) == (EventKind.SEGMENT_BEGIN, Phase.CAPTURE, "L0.post")
        assert (rollback.kind, rollback.segment) == (EventKind.ROLLBACK, "L0.post")


class TestChannels:
    """The engine with the channel runtime as its listener, at world size 1, on the CPU backend."""

    @staticmethod
    def _plan(warmup=WarmupPolicy.REAL, *, prewarm=None, hooks=(), model=None):
        g = SegmentKind.GRAPH
        return Plan(
            name="shared-channel",
            buffers=[Buffer("x", ("B", 4), "float32", "cuda:0", role=BufferRole.INPUT),
                     Buffer("h", ("B", 4), "float32", "cuda:0"),
                     Buffer("y", ("B", 4), "float32", "cuda:0", role=BufferRole.OUTPUT)],
            streams=[Stream("s0", "cuda:0")],
            channels=[Channel("tp", ChannelKind.ALL_REDUCE, "tp", 1, "target", warmup, prewarm=prewarm)],
            segments=[Segment("a", g, "a", reads=["x"], writes=["h"], channels=["tp"], stream="s0"),
                      Segment("b", g, "b", reads=["h"], writes=["y"], channels=["tp"], stream="s0")],
            prewarm=hooks, model=model,
            capture=CaptureSettings(modes=[P], sizes=[1, 2], warmup_iters=1),
        )

    class Model:
        """Two segments of one region, both all-reducing on ``tp``: the plan cannot say which calls."""

        def __init__(self, channels):
            self.channels = channels

        def a(self, x, h):
            torch.mul(x, 2.0, out=h)
            self.channels["tp"].all_reduce(h)

        def b(self, h, y):
            torch.add(h, 1.0, out=y)
            self.channels["tp"].all_reduce(y)

    def test_the_trace_names_the_running_segment_where_the_plan_cannot(self, tmp_path):
        from graphflow.session import Session
        from graphflow.trace import read_trace

        plan = self._plan()
        assert len(plan.regions(P)) == 1  # a and b share one region and one channel
        with Session(plan, RunOptions(backend="cpu"), trace=str(tmp_path)) as session:
            session.capture(self.Model(session.handles))
        calls = [(e["phase"], e["descriptor"], e["segment"]) for e in read_trace(tmp_path / "rank0.jsonl")
                 if e["event"] == "collective"]
        named = [(phase, d, s) for phase, d, s in calls if phase != "verify"]
        assert named == [(phase, f"PIECEWISE(B={size})", s) for phase in ("warmup", "capture")
                         for size in (2, 1) for s in ("a", "b")]
        # verify: the eager step is named; the CPU backend's replay of the region is one call
        assert [s for phase, _, s in calls if phase == "verify"] == ["a", "b", None, None] * 2

    def test_a_prepare_hook_declared_in_the_plan_resolves_on_the_built_model(self, monkeypatch):
        """Warmup calls the channel's prewarm hook (bound from the factory's model), never the wire."""
        import graphflow.channels as channels_module
        import graphflow.toy
        from graphflow.channels import GroupBinding
        from graphflow.session import Session

        wire = object()
        log = []
        runtime = None

        def all_reduce(tensor, group=None):
            assert group is wire
            log.append(("all_reduce", runtime.site.phase))

        Model = self.Model

        def factory(channels):
            model = Model(channels)
            model.comm = type("Comm", (), {"prepare": lambda _, size: log.append(("prepare", size,
                                                                                    runtime.site.phase))})()
            return model

        monkeypatch.setattr(channels_module.dist, "all_reduce", all_reduce)
        monkeypatch.setattr(graphflow.toy, "channel_factory_for_test", factory, raising=False)
        plan = self._plan(WarmupPolicy.PREPARE, prewarm="warm_tp", hooks=[Prewarm("warm_tp", "comm.prepare")],
                          model="graphflow.toy:channel_factory_for_test")
        session = Session(plan, RunOptions(backend="cpu", detectors=False),
                          group_factory=lambda name: GroupBinding(name, wire, (0,)))
        runtime = session.channels
        engine = session.capture()
        warmup = [entry for entry in log if entry[-1] is Phase.WARMUP]
        # once per specialization: both segments all-reduce [B, 4] float32, so once per size
        assert warmup == [("prepare", 2, Phase.WARMUP), ("prepare", 1, Phase.WARMUP)]
        assert ("prepare", 2, Phase.PREWARM) in log  # the pipeline's own prewarm phase runs it too
        assert {entry[1] for entry in log if entry[0] == "all_reduce"} == {Phase.CAPTURE, Phase.VERIFY}
        engine.close()
        with pytest.raises(CaptureError, match="channel tp has warmup 'prepare' but no prepare hook"):
            runtime.resolve_prepare(plan.channels[0])  # close unbound the model
        session.close()


def _fault(phase, segment, exc=None):
    return {(phase, segment): exc or RuntimeError(f"injected in {segment}")}


class TestRollback:
    @pytest.mark.parametrize("segment", ["L0.pre", "L1.mix", "head"])
    def test_fault_in_warmup(self, segment):
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.WARMUP, segment)))
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        error = info.value
        assert (error.phase, error.descriptor, error.segment, error.rank) == ("warmup", Descriptor(P, 8), segment, 0)
        assert str(error) == (f"[phase=warmup descriptor=PIECEWISE(B=8) segment={segment} rank=0] RuntimeError: "
                              f"injected in {segment} — the step fails when run eagerly: fix the segment, or run it "
                              f"without graphflow to debug")
        assert error.__cause__ is rig.faults[(Phase.WARMUP, segment)]
        assert backend.graphs == [] and backend.released == backend.pools
        assert gc.get_freeze_count() == 0
        assert rig.kinds()[-1] is EventKind.ROLLBACK

    @pytest.mark.parametrize("segment,region", [("L0.pre", "target:L0.pre"), ("L1.post", "target:L1.post..L2.pre"),
                                                ("head", "target:L2.post..head")])
    def test_fault_in_capture(self, segment, region):
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.CAPTURE, segment)))
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        error = info.value
        assert (error.phase, error.descriptor, error.segment) == ("capture", Descriptor(P, 8), segment)
        assert error.message == f"RuntimeError in region {region}: injected in {segment}"
        if segment != "L0.pre":
            assert_rolled_back(backend, rig)
        assert gc.get_freeze_count() == 0

    def test_fault_on_a_later_descriptor_destroys_the_earlier_graphs(self):
        plan, model, rig = rigged()
        calls = {"n": 0}
        head = model.head

        def fails_on_the_third_capture(x, logits):
            if rig.phase is Phase.CAPTURE:
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("capture failed")
            head(x, logits)

        model.head = fails_on_the_third_capture
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        assert info.value.descriptor == Descriptor(P, 2)
        assert len(backend.graphs) == 11  # 4 + 4 graphs, then 3 of the third descriptor's; the 4th failed
        assert_rolled_back(backend, rig)

    def test_fault_in_prewarm(self):
        plan, model, rig = rigged(prewarm=(Prewarm("jit", "jit_prewarm"),))
        model.jit_prewarm = lambda size: (_ for _ in ()).throw(ImportError("kernel module missing"))
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig)
        assert (info.value.phase, info.value.segment) == ("prewarm", "prewarm jit")
        assert "ImportError: kernel module missing" in str(info.value)

    @pytest.mark.parametrize("phase", [Phase.ALLOCATE, Phase.WARMUP, Phase.CAPTURE, Phase.VERIFY, Phase.COMMIT])
    def test_listener_raising_at_a_phase_fails_and_rolls_back(self, phase):
        plan, model, rig = rigged()

        class Broken:
            def on_event(self, event):
                if event.kind is EventKind.PHASE_END and event.phase is phase:
                    raise TimeoutError("barrier timed out after 60 s")

        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=model, listeners=[rig, Broken()])
        error = info.value
        assert error.phase == phase.value
        assert error.message == "listener Broken raised TimeoutError: barrier timed out after 60 s"
        assert error.hint.startswith("a rank or barrier did not answer in time")
        assert isinstance(error.__cause__, TimeoutError)
        if phase in (Phase.CAPTURE, Phase.VERIFY, Phase.COMMIT):
            assert_rolled_back(backend, rig)
        assert rig.kinds()[-1] is EventKind.ROLLBACK

    def test_listener_raising_at_pipeline_end_undoes_the_commit(self):
        plan, model, rig = rigged()

        class Broken:
            def on_event(self, event):
                if event.kind is EventKind.PIPELINE_END:
                    raise RuntimeError("trace write failed")

        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=model, listeners=[rig, Broken()])
        assert info.value.phase is None
        assert_rolled_back(backend, rig)

    def test_keyboard_interrupt_rolls_back_and_is_re_raised(self):
        interrupt = KeyboardInterrupt()
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.CAPTURE, "L1.post", interrupt)))
        backend = RecordingBackend()
        with pytest.raises(KeyboardInterrupt) as info:
            run(plan, model, rig, backend=backend)
        assert info.value is interrupt
        assert_rolled_back(backend, rig)

    def test_an_undo_that_raises_does_not_stop_the_others(self):
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.VERIFY, "L2.mix")))
        backend = RecordingBackend(broken_destroys=2)
        released = []

        class Taker:
            def on_event(self, event):
                if event.kind is EventKind.PIPELINE_BEGIN:
                    event.defer("give back the channel", lambda: released.append("channel"))
                if event.kind is EventKind.PHASE_BEGIN and event.phase is Phase.CAPTURE:
                    event.defer("reset the capture flag", lambda: (_ for _ in ()).throw(ValueError("flag stuck")))

        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=model, listeners=[rig, Taker()])
        error = info.value
        assert (error.phase, error.segment) == ("verify", "L2.mix")
        assert released == ["channel"]
        assert_rolled_back(backend, rig)
        group = error.undo_error
        assert isinstance(group, ExceptionGroup)
        assert [type(e) for e in group.exceptions] == [OSError, OSError, ValueError]
        assert group.exceptions[2].__notes__ == ["while undoing: reset the capture flag"]
        assert error.__notes__ == ["rollback: 3 rollback step(s) failed (3 sub-exceptions): OSError: driver refused "
                                   "to free the graph; OSError: driver refused to free the graph; ValueError: flag stuck"]

    def test_rollback_listener_failure_is_reported_not_raised(self):
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.WARMUP, "L0.pre")))

        class BrokenOnRollback:
            def on_event(self, event):
                if event.kind is EventKind.ROLLBACK:
                    raise RuntimeError("cannot write trace")

        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[rig, BrokenOnRollback()])
        assert info.value.segment == "L0.pre"
        assert [type(e) for e in info.value.undo_error.exceptions] == [RuntimeError]

    def test_a_later_pipeline_runs_after_a_rollback(self):
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.CAPTURE, "head")))
        with pytest.raises(CaptureError):
            run(plan, model, rig)
        rig.faults.clear()
        with run(plan, model, rig) as engine:
            assert all(r.bit_exact for r in engine.report.verify)


class TestDetectors:
    def _syncing_plan(self):
        plan, model, rig = rigged(layers=2, sizes=(2, 1))
        post = model.layers[1].post
        model.layers[1].post = lambda m, x: (float(m.sum().item()), post(m, x))
        return plan, model, rig

    def test_host_sync_in_a_graph_segment_fails_warmup_naming_it(self):
        plan, model, rig = self._syncing_plan()
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend, detectors=True)
        error = info.value
        assert (error.phase, error.descriptor, error.segment) == ("warmup", Descriptor(P, 2), "L1.post")
        assert error.message.startswith("capture-safety detectors found 1 problem(s): [host_sync] L1.post: ")
        assert "--disable-check" in error.hint
        assert backend.graphs == [] and gc.get_freeze_count() == 0

    def test_eager_segments_are_not_watched(self):
        plan, model, rig = rigged(layers=2, sizes=(2,))  # mix reads ints from tensors: eager, so allowed
        with run(plan, model, rig, detectors=True) as engine:
            assert engine.report.phase(Phase.CAPTURE).outcome is Outcome.PASSED

    def test_detectors_can_be_turned_off_or_one_check_disabled(self):
        plan, model, rig = self._syncing_plan()
        with run(plan, model, rig, detectors=False):
            pass
        with run(plan, model, rig, detectors=True, disabled_checks=["host_sync"]):
            pass

    def test_unknown_check_name_fails_where_the_options_are_made(self):
        with pytest.raises(ValueError, match="^unknown check 'hostsync': the checks are host_sync, "):
            RunOptions(disabled_checks=["hostsync"])


def test_plan_without_model_factory_or_model():
    plan = attrs.evolve(toy_plan(1, device="cuda:0"), model=None)
    with pytest.raises(CaptureError) as info:
        run_pipeline(plan, RunOptions(backend="cpu", detectors=False))
    assert isinstance(info.value.__cause__, PlanError)
    assert "the plan names no model factory" in str(info.value)


def test_plan_with_no_graph_segments_is_fine():
    plan = Plan(name="empty", capture=toy_plan(1).capture)
    with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=object()) as engine:
        assert engine.report.graphs == 0
