"""A lazy engine: it serves at once while the lazy-capture thread records its descriptors.

With ``RunOptions(lazy=True)`` the pipeline stops after allocate and the first
descriptor's warmup and prewarm, and commits an engine with no step program of its own;
the capture thread has captured the largest descriptor before the engine is returned,
so the runtime serves every batch on it, padded up, from the first step (eagerly, on the
static buffers, only if that capture failed). The capture thread
(``graphflow.engine.lazy``, the one every integration shares: order, turns with the
steps, retries, failures) records one descriptor at a time, as the pipeline does
(``graphflow.engine.phase.run_descriptor``), into a pool that a failed capture replaces
(``graphflow.engine.pools``). This module is what is the engine's own:

* **How a descriptor is captured.** Its capture phase records in its turn beside the
  steps and pauses between the segments it records (``Hooks.record``, ``Hooks.pause``);
  a phase that runs the model on the static buffers (a warmup, where the step launches
  per-size JIT kernels, and the CPU backend's capture, which runs the region) takes a
  turn that does not pause and gives back every buffer the server's steps use
  (``_kept``). The thread's first warmup runs before the engine is returned: some of
  CUDA's lazy initialization is per thread (torch gives each thread its own cuBLAS
  handle, and a workspace per handle and stream), which must not happen inside its
  first capture (tried without it on the H200, that capture failed), and made later it
  would make a step wait for a whole eager step.
* **How it goes live.** Switched in unchecked (``LiveSwitch``), it is checked on its first
  real batch, in that step (``graphflow.engine.first_use``): the eager step is served,
  the replay from the same start compared with it, and a graph that differs is rolled
  back alone and named. So every descriptor is checked before it serves, and the thread
  never holds a step for a verify.

The serving side and the thread meet in one object, ``LiveSwitch`` (``engine.live``):
the turns, the programs switched in so far and a version each switch-in moves on, the
report, and the other way what serving asks for. The engine itself is set once, at
commit; all that changes while it serves is there, the runtime talks to it and never to
the thread, and the thread writes through it.

Limits: one rank and no channels (ranks would capture in orders their own traffic
decides, and their barriers would disagree); capture them in the foreground.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator

import attrs

from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Call
from graphflow.engine.buffers import Copies
from graphflow.engine.capture import Captured
from graphflow.engine.context import Context
from graphflow.engine.first_use import FirstUse
from graphflow.engine.lazy import KeyState, LazyCapture
from graphflow.engine.locus import Locus
from graphflow.engine.options import Verify, Watch
from graphflow.engine.phase import Hooks, PhaseResult, Tally, run_descriptor, summarize
from graphflow.engine.report import PipelineReport
from graphflow.engine.rollback import Undo, UndoStack
from graphflow.engine.turns import Turns
from graphflow.engine.verify import VerifyResult
from graphflow.engine.execute import call_segment, run_eager
from graphflow.engine.warmup import DescriptorTime, eager_step, fill_inputs
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.plan import BufferRole, Descriptor, Mode, holders

__all__ = ["BackgroundCapture", "LiveSwitch"]

#: How long the thread waits for the engine's first step before its first capture: that
#: step then waits for nothing, and the thread knows which descriptor to capture first.
FIRST_STEP_S = 0.5


class LiveSwitch:
    """What a lazy engine's serving side and its capture thread share (see the module
    docstring): the one place either of them changes while the engine serves."""

    def __init__(self, report: PipelineReport):
        #: A step and a recording never run at once (``graphflow.engine.turns``).
        self.turns = Turns()
        #: Held while the programs change or are read.
        self.lock = threading.RLock()
        #: The step programs switched in so far; ``version`` counts the switch-ins,
        #: roll-backs, first-use checks and the thread's end, so a runner sees at its
        #: next step that a batch may go elsewhere.
        self.programs: dict[Descriptor, tuple[Call, ...]] = {}
        self.version = 0
        #: The foreground's report, then the thread's once it is ``done``.
        self.report = report
        #: The thread writes the static buffers no more (a step's outputs may stay in them).
        self.done = False
        #: The descriptors switched in unchecked, checked on their first batch.
        self.first_use: FirstUse | None = None
        self._core: LazyCapture | None = None
        self._best: dict[int, Descriptor] = {}

    def attach(self, core: LazyCapture, best: dict[int, Descriptor]) -> None:
        """The capture thread serving asks, and the descriptor that serves each batch size best."""
        self._core, self._best = core, best

    # -- what serving says -------------------------------------------------------------
    def asked(self, batch: int) -> None:
        """A batch of this size is served: capture the descriptor that holds it best sooner."""
        if self._core is not None and not self.done:
            self._core.ask(self._best.get(batch))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Around a step: no recording runs meanwhile."""
        with self.turns.step(), self.lock:
            yield

    @property
    def unchecked(self) -> set[Descriptor]:
        return set() if self.first_use is None else self.first_use.unchecked

    def checked(self, descriptor: Descriptor, error: CaptureError | None) -> None:
        """A descriptor's first batch checked it (``FirstUse``): live, or taken out here
        and rolled back by the capture thread."""
        if error is not None:
            self.programs.pop(descriptor, None)
        elif self.done:  # the thread's report is written: this check joins it
            self.report = attrs.evolve(self.report, verify=(*self.report.verify, self.first_use.verified[-1]))
        self.version += 1  # a checked graph may serve larger batches while the thread records
        self._core.checked(descriptor, error)

    # -- what the thread writes ----------------------------------------------------------
    def switch_in(self, descriptor: Descriptor, program: tuple[Call, ...], *, checked: bool) -> None:
        """Serve ``descriptor``'s batches with ``program`` from the next step on."""
        with self.lock:
            self.programs[descriptor] = program
            if not checked:
                self.first_use.unchecked.add(descriptor)
            self.version += 1

    def finish(self, report: PipelineReport) -> None:
        with self.lock:
            self.report = report
            self.done = True
            self.version += 1  # a batch a checked graph held while the thread ran goes to its own


