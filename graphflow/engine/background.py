"""Lazy capture: the engine serves at once while a thread captures its descriptors.

With ``RunOptions(lazy=True)`` the pipeline stops after allocate, the first descriptor's
warmup and prewarm, and commits an engine with no step program: the runtime serves every
batch eagerly (on the static buffers) from the first step. ``BackgroundCapture`` then
runs one descriptor at a time through warmup, capture and verify, as the pipeline does
(``graphflow.engine.phase.run_descriptor``), and switches each in once it verifies. The
order: the smallest descriptor that holds the first batch seen; then the largest, so
that every batch from then on replays a graph (padded up) and no eager step competes
with the capture for the host; then the smallest holding each batch size seen, first
seen first; then the plan's order. A descriptor that fails is rolled back alone (its
graphs destroyed) and noted in ``failures``; its batches go on being served by a larger
descriptor or eagerly.

The serving side and the thread meet in one object, ``LiveSwitch`` (``engine.live``):
the lock, the programs switched in so far and a version each switch-in moves on, the
report, and the other way what serving asks for (batch sizes, steps waiting or running,
stopping). The engine itself is set once, at commit; all that changes while it serves is
there, the runtime talks to it and never to the thread, and the thread writes through it.

The thread warms up the first descriptor again although the foreground just did: some
of CUDA's lazy initialization is per thread (torch gives each thread its own cuBLAS
handle, and a workspace per handle and stream), so the thread's own first matmul must
run outside capture. Tried without it on the H200, the thread's first capture failed
in a process where no thread had used cuBLAS before (the following ones then found the
pool still recording), which is what cuBLAS initializing inside the capture would do.

Why it is safe beside serving:

* **Execution is serialized.** The live switch's ``lock`` is held by the runtime for each
  step and by the background thread for a descriptor's warmup and verify, which run the
  model on the static buffers. Those two snapshot every buffer they touch (inputs, what
  the step writes, the state) at their descriptor's size first and put it back after,
  so the KV cache of the sequences being served, and the outputs the last step
  returned, come back unchanged. Steps go first: while one waits for the lock or runs
  (``serving``), the thread takes the lock for no new phase for up to
  ``SERVING_FIRST_S``, so a step waits for one phase of a descriptor at most; and at
  its start the thread waits a moment (``FIRST_STEP_S``) for the engine's first step,
  which then waits for nothing.
* **Recording is not.** A CUDA capture records without running anything, so it goes on
  while batches are served. It runs with ``capture_error_mode="thread_local"`` (as vLLM
  does since its capture ran beside other CUDA work): the capturing thread may not make
  unsafe calls, the serving thread may make any. The serving thread runs on the default
  stream, the capture on the plan's streams, and the caching allocator sends only the
  capturing stream's allocations to the graph pool. Graphs sharing the pool never
  replay at the same time: replays happen under the lock.
* **Per-thread places.** The background thread has its own ``Locus``, so errors and JIT
  records name its descriptor and segment, and the JIT tripwires fire only for a stream
  capturing in that thread.

While a capture runs, the serving side must not synchronize the whole device
(``torch.cuda.synchronize()``): that waits for the capturing stream, which CUDA refuses
(``operation not permitted when stream is capturing``); synchronize its own stream
(``torch.cuda.current_stream().synchronize()``) instead. The runtime itself never does.

Serving beside the thread makes it slower than alone: it waits (steps go first, and
warmup and verify take the lock), and its captures record more slowly beside the steps
(``docs/engine.md``, Lazy capture, has the H200's figures).

Limits: one rank and no channels (ranks would capture in orders their own traffic
decides, and their barriers would disagree); capture them in the foreground.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

import attrs
import torch

from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Call
from graphflow.engine.buffers import Copies
from graphflow.engine.capture import Captured
from graphflow.engine.context import Context
from graphflow.engine.engine import PipelineReport
from graphflow.engine.locus import Locus
from graphflow.engine.options import Watch
from graphflow.engine.phase import Hooks, PhaseResult, Tally, run_descriptor, summarize
from graphflow.engine.rollback import UndoStack
from graphflow.engine.verify import VerifyResult
from graphflow.engine.warmup import DescriptorTime
from graphflow.errors import CaptureError
from graphflow.events import EventKind
from graphflow.plan import BufferRole, Descriptor

__all__ = ["BackgroundCapture", "LiveSwitch"]

#: The longest the thread lets steps go first before it takes the lock for a phase: a
#: step or two. Steps served back to back leave no gap to wait for, so a longer wait only
#: delays the capture (the step after it waits for the phase either way).
SERVING_FIRST_S = 0.05
#: At its start, how long the thread waits for the engine's first step to be served
#: before its own first phase: that step then waits for none of the thread's work, and
#: the thread knows which descriptor to capture first.
FIRST_STEP_S = 0.5


class LiveSwitch:
    """What a lazy engine's serving side and its capture thread share (see the module
    docstring): the one place either of them changes while the engine serves."""

    def __init__(self, report: PipelineReport):
        #: Held by a step, and by the thread for a phase that runs the model.
        self.lock = threading.RLock()
        #: The step programs switched in so far; ``version`` counts the switch-ins, so a
        #: runner sees at its next step that there are new ones.
        self.programs: dict[Descriptor, tuple[Call, ...]] = {}
        self.version = 0
        #: The foreground's report, then the thread's once it is ``done``.
        self.report = report
        #: The thread writes the static buffers no more (a step's outputs may stay in them).
        self.done = False
        self._cond = threading.Condition()
        self._asked: list[int] = []  # batch sizes, in the order first seen
        self._serving = 0  # steps waiting for the lock or running under it
        self._served = 0  # steps done
        self._stopping = False

    # -- what serving says -------------------------------------------------------------
    def asked(self, batch: int) -> None:
        """A batch of this size was served: capture the descriptor that holds it sooner."""
        if batch not in self._asked:
            with self._cond:
                self._asked.append(batch)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Around a step: while one waits for the lock or runs, the thread takes the lock
        for nothing new (a step waits for one phase of a descriptor at most, not for a
        queue of them)."""
        with self._cond:
            self._serving += 1
        try:
            yield
        finally:
            with self._cond:
                self._serving -= 1
                self._served += 1
                self._cond.notify_all()

    def stop(self) -> None:
        """Capture nothing more (the engine closes); wakes a thread that waits."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- what the thread reads and writes ----------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stopping

    def demand(self) -> tuple[int, ...]:
        """The batch sizes served so far, first seen first."""
        with self._cond:
            return tuple(self._asked)

    def wait_for_first_step(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._served or self._stopping, timeout=timeout)

    def wait_for_gap(self, timeout: float) -> None:
        """Steps first; bounded, should several serving threads never pause."""
        with self._cond:
            self._cond.wait_for(lambda: not self._serving or self._stopping, timeout=timeout)

    def switch_in(self, descriptor: Descriptor, program: tuple[Call, ...]) -> None:
        """Serve ``descriptor``'s batches with ``program`` from the next step on."""
        with self.lock:
            self.programs[descriptor] = program
            self.version += 1

    def finish(self, report: PipelineReport) -> None:
        with self.lock:
            self.report = report
            self.done = True


