"""What every phase of one pipeline run shares, and nothing that a phase makes.

A phase takes this context plus the results of the phases before it, and returns its
own result; nothing is left on a shared object for the next phase to find. The context
is fixed for the run: the plan and its descriptors, the backend, the options, the rank,
the listeners, the one rollback stack and the locus (where the pipeline is).
"""

from __future__ import annotations

import functools
import time

import attrs

from graphflow.engine.backend import Backend
from graphflow.engine.locus import Locus
from graphflow.engine.options import RunOptions, Watch
from graphflow.engine.rollback import UndoStack
from graphflow.engine.snapshots import VerifyPlan
from graphflow.events import Event, EventKind, Listener
from graphflow.plan import Descriptor, Plan, Segment

__all__ = ["Context"]


@attrs.frozen(eq=False)
class Context:
    """One pipeline run's fixed environment (see the module docstring).

    ``segments`` are this rank's, in step order; ``descriptors`` the ones to capture.
    ``segment_events`` is decided once: a segment call builds no event unless some
    listener wants them (a listener says it does not with ``segment_events = False``).
    """

    plan: Plan
    backend: Backend
    options: RunOptions
    rank: int
    world_size: int
    descriptors: tuple[Descriptor, ...]
    listeners: tuple[Listener, ...]
    segments: tuple[Segment, ...]
    stack: UndoStack = attrs.field(factory=UndoStack)
    locus: Locus = attrs.field(factory=Locus)
    segment_events: bool = attrs.field(default=attrs.Factory(
        lambda self: any(getattr(listener, "segment_events", True) for listener in self.listeners), takes_self=True))

    @functools.cached_property
    def verify_plan(self):
        """Which buffers verify snapshots and compares (``graphflow.engine.snapshots``)."""
        compiled = self.options.compile and any(self.plan.compile_of(s) is not None for s in self.segments)
        return VerifyPlan.of(self.plan, self.segments, compiled=compiled)

    @functools.cached_property
    def _first_of_mode(self) -> frozenset[Descriptor]:
        firsts: dict = {}
        for descriptor in self.descriptors:
            firsts.setdefault(descriptor.mode, descriptor)
        return frozenset(firsts.values())

    def watches(self, descriptor: Descriptor) -> bool:
        """Whether the detectors watch this descriptor's warmup and capture."""
        scope = self.options.detectors
        return scope is Watch.ALL or (scope is Watch.FIRST and descriptor in self._first_of_mode)

    def emit(self, kind: EventKind, **fields) -> None:
        """Tell every listener; ``phase``, ``descriptor``, ``region`` and ``segment`` come
        from where the pipeline is unless given."""
        if not self.listeners:
            return
        here = self.locus.here
        fields.setdefault("phase", here.phase)
        fields.setdefault("descriptor", here.descriptor)
        fields.setdefault("region", here.region)
        fields.setdefault("segment", here.segment)
        event = Event(kind, rank=self.rank, defer=self.stack.push, locus=self.locus, **fields)
        for listener in self.listeners:
            with self.locus.at(listener=type(listener).__name__):
                listener.on_event(event)

    def descriptor(self, descriptor: Descriptor, index: int) -> DescriptorBlock:
        """The block of one descriptor's work in a phase (see ``DescriptorBlock``)."""
        return DescriptorBlock(self, descriptor, index)


class DescriptorBlock:
    """One descriptor's work in a phase, between DESCRIPTOR_BEGIN and DESCRIPTOR_END.

    ``pool_bytes``, set by the phase before the block ends, goes into the END event;
    ``seconds`` is the descriptor's time once the block has ended without an error.
    """

    __slots__ = ("ctx", "descriptor", "index", "pool_bytes", "seconds", "_block", "_start")

    def __init__(self, ctx: Context, descriptor: Descriptor, index: int):
        self.ctx = ctx
        self.descriptor = descriptor
        self.index = index
        self.pool_bytes: int | None = None
        self.seconds = 0.0
        self._block = ctx.locus.at(descriptor=descriptor)
        self._start = 0.0

    def __enter__(self) -> DescriptorBlock:
        self._block.__enter__()
        try:
            self.ctx.emit(EventKind.DESCRIPTOR_BEGIN, index=self.index, total=len(self.ctx.descriptors))
        except BaseException as failure:
            self._block.__exit__(type(failure), failure, failure.__traceback__)
            raise
        self._start = time.perf_counter()
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is None:
            self.seconds = time.perf_counter() - self._start
            try:
                self.ctx.emit(EventKind.DESCRIPTOR_END, index=self.index, total=len(self.ctx.descriptors),
                              elapsed_s=self.seconds, pool_bytes=self.pool_bytes)
            except BaseException as failure:
                self._block.__exit__(type(failure), failure, failure.__traceback__)
                raise
        return self._block.__exit__(kind, exc, tb)
