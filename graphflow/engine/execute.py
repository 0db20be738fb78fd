"""Running segments: the calling convention, and a sequence run over its streams.

Warmup, capture and verify all run segments the same way, so the way lives here once:

* ``bind(segment, fn, views)``: the calling convention, ``fn(*reads,
  *writes_not_in_reads)`` with the static buffers' views at one batch size, or, for a
  ``SegmentCall`` (what allocate resolves each segment to), that plus keyword
  arguments (``inputs``, ``objects``, ``constants``), the return value copied into the
  ``returns`` buffers, and the model's adopted tensors pointed at this size's views;
* ``BoundSchedule``: a ``graphflow.plan.schedule.Schedule`` (which segment waits for
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
from graphflow.plan.schedule import Schedule
from graphflow.events import EventKind
from graphflow.plan import Segment

__all__ = ["BoundSchedule", "Placer", "SegmentCall", "Slot", "bind", "call_segment", "returned", "run_eager",
           "run_scheduled"]


#: ``place(buffer, value)``: True when ``value``, returned for ``buffer``, is kept as it is.
Placer = Callable[[str, torch.Tensor], bool]


def bind(segment: Segment, fn: Callable[..., object], views: Mapping[str, torch.Tensor],
         place: Placer | None = None) -> Call:
    """The calling convention: ``fn(*reads, *writes_not_in_reads)``, as views at one size.

    A ``SegmentCall`` binds itself (``SegmentCall.bind``); a bare callable gets every
    buffer positionally.
    """
    if isinstance(fn, SegmentCall):
        return fn.bind(views, place)
    names = (*segment.reads, *(w for w in segment.writes if w not in segment.reads))
    return functools.partial(fn, *(views[n] for n in names)) if names else fn


@attrs.frozen(eq=False)
class Slot:
    """Where the model holds a tensor a buffer adopts: ``owner.attr`` or ``owner[index]``."""

    owner: object
    key: str | int

    def get(self, default=None):
        if isinstance(self.key, int):
            return self.owner[self.key]
        return getattr(self.owner, self.key, default)

    def set(self, value) -> None:
        if isinstance(self.key, int):
            self.owner[self.key] = value
        else:
            setattr(self.owner, self.key, value)


@attrs.frozen(eq=False)
class SegmentCall:
    """A segment's callable and how to call it, resolved once at allocate.

    ``positional`` buffers go first, in order; ``keywords`` pass buffers by argument
    name; ``fixed`` holds the resolved ``objects`` and the ``constants``; ``returns``
    are filled from the return value; ``adopted`` are the model's slots for adopted
    buffers, pointed at the views of the size being bound before each call (the
    model's own code then works at that batch size); ``split`` cuts a PIECEWISE
    capture at the segment's ``breaks`` (``graphflow.engine.model.split``).
    """

    name: str
    fn: Callable[..., object]
    positional: tuple[str, ...] = ()
    keywords: tuple[tuple[str, str], ...] = ()
    fixed: Mapping[str, object] = attrs.field(factory=dict)
    returns: tuple[str, ...] = ()
    adopted: tuple[tuple[str, Slot], ...] = ()
    split: object | None = None

    def __call__(self, *args, **kwargs):
        """The function itself, called as given (a benchmark calling a segment's function
        on buffers of its own); the engine binds it instead."""
        return self.fn(*args, **kwargs)

    def bind(self, views: Mapping[str, torch.Tensor], place: Placer | None = None) -> Call:
        """The call at the size of ``views``; with nothing but positional buffers, a bare partial.

        ``place``, in a capture, may keep a returned tensor where the capture put it
        instead of copying it into its buffer (``graphflow.engine.model.returned``)."""
        fn, name = self.fn, self.name
        args = tuple(views[n] for n in self.positional)
        if not (self.keywords or self.fixed or self.returns or self.adopted or self.split):
            return functools.partial(fn, *args) if args else fn
        kwargs = {**self.fixed, **{keyword: views[buffer] for keyword, buffer in self.keywords}}
        pointers = tuple((slot, views[buffer]) for buffer, slot in self.adopted)
        outputs = tuple((buffer, views[buffer]) for buffer in self.returns)
        split = self.split

        def call():
            for slot, view in pointers:
                slot.set(view)
            if split is not None:
                with split.segment(pointers):
                    result = fn(*args, **kwargs)
            else:
                result = fn(*args, **kwargs)
            if outputs:
                for (buffer, view), value in zip(outputs, returned(name, result, self.returns), strict=True):
                    if value.shape != view.shape:
                        raise ValueError(f"segment {name} returned {buffer!r} of shape {list(value.shape)}, but "
                                         f"buffer {buffer!r} is {list(view.shape)} at this size — declare the "
                                         "buffer with the shape the callable returns")
                    if place is None or not place(buffer, value):
                        view.copy_(value)
            return result

        return call


def returned(name: str, result: object, buffers: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """The tensors a call's ``result`` gives for ``buffers``: the tensor itself (one
    buffer), a tuple's items in order, or a mapping's or object's entries by the
    buffers' names (a Hugging Face ``ModelOutput`` is both)."""
    if isinstance(result, torch.Tensor):
        values: tuple = (result,)
        if len(buffers) != 1:
            raise ValueError(f"{name} returned one tensor, but {len(buffers)} returns buffers are declared "
                             f"({', '.join(buffers)}) — return a tuple, or declare one buffer")
    elif isinstance(result, Mapping):
        missing = [b for b in buffers if b not in result]
        if missing:
            raise ValueError(f"{name} returned a {type(result).__name__} without {', '.join(map(repr, missing))} "
                             f"(it has {', '.join(map(str, result)) or 'nothing'}) — name the returns buffers "
                             "after the entries")
        values = tuple(result[b] for b in buffers)
    elif isinstance(result, (tuple, list)):
        if len(result) < len(buffers):
            raise ValueError(f"{name} returned {len(result)} values for {len(buffers)} returns buffers "
                             f"({', '.join(buffers)})")
        values = tuple(result[: len(buffers)])
    elif result is None:
        raise ValueError(f"{name} returned None, but declares returns {', '.join(buffers)} — return the tensors, "
                         "or write them into the buffers and drop returns")
    else:
        missing = [b for b in buffers if not hasattr(result, b)]
        if missing:
            raise ValueError(f"{name} returned a {type(result).__name__} without attribute(s) "
                             f"{', '.join(missing)} — name the returns buffers after its fields")
        values = tuple(getattr(result, b) for b in buffers)
    for buffer, value in zip(buffers, values):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} returned {type(value).__name__} for {buffer!r}, not a tensor")
    return values


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
            with backend.use(bound.stream, scheduled.origin):
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
                if segment.returns:  # copied into the declared buffers: the engine keeps none of it
                    returned = None
            # Dropped only once the watch has looked: a tensor allocated in capture and
            # returned escapes just as one kept on the model does.
            del returned
        if ctx.segment_events:
            ctx.emit(EventKind.SEGMENT_END)
