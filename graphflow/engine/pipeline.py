"""The capture pipeline: allocate → warmup → prewarm → capture → verify → commit.

See ``graphflow.engine`` for the lifecycle and its guarantees. This module holds the
phases themselves. Each phase returns a ``PhaseResult`` (outcome, timing, error) that
feeds both the report and the rollback decision; every resource a phase takes is
registered on one ``UndoStack`` the moment it is taken, so rollback after a failure
and ``Engine.close()`` after success run the same undos.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import gc
import time
import traceback
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch

from graphflow.engine.backend import Backend, Call, Graph, make_backend
from graphflow.engine.binding import build_model, resolve
from graphflow.engine.buffers import StaticBuffers
from graphflow.engine.rollback import UndoError, UndoStack
from graphflow.engine.schedule import Schedule, build_schedule, dependencies
from graphflow.errors import CaptureError
from graphflow.events import Event, EventKind, Listener, Phase
from graphflow.plan import BufferRole, CaptureRegion, Descriptor, Mode, Plan, Segment

__all__ = ["Engine", "Outcome", "PhaseResult", "PipelineReport", "VerifyResult", "run_pipeline"]


class Outcome(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@attrs.frozen
class PhaseResult:
    """One phase's outcome and timing (pytest's ``CallInfo``)."""

    phase: Phase
    outcome: Outcome
    start: float
    stop: float
    error: BaseException | None = attrs.field(default=None, eq=False)

    @property
    def duration(self) -> float:
        return self.stop - self.start


@attrs.frozen
class VerifyResult:
    """Graph replay against the eager step on the same random inputs, for one descriptor."""

    descriptor: Descriptor
    buffers: tuple[str, ...]
    max_abs_diff: float
    bit_exact: bool


@attrs.frozen
class PipelineReport:
    """What a committed pipeline did; ``graphflow run`` prints it."""

    backend: str
    captures_graphs: bool
    rank: int
    descriptors: tuple[Descriptor, ...]
    graphs: int
    phases: tuple[PhaseResult, ...]
    verify: tuple[VerifyResult, ...]
    pool_bytes: int | None
    buffer_bytes: int
    remapped: tuple[tuple[str, str], ...]

    def phase(self, phase: Phase) -> PhaseResult:
        return next(r for r in self.phases if r.phase is phase)


#: What to do when a phase fails, by phase: the last part of every CaptureError.
_HINTS = {
    Phase.ALLOCATE: "check the plan's model, call paths, buffer shapes and devices",
    Phase.WARMUP: "the step fails when run eagerly: fix the segment, or run it without graphflow to debug",
    Phase.PREWARM: "a prewarm hook failed: fix the hook or remove it from the plan's prewarm list",
    Phase.CAPTURE: "the segment is not capturable (a sync, .item(), an allocation or a host read): "
                   "fix it or make it an eager segment",
    Phase.VERIFY: "replay differs from eager: look for data-dependent control flow or an undeclared buffer in "
                  "the region; mark such work eager, declare the buffer, or set capture.verify tolerances",
    Phase.COMMIT: "a listener failed while publishing the graphs; fix the listener",
}


@attrs.define
class _Cursor:
    """Where the pipeline is, so any failure can name phase, descriptor, region, segment."""

    phase: Phase | None = None
    descriptor: Descriptor | None = None
    region: str | None = None
    segment: str | None = None
    listener: Listener | None = None


@attrs.frozen(eq=False)
class _BoundStep:
    """One scheduled segment with its stream and its events, looked up once."""

    stream: object
    waits: tuple[object, ...]  # events to wait on before the segment
    record: object | None  # the event to record after it


@attrs.frozen(eq=False)
class _Run:
    """A schedule (``graphflow.engine.schedule``) bound to this pipeline's streams and
    preallocated events."""

    origin: object
    side: tuple[object, ...]  # the forked streams
    fork: object | None  # the event the side streams wait on at the start
    steps: tuple[_BoundStep, ...]
    join: tuple[object, ...]  # the events the origin waits on at the end

    @classmethod
    def bind(cls, schedule: Schedule, events: Sequence[object]) -> _Run:
        recorded = {s.name: events[s.event] for s in schedule.steps if s.event is not None}
        steps = tuple(_BoundStep(s.stream, tuple(recorded[w] for w in s.waits),
                                 None if s.event is None else events[s.event]) for s in schedule.steps)
        fork = None if schedule.fork_event is None else events[schedule.fork_event]
        return cls(schedule.origin, schedule.fork, fork, steps, tuple(recorded[n] for n in schedule.join))


@attrs.define(eq=False)
class Engine:
    """A committed pipeline: captured graphs, static buffers, the model, and their undos.

    ``programs`` maps each captured descriptor to its step: a tuple of bare callables
    (graph replays and bound eager breaks, in order) that ``graphflow.runtime.Runner``
    runs. ``close()`` releases everything, as rollback would.
    """

    plan: Plan
    backend: Backend
    model: object
    buffers: StaticBuffers
    programs: dict[Descriptor, tuple[Call, ...]]
    segments: tuple[tuple[Segment, Callable[..., object]], ...]
    report: PipelineReport
    rank: int
    _stack: UndoStack

    @property
    def descriptors(self) -> tuple[Descriptor, ...]:
        return tuple(self.programs)

    def eager_calls(self, size: int, views: dict[str, torch.Tensor] | None = None) -> tuple[Call, ...]:
        """The whole step at ``size`` as bound eager calls (on the static views by default)."""
        views = self.buffers.views(size) if views is None else views
        return tuple(_bind(segment, fn, views) for segment, fn in self.segments)

    def close(self) -> None:
        """Destroy graphs, release pools and buffers, drop the model; raise if an undo failed."""
        self.programs = {}
        self.model = None
        self.segments = ()
        failures = self._stack.unwind()
        if failures is not None:
            raise failures

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def run_pipeline(
    plan: Plan,
    *,
    backend: Backend | str = "auto",
    model: object | None = None,
    rank: int = 0,
    world_size: int = 1,
    listeners: Sequence[Listener] = (),
    channels: object | None = None,
    verify: bool = True,
    detectors: bool = True,
    disabled_checks: Iterable[str] = (),
    sizes: Iterable[int] | None = None,
    seed: int = 0,
) -> Engine:
    """Run every phase and return the committed ``Engine``, or roll back and raise.

    ``model`` skips the plan's factory (tests, integrations that already hold one).
    ``channels`` (the channel runtime) is offered to the factory as ``channels.handles``,
    is bound to the model (``channels.bind(model)``, when it has ``bind``) and listens to
    every event. ``sizes`` restricts the plan's descriptor sizes. ``detectors=False``
    skips the capture-hazard detectors and ``disabled_checks`` names ``Check`` values to
    ignore. ``seed`` makes verify's random inputs reproducible, so a mismatch can be rerun.
    Raises ``CaptureError`` from the cause; ``KeyboardInterrupt`` is re-raised as is,
    after rollback.
    """
    backend = make_backend(backend) if isinstance(backend, str) else backend
    return _Pipeline(plan, backend, model=model, rank=rank, world_size=world_size,
                     listeners=(*listeners, *(() if channels is None else (channels,))), channels=channels,
                     verify=verify, detectors=detectors, disabled_checks=tuple(disabled_checks),
                     descriptors=_select(plan, sizes), seed=seed).run()


def _select(plan: Plan, sizes: Iterable[int] | None) -> tuple[Descriptor, ...]:
    descriptors = plan.descriptors()
    if sizes is None:
        return descriptors
    wanted = set(sizes)
    unknown = wanted - set(plan.capture.all_sizes)
    if unknown:
        raise ValueError(f"sizes {sorted(unknown)} are not among the plan's sizes {list(plan.capture.all_sizes)}")
    return tuple(d for d in descriptors if d.size in wanted)


def _bind(segment: Segment, fn: Callable[..., object], views: dict[str, torch.Tensor]) -> Call:
    """The calling convention: ``fn(*reads, *writes_not_in_reads)``, as views at one size."""
    names = (*segment.reads, *(w for w in segment.writes if w not in segment.reads))
    return functools.partial(fn, *(views[n] for n in names)) if names else fn


class _Pipeline:
    def __init__(self, plan: Plan, backend: Backend, *, model, rank, world_size, listeners, channels, verify,
                 detectors, disabled_checks, descriptors, seed):
        self.plan = plan
        self.backend = backend
        self.model = model
        self.rank = rank
        self.world_size = world_size
        self.listeners = tuple(listeners)
        # Checked once: with no listener, a segment call builds no events at all.
        self.segment_events = bool(self.listeners)
        self.channels = channels
        self.verify_on = verify
        self.detectors_on = detectors
        self.disabled_checks = disabled_checks
        self.descriptors = descriptors
        self.seed = seed
        self.segments = tuple(s for s in plan.segments if s.runs_on(rank))
        self.stack = UndoStack()
        self.cursor = _Cursor()
        self.results: list[PhaseResult] = []
        self.verify_results: list[VerifyResult] = []
        self.devices: dict[str, torch.device] = {}
        self.baseline: dict[torch.device, int] = {}
        self.pools: dict[torch.device, object] = {}
        self.streams: dict[str, object] = {}  # segment name -> the stream it runs on
        self.runs: dict[tuple[str, ...], _Run] = {}  # segment names (eager step, region) -> its schedule
        self.fns: dict[str, Callable[..., object]] = {}
        self.hooks: dict[str, Callable[..., object]] = {}
        self.buffers: StaticBuffers | None = None
        self.detectors = None
        self.findings_seen = 0
        self.graphs: list[Graph] = []
        self.programs: dict[Descriptor, tuple[Call, ...]] = {}
        self.engine: Engine | None = None
        self.pool_bytes: int | None = None
        self.descriptor_start = 0.0

    # -- driver ----------------------------------------------------------------------
    def run(self) -> Engine:
        try:
            self._emit(EventKind.PIPELINE_BEGIN, total=len(self.descriptors))
            # Inference only: autograd would record every op (and refuse ``out=`` into
            # buffers computed from weights that require grad).
            with torch.no_grad():
                for phase, body in ((Phase.ALLOCATE, self._allocate), (Phase.WARMUP, self._warmup),
                                    (Phase.PREWARM, self._prewarm), (Phase.CAPTURE, self._capture),
                                    (Phase.VERIFY, self._verify), (Phase.COMMIT, self._commit)):
                    self._phase(phase, body)
            self.cursor = _Cursor()
            self.engine.report = attrs.evolve(self.engine.report, phases=tuple(self.results))
            self._emit(EventKind.PIPELINE_END, total=len(self.descriptors), pool_bytes=self.pool_bytes)
        except BaseException as exc:  # noqa: BLE001 - every failure rolls back; re-raised below
            error = self._rollback(exc)
            if error is exc:
                raise
            raise error from exc
        return self.engine

    def _phase(self, phase: Phase, body: Callable[[], bool | None]) -> None:
        self.cursor = _Cursor(phase=phase)
        start = time.perf_counter()
        try:
            self._emit(EventKind.PHASE_BEGIN, phase=phase, total=len(self.descriptors))
            ran = body()
            self.cursor = _Cursor(phase=phase)
            self._emit(EventKind.PHASE_END, phase=phase, elapsed_s=time.perf_counter() - start,
                       total=len(self.descriptors), pool_bytes=self.pool_bytes)
        except BaseException as exc:
            self.results.append(PhaseResult(phase, Outcome.FAILED, start, time.perf_counter(), exc))
            raise
        self.results.append(PhaseResult(phase, Outcome.SKIPPED if ran is False else Outcome.PASSED,
                                        start, time.perf_counter()))

    def _emit(self, kind: EventKind, **fields) -> None:
        if not self.listeners:
            return
        event = Event(kind, rank=self.rank, defer=self.stack.push, **fields)
        for listener in self.listeners:
            self.cursor.listener = listener
            listener.on_event(event)
        self.cursor.listener = None

    def _rollback(self, exc: BaseException) -> BaseException:
        """Unwind everything, then return the exception to raise (see ``run``)."""
        cursor = self.cursor
        failures: list[BaseException] = []
        event = Event(EventKind.ROLLBACK, rank=self.rank, phase=cursor.phase, descriptor=cursor.descriptor,
                      region=cursor.region, segment=cursor.segment, error=f"{type(exc).__name__}: {exc}")
        for listener in self.listeners:
            try:
                listener.on_event(event)
            except Exception as failure:  # noqa: BLE001 - rollback must finish; reported below
                failure.add_note(f"while notifying {type(listener).__name__} of the rollback")
                failures.append(failure)
        group = self.stack.unwind()
        if group is not None:
            failures.extend(group.exceptions)
        self._forget()
        _clear_frames(exc)
        undo_error = UndoError(f"{len(failures)} rollback step(s) failed", failures) if failures else None
        if not isinstance(exc, Exception):
            if undo_error is not None:
                exc.add_note(f"rollback: {undo_error}")
            return exc
        error = exc if isinstance(exc, CaptureError) else self._capture_error(exc, cursor)
        if error.rank is None:
            error.rank = self.rank
        if undo_error is not None:
            error.add_note(f"rollback: {undo_error}: " + "; ".join(f"{type(f).__name__}: {f}" for f in failures))
        error.undo_error = undo_error
        return error

    def _capture_error(self, exc: Exception, cursor: _Cursor) -> CaptureError:
        where = f" in region {cursor.region}" if cursor.region else ""
        if cursor.listener is not None:
            message = f"listener {type(cursor.listener).__name__} raised {type(exc).__name__}: {exc}"
            hint = "fix the listener; a listener that raises fails the pipeline"
        else:
            message = f"{type(exc).__name__}{where}: {exc}"
            hint = _HINTS.get(cursor.phase, "see the cause above")
        if isinstance(exc, TimeoutError):
            hint = "a rank or barrier did not answer in time: look for a rank that diverged (graphflow trace diff)"
        return CaptureError(message, phase=cursor.phase.value if cursor.phase else None,
                            descriptor=cursor.descriptor, segment=cursor.segment, rank=self.rank, hint=hint)

    def _forget(self) -> None:
        self.engine = None
        self.model = None
        self.buffers = None
        self.detectors = None
        self.programs = {}
        self.graphs = []
        self.fns = {}
        self.hooks = {}

    # -- phases ----------------------------------------------------------------------
    def _allocate(self) -> None:
        plan = self.plan
        for name in self._device_names():
            device = self.backend.device(name)
            self.devices[name] = device
            self.baseline.setdefault(device, self.backend.memory_allocated(device))
        self._check_modes()
        if self.model is None:
            offered = {"device": self._first_device(), "rank": self.rank, "world_size": self.world_size, "plan": plan}
            if self.channels is not None:
                offered["channels"] = self.channels.handles
            self.model = build_model(plan, offered)
            self.stack.push("drop the model", self._drop_model)
        bind = getattr(self.channels, "bind", None)
        if bind is not None:  # so a channel's prewarm hook resolves on this model
            bind(self.model)
            self.stack.push("unbind the model from the channels", functools.partial(bind, None))
        for segment in self.segments:
            self.cursor.segment = segment.name
            self.fns[segment.name] = resolve(self.model, segment.call, kind="segment", name=segment.name, plan=plan)
        self.cursor.segment = None
        for hook in plan.prewarm:
            self.hooks[hook.name] = resolve(self.model, hook.call, kind="prewarm", name=hook.name, plan=plan)
        streams = {s.name: self.backend.new_stream(self.devices[s.device]) for s in plan.streams}
        defaults: dict[torch.device, object] = {}
        for segment in self.segments:
            device = self._segment_device(segment)
            if segment.stream is not None:
                self.streams[segment.name] = streams[segment.stream]
            else:
                if device not in defaults:
                    defaults[device] = self.backend.new_stream(device)
                self.streams[segment.name] = defaults[device]
        self.stack.push("drop the streams", self.streams.clear)
        self._schedule()
        for segment in self.segments:
            device = self._segment_device(segment)
            if segment.is_graph and device not in self.pools:
                self.pools[device] = self.backend.new_pool(device)
                self.stack.push(f"release the pool on {device}", functools.partial(self._release_pool, device))
        largest = max((d.size for d in self.descriptors), default=max(plan.max_size, 1))
        self.buffers = StaticBuffers(plan, largest, lambda n: self.devices[n])
        self.stack.push("free the static buffers", self._free_buffers)
        if self.detectors_on:
            self._make_detectors()

    def _warmup(self) -> None:
        for index, descriptor in enumerate(self.descriptors, 1):
            self._begin_descriptor(descriptor, index)
            step = self._eager_step(descriptor.size)
            watched = functools.partial(self._watched, phase=Phase.WARMUP, capturing=False)
            for _ in range(self.plan.capture.warmup_iters):
                self._run_eager(step, watched)
            self._synchronize()
            self._check_findings(Phase.WARMUP)
            self._end_descriptor(descriptor, index)

    def _prewarm(self) -> bool:
        if not self.plan.prewarm:
            return False
        sizes = sorted({d.size for d in self.descriptors}, reverse=True)
        stream = next(iter(self.streams.values()), None)
        for hook in self.plan.prewarm:
            self.cursor.segment = f"prewarm {hook.name}"
            fn = self.hooks[hook.name]
            with self.backend.on_stream(stream) if stream is not None else contextlib.nullcontext():
                for size in sizes if hook.per_size else (None,):
                    fn(size) if size is not None else fn()
        self.cursor.segment = None
        self._synchronize()
        return True

    def _capture(self) -> None:
        gc.collect()
        # Everything alive now leaves the collector's generations: a collection during capture
        # scans only what capture creates, and stays short.
        gc.freeze()
        unfreeze = self.stack.push("unfreeze the garbage collector", gc.unfreeze)
        for index, descriptor in enumerate(self.descriptors, 1):
            self._begin_descriptor(descriptor, index)
            views = self.buffers.views(descriptor.size)
            program: list[Call] = []
            for item in self._step_items(descriptor.mode):
                if isinstance(item, Segment):
                    program.append(_bind(item, self.fns[item.name], views))
                    continue
                region, segments = item
                program.append(self._capture_region(descriptor, index, region, segments, views).replay)
            self.programs[descriptor] = tuple(program)
            self._end_descriptor(descriptor, index)
        self.stack.run_now(unfreeze)

    def _capture_region(self, descriptor: Descriptor, index: int, region: CaptureRegion,
                        segments: tuple[Segment, ...], views: dict[str, torch.Tensor]) -> Graph:
        self.cursor.region = region.name
        self._emit(EventKind.REGION_BEGIN, phase=Phase.CAPTURE, descriptor=descriptor, region=region.name,
                   index=index, total=len(self.descriptors))
        calls = [_bind(s, self.fns[s.name], views) for s in segments]
        run = self.runs[tuple(s.name for s in segments)]
        watched = functools.partial(self._watched, phase=Phase.CAPTURE, capturing=True)

        def recording() -> None:
            self._run_scheduled(run, tuple(zip(segments, calls)), watched)

        try:
            graph = self.backend.capture(tuple(calls), recording, run.origin,
                                         self.pools[self._segment_device(segments[0])], run.side)
        finally:
            # A traceback keeps ``recording`` alive through its frame even after the frame
            # is cleared; emptied, its closure no longer holds views of the static buffers.
            calls.clear()
        self.graphs.append(graph)
        self.stack.push(f"destroy graph {region.name} {descriptor}", graph.destroy)
        self._check_findings(Phase.CAPTURE)
        self.cursor.segment = None
        self._emit(EventKind.REGION_END, phase=Phase.CAPTURE, descriptor=descriptor, region=region.name,
                   index=index, total=len(self.descriptors))
        self.cursor.region = None
        return graph

    def _verify(self) -> bool:
        if not self.verify_on:
            return False
        last_writer = {w: s.name for s in self.segments for w in s.writes}
        position = {s.name: i for i, s in enumerate(self.segments)}
        written = tuple(sorted(last_writer, key=lambda b: position[last_writer[b]]))  # in order of final write
        read = tuple(dict.fromkeys(r for s in self.segments for r in s.reads))
        state = tuple(b.name for b in self.plan.buffers if b.role is BufferRole.STATE)
        for index, descriptor in enumerate(self.descriptors, 1):
            self._begin_descriptor(descriptor, index)
            views = self.buffers.views(descriptor.size)
            kept = {n: views[n].clone() for n in state}
            self._fill_inputs(views, descriptor.size)
            start = {n: views[n].clone() for n in dict.fromkeys((*read, *state))}
            self._run_eager(self._eager_step(descriptor.size), self._run_segment)
            self.cursor.segment = None
            self._synchronize()
            expected = {n: views[n].clone() for n in written}
            _restore(views, start)
            # The program holds bare callables; the step's items, listed again, say which
            # are eager breaks (a graph replay runs no Python to bracket).
            for item, call in zip(self._step_items(descriptor.mode), self.programs[descriptor], strict=True):
                if isinstance(item, Segment):
                    self._run_segment(item, call)
                else:
                    self.cursor.segment = None
                    call()
            self.cursor.segment = None
            self._synchronize()
            self.verify_results.append(self._compare(descriptor, views, expected, last_writer))
            _restore(views, kept)
            self._end_descriptor(descriptor, index)
        return True

    def _commit(self) -> None:
        self.pool_bytes = self._pool_bytes()
        report = PipelineReport(
            backend=self.backend.name, captures_graphs=self.backend.captures_graphs, rank=self.rank,
            descriptors=self.descriptors, graphs=len(self.graphs), phases=tuple(self.results),
            verify=tuple(self.verify_results), pool_bytes=self.pool_bytes,
            buffer_bytes=self.buffers.nbytes(),
            remapped=tuple(sorted(self.backend.remapped.items())))
        self.engine = Engine(self.plan, self.backend, self.model, self.buffers, dict(self.programs),
                             tuple((s, self.fns[s.name]) for s in self.segments), report, self.rank, self.stack)
        self.stack.push("unpublish the engine", self._unpublish)

    # -- helpers -----------------------------------------------------------------------
    def _device_names(self) -> tuple[str, ...]:
        names = [b.device for b in self.plan.buffers] + [s.device for s in self.plan.streams]
        names += [d for s in self.segments if (d := self.plan.segment_device(s)) is not None]
        return tuple(dict.fromkeys(names))

    def _first_device(self) -> torch.device:
        return next(iter(self.devices.values()), torch.device("cpu"))

    def _segment_device(self, segment: Segment) -> torch.device:
        name = self.plan.segment_device(segment)
        return self.devices[name] if name is not None else self._first_device()

    def _check_modes(self) -> None:
        for descriptor in self.descriptors:
            for buffer in self.plan.buffers:
                cap = buffer.capacity.get(self.plan.capture.size_symbol)
                if cap is not None and descriptor.size > cap:
                    raise CaptureError(f"{descriptor} exceeds buffer {buffer.name!r}'s capacity {cap}",
                                       phase=Phase.ALLOCATE.value, descriptor=descriptor,
                                       hint="drop the size from capture.sizes or raise the capacity")
        if any(d.mode is Mode.FULL for d in self.descriptors):
            for segment in self.segments:
                if not segment.is_graph:
                    raise CaptureError(f"FULL capture of family {segment.family!r} would contain eager segment "
                                       f"{segment.name!r}", phase=Phase.ALLOCATE.value, segment=segment.name,
                                       hint="capture this family PIECEWISE only, or make the segment capturable")
        if self.verify_on:
            for buffer in self.plan.buffers:
                if buffer.role is BufferRole.INPUT and buffer.values is None and not _is_float(buffer.dtype):
                    raise CaptureError(f"input buffer {buffer.name!r} is {buffer.dtype} and declares no values",
                                       phase=Phase.ALLOCATE.value,
                                       hint="declare 'values: [low, high)' so verify can draw random inputs, "
                                            "or run with --no-verify")

    def _step_items(self, mode: Mode):
        """Regions (with this rank's segments) and eager breaks, family after family."""
        for family in self.plan.families:
            for item in self.plan.step(family.name, mode):
                if isinstance(item, CaptureRegion):
                    segments = tuple(s for s in (self.plan.segment(n) for n in item.segments) if s.runs_on(self.rank))
                    if segments:
                        yield item, segments
                elif item.runs_on(self.rank):
                    yield item

    def _eager_step(self, size: int) -> tuple[tuple[Segment, Call], ...]:
        views = self.buffers.views(size)
        return tuple((s, _bind(s, self.fns[s.name], views)) for s in self.segments)

    def _schedule(self) -> None:
        """Schedule the eager step and every region to capture over their streams, and
        preallocate the events the largest of them needs on each device."""
        sequences = [self.segments]
        for mode in dict.fromkeys(d.mode for d in self.descriptors):
            sequences += [item[1] for item in self._step_items(mode) if not isinstance(item, Segment)]
        placed: dict[tuple[str, ...], tuple[Schedule, list[tuple[torch.device, int]]]] = {}
        needed: dict[torch.device, int] = {}
        for segments in sequences:
            names = tuple(s.name for s in segments)
            if names in placed:
                continue
            schedule = build_schedule(names, [self.streams[n] for n in names], dependencies(self.plan, segments))
            # Each event slot is the k-th event of its stream's device; schedules never run
            # at the same time, so they share each device's events.
            taken: dict[torch.device, int] = {}
            slots = []
            for stream in schedule.events:
                device = stream.device
                slots.append((device, taken.get(device, 0)))
                taken[device] = taken.get(device, 0) + 1
                needed[device] = max(needed.get(device, 0), taken[device])
            placed[names] = (schedule, slots)
        events = {device: [self.backend.new_event(device) for _ in range(count)] for device, count in needed.items()}
        for names, (schedule, slots) in placed.items():
            self.runs[names] = _Run.bind(schedule, [events[device][k] for device, k in slots])
        self.stack.push("drop the schedules and their events", self.runs.clear)

    def _run_eager(self, step: tuple[tuple[Segment, Call], ...], run: Callable[[Segment, Call], None]) -> None:
        """The eager step on its schedule, ordered after the caller's stream and before it."""
        scheduled = self.runs[tuple(segment.name for segment, _ in step)]
        if scheduled.origin is None:
            return
        with self.backend.on_stream(scheduled.origin):
            self._run_scheduled(scheduled, step, run)

    def _run_scheduled(self, scheduled: _Run, step: Sequence[tuple[Segment, Call]],
                       run: Callable[[Segment, Call], None]) -> None:
        """Fork, each segment on its stream between its waits and its record, join."""
        backend = self.backend
        if scheduled.side:
            backend.fork(scheduled.origin, scheduled.side, scheduled.fork)
        for (segment, call), bound in zip(step, scheduled.steps, strict=True):
            for event in bound.waits:
                backend.wait(bound.stream, event)
            if bound.stream is scheduled.origin:  # already current: no switch to pay for
                run(segment, call)
            else:
                with backend.use(bound.stream):
                    run(segment, call)
            if bound.record is not None:
                backend.record(bound.record, bound.stream)
        if scheduled.join:
            backend.join(scheduled.origin, scheduled.join)

    def _watched(self, segment: Segment, call: Call, phase: Phase, *, capturing: bool) -> None:
        watch = None
        if self.detectors is not None and segment.is_graph:  # eager breaks may sync: that is their job
            watch = self.detectors.watch(segment.name, phase, capturing, self._segment_device(segment))
        self._run_segment(segment, call, watch)

    def _run_segment(self, segment: Segment, call: Call, watch: contextlib.AbstractContextManager | None = None
                     ) -> None:
        """One segment call, between SEGMENT_BEGIN and SEGMENT_END when anyone listens.

        The events are emitted outside the detectors' watch, so what a listener does is
        never taken for the segment's own work. A segment that raises gets no END: the
        ROLLBACK event follows instead.
        """
        self.cursor.segment = segment.name
        if self.segment_events:
            self._emit(EventKind.SEGMENT_BEGIN, phase=self.cursor.phase, descriptor=self.cursor.descriptor,
                       region=self.cursor.region, segment=segment.name)
        if watch is None:
            call()
        else:
            with watch:
                call()
        if self.segment_events:
            self._emit(EventKind.SEGMENT_END, phase=self.cursor.phase, descriptor=self.cursor.descriptor,
                       region=self.cursor.region, segment=segment.name)

    def _make_detectors(self) -> None:
        from graphflow.detectors import Check, Detectors

        disabled = {_check_named(Check, n) for n in self.disabled_checks}
        known = list(self.buffers.tensors.values())
        if isinstance(self.model, torch.nn.Module):
            known += [*self.model.parameters(), *self.model.buffers()]
        self.detectors = Detectors(checks=[c for c in Check.default() if c not in disabled], known=known)

    def _check_findings(self, phase: Phase) -> None:
        if self.detectors is None:
            return
        findings = list(self.detectors.findings)[self.findings_seen:]
        self.findings_seen += len(findings)
        if findings:
            lines = "; ".join(f"[{f.check.value}] {f.segment}: {f.call}: {f.message}" for f in findings)
            raise CaptureError(f"capture-safety detectors found {len(findings)} problem(s): {lines}",
                               phase=phase.value, descriptor=self.cursor.descriptor, segment=findings[0].segment,
                               hint="fix the segment or make it eager; silence one check with --disable-check NAME")

    def _fill_inputs(self, views: dict[str, torch.Tensor], size: int) -> None:
        for buffer in self.plan.buffers:
            if buffer.role is not BufferRole.INPUT:
                continue
            view = views[buffer.name]
            generator = torch.Generator(device=view.device).manual_seed(self.seed * 1_000_003 + size)
            if buffer.values is not None:
                low, high = buffer.values
                if _is_float(buffer.dtype):
                    fresh = torch.rand(view.shape, generator=generator, device=view.device) * (high - low) + low
                else:
                    fresh = torch.randint(int(low), int(high), view.shape, generator=generator, device=view.device)
            else:
                fresh = torch.randn(view.shape, generator=generator, device=view.device)
            view.copy_(fresh.to(view.dtype))

    def _compare(self, descriptor: Descriptor, views: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                 last_writer: dict[str, str]) -> VerifyResult:
        """Compare in order of each buffer's final write, so the first mismatch is the earliest seen."""
        atol, rtol = self.plan.capture.atol, self.plan.capture.rtol
        worst = 0.0
        bit_exact = True
        for name, want in expected.items():
            got = views[name]
            same = _equal(got, want)
            bit_exact = bit_exact and same
            diff = _max_abs_diff(got, want)
            worst = max(worst, diff)
            ok = same if atol == 0 and rtol == 0 else bool(
                torch.isclose(_comparable(got), _comparable(want), rtol=rtol, atol=atol, equal_nan=True).all())
            if not ok:
                self.cursor.segment = last_writer[name]
                bad = int((_comparable(got) != _comparable(want)).sum())
                raise CaptureError(
                    f"graph replay of {descriptor} differs from eager in buffer {name!r} (last written by "
                    f"{last_writer[name]}; it or an earlier segment diverged): {bad} of {got.numel()} "
                    f"elements, max |diff| {diff:.3g} (allowed atol={atol}, rtol={rtol})",
                    phase=Phase.VERIFY.value, descriptor=descriptor, segment=self.cursor.segment,
                    hint=_HINTS[Phase.VERIFY])
        return VerifyResult(descriptor, tuple(expected), worst, bit_exact)

    def _begin_descriptor(self, descriptor: Descriptor, index: int) -> None:
        self.cursor.descriptor = descriptor
        self._emit(EventKind.DESCRIPTOR_BEGIN, phase=self.cursor.phase, descriptor=descriptor, index=index,
                   total=len(self.descriptors))
        self.descriptor_start = time.perf_counter()

    def _end_descriptor(self, descriptor: Descriptor, index: int) -> None:
        self.cursor.segment = None
        # The pool's size costs an allocator snapshot: only worth it when someone listens.
        pool = self._pool_bytes() if self.cursor.phase is Phase.CAPTURE and self.listeners else None
        if pool is not None:
            self.pool_bytes = pool
        self._emit(EventKind.DESCRIPTOR_END, phase=self.cursor.phase, descriptor=descriptor, index=index,
                   total=len(self.descriptors), elapsed_s=time.perf_counter() - self.descriptor_start,
                   pool_bytes=self.pool_bytes)
        self.cursor.descriptor = None

    def _pool_bytes(self) -> int | None:
        sizes = [self.backend.pool_bytes(p) for p in self.pools.values()]
        return None if any(s is None for s in sizes) else sum(sizes)

    def _synchronize(self) -> None:
        for device in dict.fromkeys(self.devices.values()):
            self.backend.synchronize(device)

    # -- undos -------------------------------------------------------------------------
    def _drop_model(self) -> None:
        self.model = None
        self.fns = {}
        self.hooks = {}

    def _release_pool(self, device: torch.device) -> None:
        pool = self.pools.pop(device)
        self.backend.release_pool(pool)

    def _free_buffers(self) -> None:
        self.programs = {}
        self.detectors = None
        if self.buffers is not None:
            self.buffers.clear()
        self.buffers = None

    def _unpublish(self) -> None:
        if self.engine is not None:
            self.engine.programs = {}
        self.engine = None


def _check_named(checks: type[enum.Enum], name: str) -> enum.Enum:
    """A detector check by its value (``host_sync``) or member name (``HOST_SYNC``)."""
    for check in checks:
        if name.lower() in (check.value, check.name.lower()):
            return check
    raise ValueError(f"unknown check {name!r}: the checks are {', '.join(c.value for c in checks)}")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _comparable(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, treating NaN as equal to NaN."""
    if a.is_floating_point():
        a, b = _comparable(a), _comparable(b)
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool:
        return float((a != b).any())
    return float((_comparable(a).double() - _comparable(b).double()).abs().nan_to_num(0.0).max())


def _restore(views: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        views[name].copy_(value)


def _clear_frames(exc: BaseException) -> None:
    """Drop the locals of finished frames in the exception chain.

    A traceback keeps every frame's locals alive, and those hold views of the static
    buffers and graph inputs: without this, device memory could not return to the
    baseline while the caller still holds the error.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__