class BackgroundCapture:
    """The capture thread of a lazy engine (see the module docstring)."""

    def __init__(self, ctx: Context, alloc: Allocation, captured: Captured, live: LiveSwitch):
        # The foreground watched the first warmup; a watch in the capture thread would patch
        # torch's synchronize for the serving thread too.
        self._ctx = attrs.evolve(ctx, options=attrs.evolve(ctx.options, detectors=Watch.OFF))
        self._stack = ctx.stack  # the engine's: a descriptor's undos join it as it goes live
        self._alloc, self._captured, self._live = alloc, captured, live
        self._pending = list(ctx.descriptors)
        self._touched = tuple(dict.fromkeys((
            *(b.name for b in ctx.plan.buffers if b.role in (BufferRole.INPUT, BufferRole.STATE)),
            *ctx.verify_plan.written)))
        # Where a phase keeps what serving left in the buffers it touches (see ``_kept``):
        # allocated once, as verify's snapshots are, not cloned per phase.
        self._saved = Copies(alloc.buffers, self._touched)
        self._tally = Tally()
        self.failures: dict[Descriptor, CaptureError] = {}
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # The thread (which holds this object) is made here: an engine rolled back before
        # its thread started leaves no cycle keeping the allocation alive.
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="graphflow-background-capture", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def verified(self) -> list[VerifyResult]:
        return self._tally.verified

    @property
    def times(self) -> list[DescriptorTime]:
        return self._tally.times

    @property
    def phases(self) -> list[PhaseResult]:
        return self._tally.phases

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every descriptor to be captured (or to have failed); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """Capture nothing more; returns once the descriptor under way is done."""
        self._live.stop()
        self._thread.join()

    # -- the thread ---------------------------------------------------------------------
    def _next(self) -> Descriptor | None:
        if not self._pending:
            return None
        # The descriptor that serves the first batch seen; then the largest, so that every
        # batch from then on replays a graph (padded up) instead of running the model
        # eagerly beside the capture; then, for each batch size asked for, first seen
        # first, the one that serves it best (the smallest that holds it, FULL before
        # PIECEWISE), if still pending; then the plan's order.
        asked = self._live.demand()
        candidates = [*self._pending, *self._live.programs]
        largest = max(d.size for d in candidates)
        for batch in (*asked[:1], largest, *asked[1:]) if asked else ():
            holders = [d for d in candidates if d.size >= batch]
            if holders:
                best = min(holders, key=lambda d: (d.size, d.mode.value != "FULL"))
                if best in self._pending:
                    return best
        return self._pending[0]

    def _run(self) -> None:
        # Grad mode is per thread: the foreground's ``no_grad`` does not reach this one,
        # and a model whose parameters require grad would refuse every ``out=`` write.
        with torch.no_grad():
            self._capture_all()

    def _capture_all(self) -> None:
        from graphflow.engine.jit import registry as jit_registry

        # Listeners see the thread's work as a pipeline of its own: a progress display
        # draws it as it would a foreground run.
        events = attrs.evolve(self._ctx, stack=UndoStack(), locus=Locus())
        events.emit(EventKind.PIPELINE_BEGIN, total=len(self._pending))
        hooks = Hooks(guard=self._kept, pool=False)
        try:
            self._live.wait_for_first_step(FIRST_STEP_S)
            while not self._live.stopping:
                descriptor = self._next()
                if descriptor is None:
                    break
                self._pending.remove(descriptor)
                ctx = attrs.evolve(self._ctx, stack=UndoStack(), locus=Locus())
                jit_registry.attach(ctx.locus)
                graphs = len(self._captured.graphs)
                try:
                    self._one(ctx, descriptor, hooks)
                except Exception as error:  # noqa: BLE001 - rolled back alone; serving goes on
                    self._failed(ctx, descriptor, error)
                    del self._captured.graphs[graphs:]  # destroyed by the rollback: not the engine's
                finally:
                    jit_registry.detach(ctx.locus)
        finally:
            with self._live.lock:
                self._captured.close()  # gc unfrozen, tripwires removed
                self._alloc.owned.free_snapshots()
                self._saved.clear()
                report = self._final_report()
                self._stack.adopt(events.stack)
                self._live.finish(report)
            self.finished_at = time.perf_counter()
            events.emit(EventKind.PIPELINE_END, total=len(self._ctx.descriptors), pool_bytes=report.pool_bytes)

    def _final_report(self) -> PipelineReport:
        """The engine's report with what the thread did: once ``done``, ``engine.report``
        reads as a foreground run's would, with the descriptors that went live."""
        report, ctx, tally = self._live.report, self._ctx, self._tally
        live = tuple(d for d in ctx.descriptors if d in self._live.programs)
        return attrs.evolve(report, descriptors=live, graphs=len(self._captured.graphs),
                            phases=summarize([*report.phases, *tally.phases]),
                            verify=(*report.verify, *tally.verified), times=(*report.times, *tally.times),
                            pool_bytes=self._alloc.pool_bytes(ctx), pool_estimate=dict(self._captured.pool_estimate),
                            pool_probe={**tally.pool_probe, **report.pool_probe})

    def _one(self, ctx: Context, descriptor: Descriptor, hooks: Hooks) -> None:
        run_descriptor(ctx, self._alloc, self._captured, descriptor, ctx.descriptors.index(descriptor) + 1,
                       self._tally, hooks)
        with self._live.lock:
            self._stack.adopt(ctx.stack)
            self._live.switch_in(descriptor, self._captured.programs[descriptor])

    def _failed(self, ctx: Context, descriptor: Descriptor, error: Exception) -> None:
        where = ctx.locus.failure(error)
        ctx.locus.forget()
        failures = ctx.stack.unwind()
        self._captured.programs.pop(descriptor, None)
        if not isinstance(error, CaptureError):
            error = CaptureError(f"{type(error).__name__}: {error}", phase=where.phase.value if where.phase else None,
                                 descriptor=descriptor, segment=where.segment, rank=ctx.rank,
                                 hint="this descriptor was rolled back; its batches are served by a larger one or "
                                      "eagerly")
        if failures is not None:
            error.add_note(f"rollback: {failures}")
        self.failures[descriptor] = error

    def _kept(self, descriptor: Descriptor, body: Callable[[], object]) -> Callable[[], object]:
        """``body`` under the live switch's lock, every buffer it may touch given back as it was."""

        def kept():
            views = self._alloc.buffers.views(descriptor.size)
            self._live.wait_for_gap(SERVING_FIRST_S)
            with self._live.lock:
                saved = self._saved.take(views, descriptor.size)
                try:
                    return body()
                finally:
                    for name, value in saved.items():
                        views[name].copy_(value)

        return kept
