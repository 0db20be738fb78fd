"""The capture pipeline on the CPU backend: phases, events, verify, rollback at every phase.

The CPU backend runs the same phases as CUDA with each region replayed eagerly, so the
pipeline's wiring and its rollback guarantees are tested here; ``tests/cuda`` proves the
same on a GPU with real graphs.
"""

from __future__ import annotations

import gc
import traceback
import weakref

import attrs
import pytest
import torch

from graphflow.engine import CpuBackend, Outcome, RunOptions, run_pipeline
from graphflow.engine.backend import Graph
from graphflow.engine.snapshots import VerifyPlan
from graphflow.errors import CaptureError, InvalidPlanError, PlanError
from graphflow.events import EventKind, Phase
from graphflow.plan import (Buffer, BufferRole, CaptureSettings, Channel, ChannelKind, Descriptor, Mode, Plan,
                            Prewarm, Segment, SegmentKind, Stream, WarmupPolicy)
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan
from tests.source_markers import marked

P, F = Mode.PIECEWISE, Mode.FULL
at = marked(__file__)
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
                                        "'mixx', did you mean 'mix'? — fix the call path or the model")

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

        import plans.toy_model

        monkeypatch.setattr(plans.toy_model, "factory_for_test", factory, raising=False)
        plan = attrs.evolve(toy_plan(2, device="cuda:0"), model="plans.toy_model:factory_for_test", model_args={"layers": 2})
        with run_pipeline(plan, RunOptions(backend="cpu", detectors=False), rank=0, world_size=1):
            pass
        assert seen["device"] == torch.device("cpu") and seen["rank"] == 0 and seen["plan"] is plan
        assert seen["rest"] == {"world_size": 1}

    def test_channels_handles_go_to_the_factory_and_the_runtime_listens(self, monkeypatch):
        class Channels:
            handles = {"tp": "handle"}
            kinds: list = []

            def bind(self, model):
                pass

            def on_event(self, event):
                self.kinds.append(event.kind)

        got = {}

        def factory(channels):
            got["channels"] = channels
            return build_toy(2)

        import plans.toy_model

        monkeypatch.setattr(plans.toy_model, "factory_for_test", factory, raising=False)
        plan = attrs.evolve(toy_plan(2, device="cuda:0"), model="plans.toy_model:factory_for_test", model_args={})
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

    def test_room_is_made_once_per_descriptor_before_its_first_region_not_per_graph(self):
        plan, model, rig = rigged(layers=3, sizes=(1, 2))
        backend = RecordingBackend()
        order = []
        backend.make_room = lambda device: order.append(("room", device.type))
        capture = backend.capture
        backend.capture = lambda *args, **kw: (order.append("graph"), capture(*args, **kw))[1]
        with run(plan, model, rig, backend=backend):
            pass
        assert order == [("room", "cpu"), *["graph"] * 4] * 2

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
            assert results[0].buffers == ("x", "logits"), "what the step leaves behind, in last-write order"

    def test_the_replay_starts_from_the_inputs_of_the_last_warmup_run_its_reference(self):
        plan, model, rig = rigged(layers=1, sizes=(2,))
        seen = []
        pre = model.layers[0].pre
        model.layers[0].pre = lambda x, h: (seen.append((rig.phase, x.clone())), pre(x, h))
        with run(plan, model, rig):
            pass
        warm = [x for phase, x in seen if phase is Phase.WARMUP]
        verify = [x for phase, x in seen if phase is Phase.VERIFY]
        assert len(warm) == plan.capture.warmup_iters and len(verify) == 1, "verify reruns nothing eagerly"
        assert torch.equal(warm[-1], verify[0])
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
        (replay,) = seen[Phase.VERIFY]
        eager = seen[Phase.WARMUP][-1]  # the reference: warmup's last run
        assert torch.equal(eager, replay) and not torch.equal(replay, seen[EventKind.PHASE_END])

    def test_scratch_the_replay_leaves_otherwise_is_no_mismatch_and_is_not_copied(self):
        # An internal buffer is written before it is read in every step (the validator's
        # rule), so only what the step leaves behind (outputs, state, written inputs)
        # decides a replay; a scratch buffer may hold anything once it has been read.
        plan, model, rig = rigged(layers=1, sizes=(2,))
        scratch = Buffer("scratch", ("B", 32), "float32", "cuda:0")
        calls = []

        def noisy(x, s):
            calls.append(rig.phase)
            s.fill_(len(calls))  # differs in every run: warmup's and the replay's

        def use(s, x):
            x.add_(s * 0)

        model.noisy, model.use = noisy, use
        plan = attrs.evolve(plan, buffers=(*plan.buffers, scratch), segments=(
            *plan.segments[:1],
            Segment("noisy", SegmentKind.GRAPH, "noisy", reads=("x",), writes=("scratch",), stream="s0"),
            Segment("use", SegmentKind.GRAPH, "use", reads=("scratch", "x"), writes=("x",), stream="s0"),
            *plan.segments[1:]))
        with run(plan, model, rig) as engine:
            (result,) = engine.report.verify
            assert result.bit_exact and Phase.VERIFY in calls
            assert result.buffers == ("x", "logits")
        assert "scratch" not in VerifyPlan.of(plan, plan.segments).written, "nor snapshot"

    def test_mismatch_fails_naming_descriptor_buffer_and_segment(self):
        plan, model, rig = rigged()
        rig.drift.add("L1.pre")
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        error = info.value
        # L1.pre adds a constant to h1 in the replay only; everything after it differs too:
        # the step leaves x and logits behind, x first in final-write order. Replayed item
        # by item, the first segment whose writes differ is L1.pre.
        assert (error.phase, error.descriptor, error.segment) == ("verify", Descriptor(P, 8), "L1.pre")
        assert error.message.startswith("graph replay of PIECEWISE(B=8) differs from eager in buffer 'x' (last "
                                        "written by L2.post; it or an earlier segment diverged): 256 of 256 elements, "
                                        "max |diff| ")
        assert error.message.endswith("; replayed from the eager step's own values, region target:L0.post..L1.pre "
                                      "first differs in segment L1.pre ('h1')")
        assert error.hint.startswith("look in L1.pre for work whose result a graph does not replay")
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
            # verify's reference is warmup's run; the replay: regions run as one call each, the
            # eager break between them is bracketed
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
        # warmup's 4 segments, capture's 3 graph segments, the replay's eager break
        assert built.count(EventKind.SEGMENT_BEGIN) == built.count(EventKind.SEGMENT_END) == 4 + 3 + 1

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
        from graphflow.dist.trace import read_trace

        plan = self._plan()
        assert len(plan.regions(P)) == 1  # a and b share one region and one channel
        with Session(plan, RunOptions(backend="cpu"), trace=str(tmp_path)) as session:
            session.capture(self.Model(session.handles))
        calls = [(e["phase"], e["descriptor"], e["segment"]) for e in read_trace(tmp_path / "rank0.jsonl")
                 if e["event"] == "collective"]
        # each descriptor in turn: warmup (the first descriptor twice: the host-state check
        # reads a second step of a channel plan), capture, then verify's replay, which the
        # CPU backend runs as one call for the region (so the plan cannot name the segment)
        warmups = {2: 2, 1: 1}
        assert calls == [(phase, f"PIECEWISE(B={size})", s) for size in (2, 1)
                         for phase, s in ((("warmup", "a"), ("warmup", "b")) * warmups[size]
                                          + (("capture", "a"), ("capture", "b"), ("verify", None), ("verify", None)))]

    def test_a_prepare_hook_declared_in_the_plan_resolves_on_the_built_model(self, monkeypatch):
        """Warmup calls the channel's prewarm hook (bound from the factory's model), never the wire."""
        import graphflow.dist.channels as channels_module
        import plans.toy_model
        from graphflow.dist.channels import GroupBinding
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
        monkeypatch.setattr(plans.toy_model, "channel_factory_for_test", factory, raising=False)
        plan = self._plan(WarmupPolicy.PREPARE, prewarm="warm_tp", hooks=[Prewarm("warm_tp", "comm.prepare")],
                          model="plans.toy_model:channel_factory_for_test")
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

    @pytest.mark.parametrize("phase", [Phase.ALLOCATE, Phase.WARMUP, Phase.PREWARM, Phase.CAPTURE, Phase.VERIFY,
                                       Phase.COMMIT])
    def test_keyboard_interrupt_at_any_phase_rolls_back_and_the_next_pipeline_commits(self, phase):
        plan, model, rig = rigged(prewarm=(Prewarm("warm", "warm", per_size=False),))
        model.warm = lambda: None
        interrupt = KeyboardInterrupt()

        class Interrupting:
            armed = True

            def on_event(self, event):
                if self.armed and event.kind is EventKind.PHASE_END and event.phase is phase:
                    self.armed = False
                    raise interrupt

        backend = RecordingBackend()
        with pytest.raises(KeyboardInterrupt) as info:
            run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=model, listeners=[rig, Interrupting()])
        assert info.value is interrupt and info.value.__traceback__ is not None
        assert rig.kinds()[-1] is EventKind.ROLLBACK
        if phase in (Phase.CAPTURE, Phase.VERIFY, Phase.COMMIT):
            assert_rolled_back(backend, rig)
        assert gc.get_freeze_count() == 0 and backend.released == backend.pools
        with run(plan, model, rig) as engine:
            assert all(r.bit_exact for r in engine.report.verify)

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
        note, where = group.exceptions[2].__notes__
        assert note == "while undoing: reset the capture flag"
        assert where.startswith("raised at (most recent call last):\n") and "in unwind" in where
        assert error.__notes__ == ["rollback: 3 rollback step(s) failed (3 sub-exceptions): OSError: driver refused "
                                   "to free the graph; OSError: driver refused to free the graph; ValueError: flag stuck"]

    def test_a_clean_rollback_names_the_phase_as_a_phase_and_no_undo_error(self):
        plan, model, rig = rigged(rig=Rig(faults=_fault(Phase.WARMUP, "L0.pre")))
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(backend="cpu", detectors=False), model=model, listeners=[rig])
        error = info.value
        assert error.phase is Phase.WARMUP and error.undo_error is None
        assert str(error).startswith("[phase=warmup descriptor=")

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