class BackgroundCapture:
    """A lazy engine's capture (see the module docstring): the engine's ``Capturer`` for
    the lazy-capture thread, and what the engine and its callers read of that thread."""

    def __init__(self, ctx: Context, alloc: Allocation, captured: Captured, live: LiveSwitch):
        # The foreground watched the first warmup; a watch in the capture thread would patch
        # torch's synchronize for the serving thread too.
        self._ctx = attrs.evolve(ctx, options=attrs.evolve(ctx.options, detectors=Watch.OFF))
        self._stack = ctx.stack  # the engine's: each live descriptor's undo joins it
        self._alloc, self._captured, self._live = alloc, captured, live
        self._touched = tuple(dict.fromkeys((
            *(b.name for b in ctx.plan.buffers if b.role in (BufferRole.INPUT, BufferRole.STATE)),
            *ctx.verify_plan.written)))
        # Where a phase that runs the model keeps what serving left in the buffers it
        # touches (``_kept``): allocated at the first such phase (a CUDA engine without
        # per-size JIT kernels has none), then reused, not cloned per phase.
        self._saved: Copies | None = None
        self._tally = Tally()
        #: Each switched-in descriptor's graphs and the undo that destroys them, until it is
        #: rolled back or the engine closes.
        self._undos: dict[Descriptor, tuple[list, Undo]] = {}
        self._contexts: dict[Descriptor, Context] = {}  # the descriptor under way
        self._first_graph: dict[Descriptor, int] = {}  # where its graphs begin in ``captured.graphs``
        self._events: Context | None = None
        checks = ctx.options.verify is not Verify.OFF
        if checks:
            live.first_use = FirstUse(ctx.plan, ctx.verify_plan, alloc.buffers,
                                      tuple((s, alloc.uncompiled[s.name]) for s in ctx.segments),
                                      verdict=live.checked)
            ctx.stack.push("drop the first-use checks", live.first_use.release)
        self._checks = checks
        descriptors = ctx.descriptors
        largest = max(descriptors, key=lambda d: (d.size, d.mode is Mode.FULL), default=None)
        self.core = LazyCapture(self, descriptors, turns=live.turns, first=largest, first_step_s=FIRST_STEP_S,
                                name="graphflow-background-capture")
        live.attach(self.core, dict(enumerate(holders(descriptors))))

    def start(self) -> None:
        """Start the thread; returns once it has run its first warmup (``prepare``)."""
        self.core.start()

    @property
    def started_at(self) -> float | None:
        return self.core.started_at

    @property
    def finished_at(self) -> float | None:
        return self.core.finished_at

    @property
    def done(self) -> bool:
        return self.core.done

    @property
    def failures(self) -> dict[Descriptor, CaptureError]:
        return self.core.failures

    @property
    def states(self) -> dict[Descriptor, KeyState]:
        return self.core.states

    @property
    def verified(self) -> list[VerifyResult]:
        """The descriptors checked so far, each on its first batch."""
        first_use = self._live.first_use
        return [] if first_use is None else list(first_use.verified)

    @property
    def times(self) -> list[DescriptorTime]:
        return self._tally.times

    @property
    def phases(self) -> list[PhaseResult]:
        return self._tally.phases

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every descriptor to be captured (or to have failed); False on timeout."""
        return self.core.wait(timeout)

    def stop(self) -> None:
        """Capture nothing more; returns once the descriptor under way is done."""
        self.core.stop()

    def check_unchecked(self) -> None:
        """Check every captured descriptor no batch has checked yet, on verify's seeded
        inputs in place of a first batch (``graphflow run --lazy``, which serves none);
        one that differs is rolled back and joins ``failures``. Call it between steps."""
        live, ctx = self._live, self._ctx
        for descriptor in [d for d in ctx.descriptors if d in live.unchecked]:
            with live.step():
                views = self._alloc.buffers.views(descriptor.size)
                fill_inputs(ctx.plan, views, descriptor.size, ctx.options.seed, strict=True)
                live.first_use.check(descriptor, live.programs[descriptor])

    # -- the Capturer, on the thread ------------------------------------------------------
    def prepare(self) -> None:
        """The run's first descriptor's step, eagerly once more, on this thread, before the
        engine serves (see the module docstring)."""
        # Listeners see the thread's work as a pipeline of its own: a progress display
        # draws it as it would a foreground run.
        self._events = attrs.evolve(self._ctx, stack=UndoStack(), locus=Locus())
        self._events.emit(EventKind.PIPELINE_BEGIN, total=len(self._ctx.descriptors))
        self._alloc.owned.free_snapshots()  # verify's: first use checks each descriptor instead
        if not self._ctx.descriptors:
            return
        ctx, alloc, size = self._ctx, self._alloc, self._ctx.descriptors[0].size
        began = time.perf_counter()
        views = alloc.buffers.views(size)
        fill_inputs(ctx.plan, views, size, ctx.options.seed, strict=False)
        run_eager(ctx.backend, alloc.schedules[tuple(s.name for s in ctx.segments)], eager_step(ctx, alloc, size),
                  lambda segment, call: call_segment(self._events, segment, call))
        alloc.synchronize(ctx)
        self._tally.times.append(DescriptorTime(Phase.WARMUP, ctx.descriptors[0], time.perf_counter() - began))

    def capture(self, descriptor: Descriptor, turns: Turns, pausing: bool) -> None:
        from graphflow.engine.jit import registry as jit_registry

        ctx = self._contexts[descriptor] = attrs.evolve(self._ctx, stack=UndoStack(), locus=Locus())
        self._first_graph[descriptor] = len(self._captured.graphs)
        jit_registry.attach(ctx.locus)
        hooks = Hooks(guard=self._kept, pool=False, first_use=True,
                      record=functools.partial(_in_turn, turns, pausing),
                      pause=turns.pause if pausing else None)
        try:
            run_descriptor(ctx, self._alloc, self._captured, descriptor, ctx.descriptors.index(descriptor) + 1,
                           self._tally, hooks)
            for pools in self._alloc.pool_sets.values():
                pools.holds(descriptor)
        finally:
            jit_registry.detach(ctx.locus)
        del self._contexts[descriptor]
        first = self._first_graph.pop(descriptor)
        graphs = self._captured.graphs[first:]
        undo = self._stack.push(f"roll back {descriptor}", functools.partial(_unwind, ctx.stack))
        self._undos[descriptor] = (graphs, undo)
        self._live.switch_in(descriptor, self._captured.programs[descriptor], checked=not self._checks)
        self.core.captured(descriptor, checked=not self._checks)

    def undo(self, descriptor: Descriptor, error: BaseException, final: bool) -> CaptureError:
        """A failed capture's rollback (its graphs destroyed, its pool replaced), or a
        descriptor its first batch rejected."""
        held = self._undos.pop(descriptor, None)
        if held is not None:  # switched in, then rejected by its first batch
            graphs, undo = held
            with self._live.lock:
                self._live.programs.pop(descriptor, None)
                self._live.version += 1
            self._stack.run_now(undo)
            gone = set(map(id, graphs))
            self._captured.graphs[:] = [g for g in self._captured.graphs if id(g) not in gone]
            self._captured.programs.pop(descriptor, None)
            for pools in self._alloc.pool_sets.values():
                pools.drop(descriptor)
            with self._live.lock:
                if self._live.done:  # the report is written: it loses the descriptor
                    report = self._live.report
                    self._live.report = attrs.evolve(
                        report, descriptors=tuple(d for d in report.descriptors if d != descriptor),
                        graphs=len(self._captured.graphs), pool_bytes=self._alloc.pool_bytes(self._ctx))
            return error if isinstance(error, CaptureError) else CaptureError(str(error), descriptor=descriptor)
        ctx = self._contexts.pop(descriptor)
        where = ctx.locus.failure(error)
        ctx.locus.forget()
        failures = ctx.stack.unwind()
        self._captured.programs.pop(descriptor, None)
        del self._captured.graphs[self._first_graph.pop(descriptor):]  # destroyed by the rollback
        for pools in self._alloc.pool_sets.values():
            pools.failed()
        if not isinstance(error, CaptureError):
            error = CaptureError(f"{type(error).__name__}: {error}", phase=where.phase.value if where.phase else None,
                                 descriptor=descriptor, segment=where.segment, rank=ctx.rank,
                                 hint="this descriptor was rolled back; its batches are served by a larger one or "
                                      "eagerly" if final else "captured again later, whole between two steps")
        if failures is not None:
            error.add_note(f"rollback: {failures}")
        return error

    def finish(self) -> None:
        with self._live.lock:
            self._captured.close()  # gc unfrozen where graphflow froze it, tripwires removed
            self._saved = None
            report = self._final_report()
            if self._events is not None:
                self._stack.adopt(self._events.stack)
            self._live.finish(report)
        if self._events is not None:
            self._events.emit(EventKind.PIPELINE_END, total=len(self._ctx.descriptors), pool_bytes=report.pool_bytes)

    def _final_report(self) -> PipelineReport:
        """The engine's report with what the thread did: once ``done``, ``engine.report``
        reads as a foreground run's would, with the descriptors that went live."""
        report, ctx, tally = self._live.report, self._ctx, self._tally
        live = tuple(d for d in ctx.descriptors if d in self._live.programs)
        return attrs.evolve(report, descriptors=live, graphs=len(self._captured.graphs),
                            phases=summarize([*report.phases, *tally.phases]),
                            verify=(*report.verify, *self.verified), times=(*report.times, *tally.times),
                            pool_bytes=self._alloc.pool_bytes(ctx), pool_estimate=dict(self._captured.pool_estimate),
                            pool_probe={**tally.pool_probe, **report.pool_probe})

    def _kept(self, descriptor: Descriptor, body: Callable[[], object]) -> Callable[[], object]:
        """``body`` in a turn of its own (no step meanwhile), every buffer it may touch
        given back as it was."""

        def kept():
            views = self._alloc.buffers.views(descriptor.size)
            with self._live.turns.recording(pausing=False), self._live.lock:
                if self._saved is None:
                    self._saved = Copies(self._alloc.buffers, self._touched)
                saved = self._saved.take(views, descriptor.size)
                try:
                    return body()
                finally:
                    for name, value in saved.items():
                        views[name].copy_(value)

        return kept


def _in_turn(turns: Turns, pausing: bool, body: Callable[[], object]) -> Callable[[], object]:
    def recorded():
        with turns.recording(pausing=pausing, hook_modules=False):
            return body()

    return recorded


def _unwind(stack: UndoStack) -> None:
    failures = stack.unwind()
    if failures is not None:
        raise failures

