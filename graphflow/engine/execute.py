"""Running segments: the calling convention, and a sequence run over its streams.

Warmup, capture and verify all run segments the same way, so the way lives here once:

* ``bind(segment, fn, views)``: the calling convention, ``fn(*reads,
  *writes_not_in_reads)`` with the static buffers' views at one batch size;
* ``BoundSchedule``: a ``graphflow.engine.schedule.Schedule`` (which segment waits for
  which) bound to this run's streams and preallocated events;
* ``run_scheduled``: fork the side streams, run each segment on its stream between its
  waits and its record, join; ``run_eager`` does that for a whole eager step, ordered
  after the caller's stream and before it;
* ``call_segment``: one segment call in its locus block, between SEGMENT_BEGIN and
  SEGMENT_END when anyone listens, under the detectors' watch when given one.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence

import attrs
import torch

from graphflow.engine.backend import Backend, Call
from graphflow.engine.context import Context
from graphflow.engine.schedule import Schedule
from graphflow.events import EventKind
from graphflow.plan import Segment

__all__ = ["BoundSchedule", "bind", "call_segment", "run_eager", "run_scheduled"]


def bind(segment: Segment, fn: Callable[..., object], views: Mapping[str, torch.Tensor]) -> Call:
    """The calling convention: ``fn(*reads, *writes_not_in_reads)``, as views at one size."""
    names = (*segment.reads, *(w for w in segment.writes if w not in segment.reads))
    return functools.partial(fn, *(views[n] for n in names)) if names else fn


@attrs.frozen(eq=False)
class BoundStep:
    """One scheduled segment with its stream and its events, looked up once."""

    stream: object
    waits: tuple[object, ...]  # events to wait on before the segment
    record: object | None  # the event to record after it


@attrs.frozen(eq=False)
class BoundSchedule:
    """A schedule bound to this run's streams and preallocated events."""

    origin: object
    side: tuple[object, ...]  # the forked streams
    fork: object | None  # the event the side streams wait on at the start
    steps: tuple[BoundStep, ...]
    join: tuple[object, ...]  # the events the origin waits on at the end

    @classmethod
    def of(cls, schedule: Schedule, events: Sequence[object]) -> BoundSchedule:
        recorded = {s.name: events[s.event] for s in schedule.steps if s.event is not None}
        steps = tuple(BoundStep(s.stream, tuple(recorded[w] for w in s.waits),
                                None if s.event is None else events[s.event]) for s in schedule.steps)
        fork = None if schedule.fork_event is None else events[schedule.fork_event]
        return cls(schedule.origin, schedule.fork, fork, steps, tuple(recorded[n] for n in schedule.join))


#: How a sequence runner calls one segment: ``run(segment, call)``.
SegmentRunner = Callable[[Segment, Call], None]


def run_scheduled(backend: Backend, scheduled: BoundSchedule, step: Sequence[tuple[Segment, Call]],
                  run: SegmentRunner) -> None:
    """Fork, each segment on its stream between its waits and its record, join."""
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


def run_eager(backend: Backend, scheduled: BoundSchedule, step: Sequence[tuple[Segment, Call]],
              run: SegmentRunner) -> None:
    """The eager step on its schedule, ordered after the caller's stream and before it."""
    if scheduled.origin is None:
        return
    with backend.on_stream(scheduled.origin):
        run_scheduled(backend, scheduled, step, run)


def call_segment(ctx: Context, segment: Segment, call: Call,
                 watch: contextlib.AbstractContextManager | None = None) -> None:
    """One segment call in its block, between SEGMENT_BEGIN and SEGMENT_END.

    The events are emitted outside the detectors' watch, so what a listener does is
    never taken for the segment's own work. A segment that raises gets no END: the
    ROLLBACK event follows instead.
    """
    with ctx.locus.segment(segment.name):
        if ctx.segment_events:
            ctx.emit(EventKind.SEGMENT_BEGIN)
        if watch is None:
            call()
        else:
            with watch:
                returned = call()
            # Dropped only once the watch has looked: a tensor allocated in capture and
            # returned escapes just as one kept on the model does.
            del returned
        if ctx.segment_events:
            ctx.emit(EventKind.SEGMENT_END)
