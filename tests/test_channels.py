"""The channel runtime in one process: paths by phase and policy, ids, isolation, teardown.

Events come from a small driver (the engine's Event protocol, with a LIFO defer stack)
or from the real engine on the CPU backend. A ``Wire`` stands in for the process
group: it records which collectives really communicated, which is what the warmup
policies are about.
"""

from __future__ import annotations

import threading

import attrs
import pytest
import torch
import torch.distributed as dist

from graphflow.dist import channels as channels_module
from graphflow.dist.channels import ChannelRegistry, ChannelRuntime, GroupBinding
from graphflow.errors import CaptureError, DivergenceError
from graphflow.events import Event, EventKind, Phase
from graphflow.plan import (Buffer, BufferRole, CaptureSettings, Channel, ChannelKind, Descriptor, Family, Mode, Plan,
                            Prewarm, Segment, SegmentKind, Stream, WarmupPolicy)
from graphflow.dist.trace import CallPath, Tracer, read_trace
from locus_driver import LocusDriver

P = Descriptor(Mode.PIECEWISE, 2)


def _plan(warmup=WarmupPolicy.REAL, kind=ChannelKind.ALL_REDUCE, prewarm=None, hooks=()):
    return Plan(
        name="ch",
        buffers=[Buffer("x", ("B", 4), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("y", ("B", 4), "float32", "cuda:0", role=BufferRole.OUTPUT),
                 Buffer("dx", ("B", 4), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("dy", ("B", 4), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        streams=[Stream("s0", "cuda:0")],
        channels=[Channel("tp", kind, "tp", 1, "target", warmup, prewarm=prewarm),
                  Channel("dr", ChannelKind.ALL_REDUCE, "tp", 2, "draft")],
        segments=[Segment("s", SegmentKind.GRAPH, "s", reads=["x"], writes=["y"], channels=["tp"], stream="s0"),
                  Segment("d", SegmentKind.GRAPH, "d", reads=["dx"], writes=["dy"], channels=["dr"], family="draft",
                          stream="s0")],
        families=[Family("target"), Family("draft")],
        prewarm=hooks,
        capture=CaptureSettings(modes=[Mode.PIECEWISE], sizes=[1, 2]),
    )


class Wire:
    """A fake process group: records the collectives that really communicated."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self.group = object()
        for name in ("all_reduce", "all_to_all_single", "send", "recv"):
            monkeypatch.setattr(channels_module.dist, name, self._recorder(name))
        monkeypatch.setattr(channels_module, "_all_gather_into", self._recorder("all_gather"))

    def _recorder(self, name):
        def collective(*args, group=None):
            assert group is self.group
            self.calls.append(name)
        return collective

    def factory(self, name):
        return GroupBinding(name, self.group, (0,))


class Driver:
    """Emits the engine's events to a listener, and keeps its rollback stack and its locus
    (where the pipeline is, which the runtime reads between events) as the engine does."""

    def __init__(self, listener):
        self.listener = listener
        self.undos: list[tuple[str, object]] = []
        self.walk = LocusDriver()

    def emit(self, kind, **fields):
        event = self.walk.event(kind, defer=lambda label, fn: self.undos.append((label, fn)), **fields)
        self.listener.on_event(event)
        self.walk.after(kind)

    def begin(self, phase):
        self.emit(EventKind.PHASE_BEGIN, phase=phase)
        if phase is not Phase.ALLOCATE:
            self.emit(EventKind.DESCRIPTOR_BEGIN, phase=phase, descriptor=P)

    def end(self, phase):
        if phase is not Phase.ALLOCATE:
            self.emit(EventKind.DESCRIPTOR_END, phase=phase, descriptor=P)
        self.emit(EventKind.PHASE_END, phase=phase)

    def rollback(self):
        self.emit(EventKind.ROLLBACK, error="RuntimeError: boom")
        while self.undos:
            self.undos.pop()[1]()


def _runtime(plan=None, wire=None, **kwargs):
    plan = plan or _plan()
    return ChannelRuntime(plan, group_factory=wire.factory if wire else None, **kwargs)


class TestWorldSizeOne:
    def test_all_reduce_without_a_process_group_is_the_identity(self):
        runtime = _runtime()
        x = torch.arange(4.0)
        assert runtime.handles["tp"].all_reduce(x) is x
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0]

    def test_all_gather_and_all_to_all_copy_their_input(self):
        x = torch.arange(6.0).view(2, 3)
        for kind, method in ((ChannelKind.ALL_GATHER, "all_gather"), (ChannelKind.ALL_TO_ALL, "all_to_all")):
            out = getattr(_runtime(_plan(kind=kind)).handles["tp"], method)(x)
            assert out.tolist() == x.tolist() and out.data_ptr() != x.data_ptr()

    def test_p2p_needs_a_process_group(self):
        handle = _runtime(_plan(kind=ChannelKind.P2P)).handles["tp"]
        with pytest.raises(CaptureError, match="p2p channel tp needs a process group"):
            handle.send(torch.ones(2), 1)

    def test_calling_the_wrong_collective_names_the_channel_kind(self):
        handle = _runtime().handles["tp"]
        with pytest.raises(CaptureError, match="channel tp is all_reduce, called as all_gather"):
            handle.all_gather(torch.ones(2))


class TestPaths:
    """Which path each phase and warmup policy takes, and whether it communicated."""

    def _call_in(self, phase, warmup, monkeypatch, *, region=False, prepare=None):
        wire = Wire(monkeypatch)
        runtime = _runtime(_plan(warmup), wire)
        handle = runtime.handles["tp"]
        if prepare is not None:
            handle.set_prepare(prepare)
        driver = Driver(runtime)
        driver.emit(EventKind.PIPELINE_BEGIN)
        driver.begin(phase)
        if region:
            driver.emit(EventKind.REGION_BEGIN, phase=phase, descriptor=P, region="target:s")
        x = torch.full((2, 4), 5.0)
        path = handle.path()
        handle.all_reduce(x)
        return path, x, wire.calls, runtime

    @pytest.mark.parametrize("phase", [Phase.WARMUP, Phase.CAPTURE])
    def test_real_warmup_communicates(self, phase, monkeypatch):
        path, x, calls, _ = self._call_in(phase, WarmupPolicy.REAL, monkeypatch)
        assert (path, calls, x[0, 0].item()) == (CallPath.EAGER_WARMUP, ["all_reduce"], 5.0)

    def test_placeholder_fills_zeros_and_never_communicates(self, monkeypatch):
        path, x, calls, _ = self._call_in(Phase.WARMUP, WarmupPolicy.PLACEHOLDER, monkeypatch)
        assert (path, calls) == (CallPath.PLACEHOLDER, [])
        assert x.eq(0).all()

    def test_prepare_runs_the_hook_once_per_specialization_without_communicating(self, monkeypatch):
        seen = []
        path, x, calls, runtime = self._call_in(Phase.WARMUP, WarmupPolicy.PREPARE, monkeypatch,
                                                prepare=lambda t: seen.append(tuple(t.shape)))
        handle = runtime.handles["tp"]
        handle.all_reduce(torch.ones(2, 4))
        handle.all_reduce(torch.ones(1, 4))
        assert (path, calls, seen) == (CallPath.PREPARE, [], [(2, 4), (1, 4)])
        assert x.eq(0).all()

    def test_prepare_resolves_the_plans_prewarm_hook_on_the_bound_model(self, monkeypatch):
        wire = Wire(monkeypatch)
        plan = _plan(WarmupPolicy.PREPARE, prewarm="warm_ar", hooks=[Prewarm("warm_ar", "comm.prepare")])
        runtime = _runtime(plan, wire)
        seen = []

        class Comm:
            def prepare(self, size):
                seen.append(size)

        runtime.bind(type("Model", (), {"comm": Comm()})())
        driver = Driver(runtime)
        driver.emit(EventKind.PIPELINE_BEGIN)
        driver.begin(Phase.WARMUP)
        runtime.handles["tp"].all_reduce(torch.ones(2, 4))
        assert (seen, wire.calls) == ([2], [])  # as the prewarm hook is declared: with the descriptor's size

    def test_prepare_named_by_a_call_path_gets_the_input(self, monkeypatch):
        runtime = _runtime(_plan(WarmupPolicy.PREPARE, prewarm="comm.prepare"), Wire(monkeypatch))
        seen = []
        runtime.bind(type("Model", (), {"comm": type("Comm", (), {"prepare": lambda self, t: seen.append(t.shape)})()})())
        driver = Driver(runtime)
        driver.emit(EventKind.PIPELINE_BEGIN)
        driver.begin(Phase.WARMUP)
        runtime.handles["tp"].all_reduce(torch.ones(3, 4))
        assert seen == [torch.Size([3, 4])]

    def test_prepare_without_a_hook_says_how_to_declare_one(self, monkeypatch):
        with pytest.raises(CaptureError, match="channel tp has warmup 'prepare' but no prepare hook"):
            self._call_in(Phase.WARMUP, WarmupPolicy.PREPARE, monkeypatch)

    def test_a_collective_during_prewarm_is_refused(self, monkeypatch):
        with pytest.raises(CaptureError, match="channel tp was called during prewarm") as info:
            self._call_in(Phase.PREWARM, WarmupPolicy.REAL, monkeypatch)
        assert info.value.phase == "prewarm"

    @pytest.mark.parametrize("warmup", list(WarmupPolicy))
    def test_inside_a_capture_region_every_policy_is_real(self, warmup, monkeypatch):
        path, x, calls, _ = self._call_in(Phase.CAPTURE, warmup, monkeypatch, region=True)
        assert (path, calls, x[0, 0].item()) == (CallPath.CAPTURED, ["all_reduce"], 5.0)

    @pytest.mark.parametrize("warmup", list(WarmupPolicy))
    def test_verify_is_real(self, warmup, monkeypatch):
        path, _, calls, _ = self._call_in(Phase.VERIFY, warmup, monkeypatch)
        assert (path, calls) == (CallPath.OUTSIDE_CAPTURE, ["all_reduce"])

    def test_after_the_pipeline_the_hot_path_is_the_plain_collective(self, monkeypatch):
        wire = Wire(monkeypatch)
        runtime = _runtime(_plan(WarmupPolicy.PLACEHOLDER), wire)
        driver = Driver(runtime)
        driver.emit(EventKind.PIPELINE_BEGIN)
        driver.emit(EventKind.PIPELINE_END)
        runtime.handles["tp"].all_reduce(torch.ones(2))
        assert (runtime.fast, runtime.recording, wire.calls) == (True, False, ["all_reduce"])
        assert runtime.log.counter == 2  # begin and end; the hot-path call was not recorded


class TestAbandonedPipeline:
    """Two ranks as threads over one store: a rank that rolled back is never waited for in a collective."""

    def test_a_verify_collective_after_another_rank_rolled_back_raises_without_communicating(self, monkeypatch):
        wire = Wire(monkeypatch)
        store = dist.HashStore()
        runtimes = [ChannelRuntime(_plan(), rank=r, world_size=2, store=store, tracer=False, timeout_s=5,
                                   group_factory=lambda name: GroupBinding(name, wire.group, (0, 1)))
                    for r in range(2)]
        drivers = [Driver(r) for r in runtimes]
        rolled_back = threading.Event()
        errors = {}

        def rank(r):
            driver = drivers[r]
            driver.emit(EventKind.PIPELINE_BEGIN)
            driver.begin(Phase.VERIFY)
            if r == 1:
                driver.rollback()
                rolled_back.set()
                return
            rolled_back.wait(5)
            try:
                runtimes[0].handles["tp"].all_reduce(torch.ones(2, 4))
            except DivergenceError as e:
                errors[r] = e

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        error = errors[0]
        assert wire.calls == []
        assert (error.ranks, error.rank, error.phase, error.descriptor) == ((1,), 0, "verify", P)
        assert error.message == ("rank 1 abandoned the pipeline (RuntimeError: boom): rank 0 does not enter its "
                                 "all_reduce on tp, which rank 1 would never join")


class TestTraceEvents:
    def test_collective_event_names_segment_channel_shape_bytes_and_path(self, monkeypatch, tmp_path):
        wire = Wire(monkeypatch)
        runtime = _runtime(_plan(), wire, tracer=Tracer(tmp_path, 0))
        driver = Driver(runtime)
        driver.emit(EventKind.PIPELINE_BEGIN)
        driver.begin(Phase.CAPTURE)
        driver.emit(EventKind.REGION_BEGIN, phase=Phase.CAPTURE, descriptor=P, region="target:s")
        runtime.handles["tp"].all_reduce(torch.ones(2, 4))
        driver.emit(EventKind.REGION_END, phase=Phase.CAPTURE, descriptor=P, region="target:s")
        driver.end(Phase.CAPTURE)
        driver.emit(EventKind.PIPELINE_END)
        events = read_trace(tmp_path / "rank0.jsonl")
        assert [e["event"] for e in events] == ["pipeline_begin", "phase_begin", "descriptor_begin", "region_begin",
                                                "collective", "region_end", "descriptor_end", "phase_end",
                                                "pipeline_end"]
        call = events[4]
        assert {k: call[k] for k in ("n", "phase", "descriptor", "region", "segment", "channel", "family",
                                     "channel_id", "op", "shape", "bytes", "path", "capturing")} == {
            "n": 4, "phase": "capture", "descriptor": "PIECEWISE(B=2)", "region": "target:s", "segment": "s",
            "channel": "tp", "family": "target", "channel_id": 1, "op": "all_reduce", "shape": [2, 4],
            "bytes": 32, "path": "captured", "capturing": False}

    def test_tracing_off_writes_no_file_and_the_env_variable_turns_it_on(self, monkeypatch, tmp_path):
        monkeypatch.delenv("GRAPHFLOW_TRACE", raising=False)
        assert _runtime().tracer is None
        monkeypatch.setenv("GRAPHFLOW_TRACE", str(tmp_path))
        runtime = _runtime(rank=0)
        Driver(runtime).emit(EventKind.PIPELINE_BEGIN)
        runtime.close()
        assert [e["event"] for e in read_trace(tmp_path / "rank0.jsonl")] == ["pipeline_begin"]


class TestAssignment:
    def test_ids_are_taken_at_pipeline_begin_and_a_rollback_gives_them_back(self):
        registry = ChannelRegistry()
        runtime = _runtime(registry=registry, families=["target"])
        driver = Driver(runtime)
        assert registry.taken == {}
        driver.emit(EventKind.PIPELINE_BEGIN)
        assert registry.taken == {1: "target/tp"}
        assert [label for label, _ in driver.undos] == ["release channel ids"]
        driver.rollback()
        assert registry.taken == {}

    def test_a_failed_draft_capture_returns_only_the_drafts_ids(self):
        registry = ChannelRegistry()
        target = _runtime(registry=registry, families=["target"])
        Driver(target).emit(EventKind.PIPELINE_BEGIN)
        Driver(target).emit(EventKind.PIPELINE_END)
        draft = _runtime(registry=registry, families=["draft"])
        driver = Driver(draft)
        driver.emit(EventKind.PIPELINE_BEGIN)
        assert registry.taken == {1: "target/tp", 2: "draft/dr"}
        driver.rollback()
        assert registry.taken == {1: "target/tp"}
        assert registry.owner(1) is target.handles["tp"]

    def test_an_id_owned_by_another_family_is_refused(self):
        registry = ChannelRegistry()
        plan = _plan()
        clash = Plan(name="other", channels=[Channel("dr", ChannelKind.ALL_REDUCE, "tp", 1, "draft")],
                     families=[Family("draft")])
        Driver(_runtime(plan, registry=registry, families=["target"])).emit(EventKind.PIPELINE_BEGIN)
        with pytest.raises(CaptureError, match="channel id 1 of draft/dr is already owned by target/tp"):
            Driver(_runtime(clash, registry=registry)).emit(EventKind.PIPELINE_BEGIN)
        assert registry.taken == {1: "target/tp"}

    def test_each_family_has_its_own_handle_and_scratch_buffers(self):
        runtime = _runtime(_plan(kind=ChannelKind.ALL_GATHER))
        driver = Driver(runtime)
        driver.emit(EventKind.PIPELINE_BEGIN)
        target, draft = runtime.handles["tp"], runtime.handles["dr"]
        out = target.all_gather(torch.ones(2, 4))
        draft_out = draft.scratch((2, 4), torch.float32, torch.device("cpu"))
        assert target is not draft and out.data_ptr() != draft_out.data_ptr()
        runtime.registry.check_isolation()

    def test_a_shared_scratch_buffer_is_reported(self):
        runtime = _runtime(_plan(kind=ChannelKind.ALL_GATHER))
        Driver(runtime).emit(EventKind.PIPELINE_BEGIN)
        target, draft = runtime.handles["tp"], runtime.handles["dr"]
        target.all_gather(torch.ones(2, 4))
        draft._scratch.update(target._scratch)  # what sharing one channel between families amounts to
        with pytest.raises(CaptureError, match="channels target/tp and draft/dr share a scratch buffer"):
            runtime.registry.check_isolation()


class TestTeardown:
    STEPS = ("close channel tp", "close channel dr", "release channel ids", "destroy group tp",
             "let go of the process groups", "close trace")

    def _runtime(self, tmp_path, log, failing):
        def destroy():
            log.append("destroy group tp")
            if failing == "destroy group tp":
                raise OSError("destroy failed")

        def factory(name):
            return GroupBinding(name, None, (0,), destroy=destroy)

        runtime = ChannelRuntime(_plan(), group_factory=factory, tracer=Tracer(tmp_path, 0))
        Driver(runtime).emit(EventKind.PIPELINE_BEGIN)
        for name, handle in runtime.handles.items():
            handle.close = self._step(log, f"close channel {name}", failing, handle.close)
        runtime._rollback_ids = self._step(log, "release channel ids", failing, runtime._rollback_ids)
        runtime._release_groups = self._step(log, "let go of the process groups", failing, runtime._release_groups)
        runtime.tracer.close = self._step(log, "close trace", failing, runtime.tracer.close)
        return runtime

    def _step(self, log, label, failing, fn):
        def step():
            log.append(label)
            fn()
            if label == failing:
                raise OSError(f"{label} failed")
        return step

    def test_communicators_close_before_their_groups_and_everything_is_released(self, tmp_path):
        log = []
        runtime = self._runtime(tmp_path, log, failing=None)
        runtime.close()
        assert tuple(log) == self.STEPS
        assert runtime.registry.taken == {}
        with pytest.raises(CaptureError, match="channel tp is closed"):
            runtime.handles["tp"].all_reduce(torch.ones(1))

    @pytest.mark.parametrize("failing", STEPS)
    def test_every_step_runs_when_one_raises_and_the_failure_is_reported(self, tmp_path, failing):
        log = []
        runtime = self._runtime(tmp_path, log, failing)
        with pytest.raises(ExceptionGroup) as info:
            runtime.close()
        assert tuple(log) == self.STEPS
        assert info.value.message == "channel teardown: 1 of 6 steps failed"
        (error,) = info.value.exceptions
        assert error.__notes__ == [f"while undoing: {failing}"]
        assert runtime.registry.taken == {}


class TestWithTheEngine:
    """The runtime as the engine's listener, on the CPU backend, at world size 1."""

    class Model:
        def __init__(self, channels):
            self.channels = channels

        def s(self, x, y):
            torch.mul(x, 2.0, out=y)
            self.channels["tp"].all_reduce(y)

        def d(self, dx, dy):
            dy.copy_(dx)
            self.channels["dr"].all_reduce(dy)

    def test_pipeline_commits_with_one_trace_event_per_boundary_and_call(self, tmp_path):
        from graphflow.engine import RunOptions
        from graphflow.session import Session

        registry = ChannelRegistry()
        session = Session(_plan(), RunOptions(backend="cpu"), registry=registry, trace=str(tmp_path))
        session.capture(self.Model(session.handles))
        events = read_trace(tmp_path / "rank0.jsonl")
        paths = {(e["phase"], e["path"]) for e in events if e["event"] == "collective"}
        assert paths == {("warmup", "eager_warmup"), ("capture", "captured"), ("verify", "outside_capture")}
        calls = [e for e in events if e["event"] == "collective" and e["phase"] == "capture"]
        assert [(c["descriptor"], c["segment"], c["channel"]) for c in calls] == [
            ("PIECEWISE(B=2)", "s", "tp"), ("PIECEWISE(B=2)", "d", "dr"),
            ("PIECEWISE(B=1)", "s", "tp"), ("PIECEWISE(B=1)", "d", "dr")]
        assert [e["n"] for e in events] == list(range(len(events)))
        assert registry.taken == {1: "target/tp", 2: "draft/dr"}
        session.close()
        assert registry.taken == {}

    def test_the_runtime_is_what_the_engine_takes(self):
        from graphflow.engine.channels import ChannelRuntimeProtocol

        assert isinstance(_runtime(), ChannelRuntimeProtocol)

    def test_a_failed_capture_rolls_back_the_channel_ids(self):
        from graphflow.engine import RunOptions
        from graphflow.session import Session

        registry = ChannelRegistry()
        with Session(_plan(), RunOptions(backend="cpu"), registry=registry) as session:
            model = self.Model(session.handles)

            def broken(dx, dy):
                if session.channels.site.phase is Phase.CAPTURE:
                    raise RuntimeError("capture failed")
                dy.copy_(dx)

            model.d = broken
            with pytest.raises(CaptureError, match="capture failed"):
                session.capture(model)
            assert registry.taken == {}


def _collectives_over_gloo(ctx) -> dict:
    """One rank: every collective kind of a handle, on a real gloo group, outside any pipeline."""
    plan = Plan(
        name="kinds",
        buffers=[Buffer("x", ("B", 4), "float32", "cpu", role=BufferRole.INPUT),
                 Buffer("y", ("B", 4), "float32", "cpu", role=BufferRole.OUTPUT)],
        channels=[Channel("a2a", ChannelKind.ALL_TO_ALL, "tp", 1, "target"),
                  Channel("ag", ChannelKind.ALL_GATHER, "tp", 2, "target"),
                  Channel("ar", ChannelKind.ALL_REDUCE, "tp", 3, "target")],
        segments=[Segment("s", SegmentKind.GRAPH, "s", reads=["x"], writes=["y"], channels=["a2a", "ag", "ar"])],
        capture=CaptureSettings(modes=[Mode.PIECEWISE], sizes=[2]),
    )
    runtime = ChannelRuntime(plan, rank=ctx.rank, world_size=ctx.world_size, tracer=False, namespace="kinds")
    handles = runtime.handles
    # Row i of rank r holds 10 * r + i: all_to_all sends row j to rank j.
    rows = torch.tensor([[10.0 * ctx.rank + i] * 4 for i in range(ctx.world_size)])
    out = torch.empty_like(rows)
    returned = handles["a2a"].all_to_all(rows, out)
    scratch = handles["a2a"].all_to_all(rows)
    gathered = handles["ag"].all_gather(torch.full((1, 4), float(ctx.rank)))
    reduced = handles["ar"].all_reduce(torch.ones(2))
    runtime.close()
    return {"out": out[:, 0].tolist(), "same": returned is out, "scratch": scratch[:, 0].tolist(),
            "gathered": gathered[:, 0].tolist(), "reduced": reduced.tolist()}


class TestCollectivesOverGloo:
    """Three processes: what each collective kind of a handle delivers, on a real group."""

    def test_all_to_all_all_gather_and_all_reduce_deliver_every_ranks_data(self):
        from graphflow.dist.launch import launch

        world = 3
        results = launch(_collectives_over_gloo, world, "gloo", timeout_s=120)
        for rank, result in enumerate(results):
            assert result.ok, result.traceback
            value = result.value
            assert value["out"] == [10.0 * src + rank for src in range(world)]  # row `rank` of every rank
            assert value["same"] is True
            assert value["scratch"] == value["out"]
            assert value["gathered"] == [0.0, 1.0, 2.0]
            assert value["reduced"] == [3.0, 3.0]