class Holding(Exception):
    """A model's own exception that keeps what it complains about."""

    def __init__(self, message, model, tensor):
        super().__init__(message, tensor)
        self.model = model


class Binder:
    """Stands in for the channel runtime: the pipeline binds the model it built to it."""

    handles: dict = {}

    def __init__(self):
        self.refs = []

    def bind(self, model):
        if model is not None:
            self.refs.append(weakref.ref(model))

    def on_event(self, event):
        pass


class TestCaptureErrorPhase:
    """A phase given by its name is the ``Phase``, however it reaches the error; a name
    outside the pipeline's phases (an integration's own) stays a name."""

    def test_a_pipeline_phase_by_name_is_the_phase(self):
        error = CaptureError("boom", phase="capture", rank=0)
        assert error.phase is Phase.CAPTURE and error.phase == "capture"
        assert str(error) == "[phase=capture rank=0] boom"

    def test_a_phase_filled_in_later_is_the_phase_too(self):
        error = CaptureError("boom")
        error.phase = "verify"
        assert error.phase is Phase.VERIFY

    def test_another_lifecycles_phase_stays_its_name(self):
        error = CaptureError("refused", phase="validate")
        assert error.phase == "validate" and not isinstance(error.phase, Phase)
        assert str(error) == "[phase=validate] refused"


