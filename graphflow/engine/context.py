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
from graphflow.engine.options import RunOptions, Verify, Watch
from graphflow.engine.rollback import UndoStack
from graphflow.engine.snapshots import VerifyPlan
from graphflow.events import Event, EventKind, Listener
from graphflow.plan import Descriptor, Plan, Segment, Warmup

__all__ = ["Context", "SAMPLE_BETWEEN", "first_of_each_mode", "per_size_warmup", "sample"]

#: How many descriptors ``Verify.SAMPLE`` verifies between each mode's first and last.
SAMPLE_BETWEEN = 3


def first_of_each_mode(keys):
    """The first of ``keys`` of each mode (anything with a ``mode``), in their order: in
    capture order, the largest."""
    firsts: dict = {}
    for key in keys:
        firsts.setdefault(key.mode, key)
    return tuple(firsts.values())


def sample(descriptors: tuple[Descriptor, ...]) -> frozenset[Descriptor]:
    """Per mode, in capture order: the first and the last descriptor and up to
    ``SAMPLE_BETWEEN`` evenly spaced between them, what ``Verify.SAMPLE`` verifies.

    The first is the largest (it runs every kernel at its widest), the last the smallest
    (the padding and the shortest rows), the others the sizes between: a capture broken
    in the code is broken at them before ready. One wrong at another size only is caught
    on its first batch (``graphflow.engine.first_use``).
    """
    by_mode: dict = {}
    for descriptor in descriptors:
        by_mode.setdefault(descriptor.mode, []).append(descriptor)
    chosen: set[Descriptor] = set()
    for group in by_mode.values():
        last = len(group) - 1
        between = min(SAMPLE_BETWEEN, max(0, last - 1))
        chosen.update(group[round(k * last / (between + 1))] for k in range(between + 2))
    return frozenset(chosen)


def per_size_warmup(plan: Plan, segments: tuple[Segment, ...], *, compiled: bool, jit: bool,
                    world_size: int = 1) -> str | None:
    """Why this run must warm up every descriptor, whatever ``capture.warmup`` says; None
    when warming up the first of each mode (and those verified or watched) is enough.

    ``capture.warmup: auto`` lets a descriptor go straight to capture because what warmup
    does once (loading kernel modules, growing the allocator, cuBLAS's workspaces) is done
    by a larger descriptor before it. Some warmup work is per size, and capture needs it:

    - ``capture.warmup: each``: the plan asks for it;
    - a compiled segment (``compiled``: the plan compiles one and ``RunOptions.compile``):
      ``torch.compile`` specializes per shape, and compiles a size on its first call,
      which must be warmup's, never a capture's;
    - a segment with ``breaks``: the split (``graphflow.engine.model.split``) records
      each break's output structure per size at warmup, and capture reads it;
    - a channel: a collective's warmup (``real``, ``prepare``) initializes the
      communicator's per-size state, and ranks must run the same phases in the same order;
    - several ranks (the plan's ``world_size`` or the run's): each would decide from its
      own first warmup (``jit``), and their phases must pair up;
    - a segment with ``kernels``, or a JIT kernel launched by the first warmup that may
      specialize per batch size (``jit``: ``JitKernel.per_size``): a JIT kernel is
      compiled per specialization, and prewarm compiles those warmup launched; a size
      never warmed would compile its own inside capture.
    """
    if plan.capture.warmup is Warmup.EACH:
        return "capture.warmup is each"
    if compiled and any(plan.compile_of(s) is not None for s in segments):
        return "torch.compile specializes each segment it compiles per size"
    if any(s.breaks for s in segments):
        return "a segment's breaks record their outputs per size at warmup"
    if plan.channels:
        return "collectives warm up per size"
    if max(plan.world_size, world_size) > 1:
        return "ranks must run the same phases"
    if any(s.kernels for s in segments) or jit:
        return "JIT kernels compile per specialization, at warmup"
    return None


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
        return frozenset(first_of_each_mode(self.descriptors))

    def watches(self, descriptor: Descriptor) -> bool:
        """Whether the detectors watch this descriptor's warmup and capture."""
        scope = self.options.detectors
        return scope is Watch.ALL or (scope is Watch.FIRST and descriptor in self._first_of_mode)

    def first_of_mode(self, descriptor: Descriptor) -> bool:
        """Whether this is its mode's first (largest) descriptor in capture order."""
        return descriptor in self._first_of_mode

    @functools.cached_property
    def _sampled(self) -> frozenset[Descriptor]:
        return sample(self.descriptors)

    def verifies(self, descriptor: Descriptor) -> bool:
        """Whether verify compares this descriptor's replay with its eager step: all with
        ``Verify.ALL``; with ``Verify.SAMPLE``, the ``sample`` and the watched ones (their
        warmup runs anyway, and a hazard the detectors missed shows in the replay)."""
        scope = self.options.verify
        return scope is Verify.ALL or (scope is Verify.SAMPLE and (descriptor in self._sampled
                                                                    or self.watches(descriptor)))

    def warms(self, descriptor: Descriptor, each: bool) -> bool:
        """Whether this descriptor warms up before its capture: every one when ``each``
        (``per_size_warmup`` gave a reason), else the first of each mode, those verify
        compares (its reference is their warmup) and those the detectors watch."""
        return (each or descriptor in self._first_of_mode or self.verifies(descriptor)
                or self.watches(descriptor))

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