class TestErrorsKeepNoObjects:
    """An error that crossed rollback keeps its message and its traceback as text, and
    none of the model, buffers or graphs, however long the caller holds it."""

    def test_a_bad_call_path_does_not_keep_the_model_the_factory_built(self):
        plan = toy_plan(2, device="cuda:0")
        plan = attrs.evolve(plan, segments=[attrs.evolve(plan.segments[0], call="nope.pre"), *plan.segments[1:]])
        binder = Binder()
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(backend="cpu", detectors=False), channels=binder)
        gc.collect()
        assert binder.refs and binder.refs[0]() is None, "the error keeps the model alive"
        attribute_error = info.value.__cause__.__cause__
        assert isinstance(attribute_error, AttributeError) and attribute_error.obj is None
        assert str(attribute_error) == "'Toy' object has no attribute 'nope'"
        assert attribute_error.__traceback__ is None
        (note,) = attribute_error.__notes__
        assert note.startswith("raised at (most recent call last):\n  File ")
        assert "binding.py" in note and "in resolve" in note
        assert "in resolve" in "".join(traceback.format_exception(info.value))

    def test_a_failed_capture_keeps_no_model_buffer_or_graph(self):
        backend = RecordingBackend(broken_destroys=1)
        refs, rig = [], Rig()

        def build():  # the model, referenced by nothing but the pipeline
            _, model, _ = rigged(rig=rig)
            post = model.layers[1].post

            def post_holding(m, x):
                if rig.phase is Phase.CAPTURE:
                    raise Holding("bad step", model, m)
                post(m, x)

            model.layers[1].post = post_holding
            refs.append(weakref.ref(model))
            return model

        with pytest.raises(CaptureError) as info:
            run_pipeline(toy_plan(3, device="cuda:0"), RunOptions(detectors=False), backend=backend, model=build(),
                         listeners=[rig])
        error = info.value
        gc.collect()
        assert refs[0]() is None, "the error keeps the model alive"
        assert rig.refs and all(ref() is None for ref in rig.refs), "the error keeps static buffers alive"
        graphs = [weakref.ref(g) for g in backend.graphs]
        backend.graphs.clear(), backend.destroyed.clear()
        gc.collect()
        assert all(ref() is None for ref in graphs), "the error keeps a graph alive"
        cause = error.__cause__
        assert isinstance(cause, Holding) and cause.args[0] == "bad step" and isinstance(cause.args[1], str)
        assert cause.model.startswith("Toy(")
        assert error.message == "Holding in region target:L1.post..L2.pre: ('bad step', " + cause.args[1] + ")"
        (undo,) = error.undo_error.exceptions
        assert undo.__traceback__ is None and "in recorded_destroy" in undo.__notes__[-1]


    def test_a_session_capture_error_does_not_keep_the_model_it_was_given(self):
        from graphflow.session import Session

        refs = []

        def build():
            model = build_toy(3)
            model.layers[2].pre = None  # not callable: refused in allocate
            refs.append(weakref.ref(model))
            return model

        with Session(toy_plan(3, device="cuda:0"), RunOptions(backend="cpu", detectors=False)) as session:
            with pytest.raises(CaptureError, match="call 'layers.2.pre' is a NoneType, not a callable") as info:
                session.capture(build())
            gc.collect()
            assert refs[0]() is None, "the error keeps the model alive"
            assert info.value.phase == "allocate"


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
        assert "RunOptions(disabled_checks={'host_sync'})" in error.hint
        assert backend.graphs == [] and gc.get_freeze_count() == 0

    @pytest.mark.parametrize("phase", [Phase.WARMUP, Phase.CAPTURE])
    def test_a_flagged_op_that_raises_makes_the_finding_the_headline_and_the_error_its_cause(self, phase):
        plan, model, rig = rigged(layers=2, sizes=(2, 1))
        post = model.layers[1].post
        unloaded = torch.zeros(2, 32, device="meta")  # a tensor never materialized from the meta device

        def post_reading_a_meta_tensor(m, x):
            if rig.phase is phase:
                m.copy_(unloaded)  # <meta-copy>
            post(m, x)

        model.layers[1].post = post_reading_a_meta_tensor
        backend = RecordingBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend, detectors=True)
        error = info.value
        assert (error.phase, error.descriptor, error.segment) == (phase.value, Descriptor(P, 2), "L1.post")
        assert error.message.startswith("capture-safety detectors found 1 problem(s): [cross_device] L1.post: "
                                        f"aten.copy_ (Tensor.copy_) at {at('meta-copy')}: ")
        assert error.message.endswith("; then NotImplementedError: Cannot copy out of meta tensor; no data!")
        assert isinstance(error.__cause__, NotImplementedError)
        assert gc.get_freeze_count() == 0

    def test_a_tensor_allocated_in_capture_and_returned_escapes(self):
        plan, model, rig = rigged(layers=2, sizes=(2, 1))
        post = model.layers[1].post

        def post_returning_a_new_tensor(m, x):
            post(m, x)
            return x * 2  # <returned>

        model.layers[1].post = post_returning_a_new_tensor
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, detectors=True)
        error = info.value
        assert (error.phase, error.descriptor, error.segment) == ("capture", Descriptor(P, 2), "L1.post")
        assert error.message.startswith("capture-safety detectors found 1 problem(s): [escape] L1.post: "
                                        f"aten.mul (Tensor.mul) at {at('returned')}: a float32 tensor on cpu "
                                        "created inside the captured region and still referenced after the segment "
                                        "returned")

    def test_a_segment_returning_its_output_buffer_passes(self):
        plan, model, rig = rigged(layers=2, sizes=(2, 1))
        head = model.head
        model.head = lambda x, logits: (head(x, logits), logits)[1]
        with run(plan, model, rig, detectors=True) as engine:
            assert engine.report.phase(Phase.CAPTURE).outcome is Outcome.PASSED

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


class TestMemoryBeforeCapture:
    """The static buffers and verify's copies are checked against free memory before any
    buffer exists; the pool is estimated after a mode's two largest captures."""

    class Tight(RecordingBackend):
        def __init__(self, free=None, pools=None):
            super().__init__()
            self.free, self.pools_after = free, pools  # graphs captured -> pool bytes

        def free_memory(self, device):
            return self.free

        def pool_bytes(self, pool):
            return None if self.pools_after is None else self.pools_after.get(len(self.graphs))

    def test_a_plan_that_does_not_fit_fails_in_allocate_naming_the_shortfall_and_the_largest_buffers(self):
        plan, model, rig = rigged(sizes=(1, 2, 4, 8))
        backend = self.Tight(free=1000)
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        error = info.value
        assert error.phase == "allocate" and backend.graphs == []
        assert error.message.startswith("the plan needs ")
        assert " short. The largest buffers: " in error.message and "h{0..2}" in error.message
        assert "RunOptions(sizes=...)" in error.hint and "verify=False" not in error.hint

    def test_without_verify_the_copies_are_not_counted(self):
        plan, model, rig = rigged(sizes=(1, 2, 4, 8))
        buffers = sum(plan.static_memory()["cuda:0"].values())
        with run(plan, model, rig, backend=self.Tight(free=buffers), verify=False):
            pass
        with pytest.raises(CaptureError, match="for verify's copies"):
            run(plan, model, rig, backend=self.Tight(free=buffers))

    def test_the_pool_is_estimated_after_the_two_largest_and_checked_before_the_rest(self):
        plan, model, rig = rigged(sizes=(1, 2, 4, 8))
        # 100 bytes after the first descriptor, 130 after the second: 30 more for each of the
        # 2 left, so 190 in all; 50 free is not enough for the 60 still to come.
        big = 10 ** 9
        pools = {4: 100, 8: 130, 12: 160, 16: 190}  # the toy step has 4 regions
        backend = self.Tight(free=big, pools=pools)
        with run(plan, model, rig, backend=backend) as engine:
            assert engine.report.pool_estimate == {"PIECEWISE": 190}
        backend = self.Tight(free=big, pools=pools)
        # Room for the buffers before the model is built and again before they are allocated.
        backend.free_memory = lambda device, calls=[]: big if not calls.append(0) and len(calls) <= 2 else 50
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        assert (info.value.phase, info.value.descriptor) == ("capture", Descriptor(P, 4))
        assert info.value.message.startswith("the capture pool would grow to about 190 B for the 2 PIECEWISE "
                                             "descriptors left")
        assert_rolled_back(backend, rig)


class TestDetectorScope:
    """The detectors watch the first descriptor of each mode unless asked for all."""

    def _syncing_at_one_row(self):
        plan, model, rig = rigged(layers=2, sizes=(2, 1))
        post = model.layers[1].post
        model.layers[1].post = lambda m, x: ((float(m.sum().item()) if m.shape[0] == 1 else None), post(m, x))
        return plan, model, rig

    def test_first_watches_the_largest_descriptor_only(self):
        plan, model, rig = self._syncing_at_one_row()
        with run(plan, model, rig, detectors="first"):
            pass

    def test_all_watches_every_descriptor(self):
        plan, model, rig = self._syncing_at_one_row()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, detectors="all")
        assert (info.value.phase, info.value.descriptor, info.value.segment) == ("warmup", Descriptor(P, 1), "L1.post")

    def test_true_and_false_mean_first_and_off(self):
        from graphflow.engine.options import Watch

        assert (RunOptions(detectors=True).detectors, RunOptions(detectors=False).detectors) == (Watch.FIRST,
                                                                                                 Watch.OFF)


class TestVerifyCopies:
    """Verify's snapshots: one pass to compare, memory reused across descriptors."""

    def test_floats_are_compared_by_their_bits(self):
        from graphflow.engine.verify import _equal

        a = torch.tensor([1.0, float("nan"), 0.0])
        assert bool(_equal(a, a.clone()))
        assert not bool(_equal(torch.tensor([0.0]), torch.tensor([-0.0]))), "bit for bit: -0.0 is not 0.0"
        other_nan = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
        assert not bool(_equal(torch.tensor([float("nan")]), other_nan)), "a NaN of other bits differs"
        b = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
        assert bool(_equal(b[:, 1:], b.clone()[:, 1:])), "views that are not contiguous compare too"
        assert not bool(_equal(torch.tensor([1, 2]), torch.tensor([1, 3])))

    def test_copies_take_each_size_into_the_same_memory(self):
        from graphflow.engine.buffers import Copies, StaticBuffers

        plan = toy_plan(1, device="cpu", sizes=(1, 4))
        buffers = StaticBuffers(plan, 4, lambda _: torch.device("cpu"))
        copies = Copies(buffers, ["x", "logits"])
        rooms = {n: t.data_ptr() for n, t in copies.tensors.items()}
        for size in (4, 1):
            views = buffers.views(size)
            views["x"].copy_(torch.randn_like(views["x"]))
            taken = copies.take(views, size)
            assert taken["x"].shape == views["x"].shape and torch.equal(taken["x"], views["x"])
            assert {n: t.data_ptr() for n, t in taken.items()} == rooms
            views["x"].zero_()
            assert not torch.equal(taken["x"], views["x"]), "a copy, not a view of the buffer"
        copies.clear()
        assert copies.tensors == {}

    def test_the_snapshots_are_made_once_and_freed_before_commit(self, monkeypatch):
        from graphflow.engine.buffers import Copies

        plan, model, rig = rigged(sizes=(1, 2, 4))
        seen = []
        made, cleared = Copies.__init__, Copies.clear
        monkeypatch.setattr(Copies, "__init__", lambda self, *a: (seen.append(("made", rig.phase)), made(self, *a))[1])
        monkeypatch.setattr(Copies, "clear", lambda self: (seen.append(("freed", rig.phase)), cleared(self))[1])
        with run(plan, model, rig) as engine:
            assert all(r.bit_exact for r in engine.report.verify) and len(engine.report.verify) == 3
        assert seen[:4] == [("made", Phase.ALLOCATE)] * 2 + [("freed", Phase.VERIFY)] * 2, "not one per descriptor"

    def test_a_bit_exact_replay_leaves_the_state_it_wrote_in_place(self):
        from graphflow.engine.verify import VerifyResult, _still_to_restore

        expected = {"cache": torch.ones(2), "x": torch.ones(2)}
        kept = {"cache": expected["cache"], "other": torch.zeros(2)}
        exact = VerifyResult(Descriptor(P, 2), ("cache", "x"), 0.0, True)
        assert set(_still_to_restore(kept, expected, exact, referenced=False)) == {"other"}
        assert _still_to_restore(kept, expected, attrs.evolve(exact, bit_exact=False), referenced=False) == kept
        assert _still_to_restore(kept, expected, exact, referenced=True) == kept, "the reference ran since"
        cloned = {"cache": expected["cache"].clone()}
        assert _still_to_restore(cloned, expected, exact, referenced=False) == cloned, "a copy made here goes back"


class _Late(Graph):
    """A graph that can replay only once ``ready()`` says so, as a CUDA graph still being
    instantiated on the backend's worker thread; ``fail`` makes ready refuse it."""

    def __init__(self, inner: Graph, fail: bool):
        self.inner, self.fail = inner, fail
        self.replay = self._too_soon

    def _too_soon(self):
        raise AssertionError("replayed before ready()")

    def ready(self):
        if self.fail:
            raise RuntimeError("the driver refused the graph")
        self.replay = self.inner.replay

    def destroy(self):
        self.inner.destroy()
        self.replay = self._too_soon


class LateBackend(CpuBackend):
    instantiates_later = True

    def __init__(self, fail_at: int | None = None):
        super().__init__()
        self.graphs: list[_Late] = []
        self.fail_at = fail_at

    def capture(self, calls, recording, stream, pool, side=()):
        graph = _Late(super().capture(calls, recording, stream, pool, side), len(self.graphs) == self.fail_at)
        self.graphs.append(graph)
        return graph


class TestGraphsReadyLater:
    """The pipeline waits for its graphs to be ready (``Captured.settle``) before anything
    replays, and publishes their bare replays."""

    @pytest.mark.parametrize("verify", [True, False])
    def test_nothing_replays_before_ready_and_programs_hold_the_ready_replays(self, verify):
        backend = LateBackend()
        with run_pipeline(toy_plan(3, sizes=(4, 2)), RunOptions(backend="cpu", verify=verify),
                          backend=backend) as engine:
            assert len(engine.report.verify) == (2 if verify else 0)
            ready = {g.inner.replay for g in backend.graphs}
            held = [call for program in engine.programs.values() for call in program if call in ready]
            assert len(held) == len(backend.graphs) == 8
            runner = Runner(engine)
            x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
            (out,) = runner.run(x)
            views = engine.buffers.views(4)
            got = out.clone()
            views["x"].zero_()
            views["x"][:3].copy_(x)
            for call in engine.eager_calls(4):
                call()
            assert torch.equal(got, views["logits"][:3])

    def test_a_graph_never_ready_fails_its_descriptors_capture_and_rolls_back(self):
        backend = LateBackend(fail_at=5)  # the second descriptor's second graph
        with pytest.raises(CaptureError) as info:
            run_pipeline(toy_plan(3, sizes=(4, 2)), RunOptions(backend="cpu"), backend=backend)
        error = info.value
        assert (error.phase, error.descriptor) == ("capture", Descriptor(P, 2))
        assert "could not be made replayable" in error.message and "the driver refused the graph" in error.message
        assert all(g.replay == g._too_soon for g in backend.graphs), "a graph was not destroyed"


class TestVerifyBehind:
    """With graphs ready later and room for a second pair of snapshots, each descriptor is
    verified after the next one's warmup and capture."""

    @staticmethod
    def order(rig):
        return [(e.phase.value[0].upper(), e.descriptor.size) for e in rig.events
                if e.kind is EventKind.DESCRIPTOR_BEGIN and e.phase in (Phase.WARMUP, Phase.CAPTURE, Phase.VERIFY)]

    def test_each_descriptor_is_verified_after_the_next_ones_capture(self):
        plan, model, rig = rigged()
        with run(plan, model, rig, backend=LateBackend()) as engine:
            assert [r.descriptor.size for r in engine.report.verify] == [8, 4, 2, 1]
            assert all(r.bit_exact for r in engine.report.verify)
        assert self.order(rig) == [("W", 8), ("C", 8), ("W", 4), ("C", 4), ("V", 8), ("W", 2), ("C", 2), ("V", 4),
                                   ("W", 1), ("C", 1), ("V", 2), ("V", 1)]

    def test_a_mismatch_found_one_behind_still_names_its_descriptor_and_segment(self):
        plan, model, rig = rigged()
        rig.drift.add("L1.pre")
        backend = LateBackend()
        with pytest.raises(CaptureError) as info:
            run(plan, model, rig, backend=backend)
        error = info.value
        assert (error.phase, error.descriptor, error.segment) == ("verify", Descriptor(P, 8), "L1.pre")
        assert error.message.endswith("region target:L0.post..L1.pre first differs in segment L1.pre ('h1')")
        assert ("C", 4) in self.order(rig), "found before the next descriptor was captured: not one behind"
        assert all(g.replay == g._too_soon for g in backend.graphs), "a graph was not destroyed"

    def test_several_ranks_verify_each_capture_at_once_whatever_their_memory(self):
        plan, model, rig = rigged(sizes=(2, 4))
        with run_pipeline(plan, RunOptions(detectors=False), backend=LateBackend(), model=model, listeners=[rig],
                          rank=0, world_size=2) as engine:
            assert all(r.bit_exact for r in engine.report.verify)
        assert self.order(rig) == [("W", 4), ("C", 4), ("V", 4), ("W", 2), ("C", 2), ("V", 2)]

    def test_without_room_for_a_second_pair_each_capture_is_verified_at_once(self, monkeypatch):
        from graphflow.engine import allocate

        monkeypatch.setattr(allocate, "SPARE_BYTES", 1 << 62)
        plan, model, rig = rigged(sizes=(2, 4))
        with run(plan, model, rig, backend=LateBackend()) as engine:
            assert all(r.bit_exact for r in engine.report.verify)
        assert self.order(rig) == [("W", 4), ("C", 4), ("V", 4), ("W", 2), ("C", 2), ("V", 2)]


@pytest.mark.parametrize("free,taken,short", [
    (80 << 30, None, True),  # before any capture: the largest descriptor comes first
    (80 << 30, 1 << 30, False),
    (3 << 30, 2 << 30, True),  # less than twice what a descriptor took
    (512 << 20, 1 << 20, True),  # below the floor, however little was taken
    (5 << 30, 2 << 30, False),
])
def test_the_cache_is_given_back_only_when_the_device_is_short(free, taken, short):
    from graphflow.engine.backend import short_of_room

    assert short_of_room(free, taken) is short


def test_a_forked_child_makes_its_own_instantiation_worker():
    import os

    from graphflow.engine import backend

    parent = backend._instantiator()
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # the child: the parent's worker thread is not here
        os.close(read)
        os.write(write, b"1" if backend._instantiator() is not parent else b"0")
        os._exit(0)
    os.close(write)
    said = os.read(read, 1)
    os.waitpid(child, 0)
    os.close(read)
    assert said == b"1"
