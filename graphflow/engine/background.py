"""Lazy capture: the engine serves at once while a thread captures its descriptors.

With ``RunOptions(lazy=True)`` the pipeline stops after allocate, the first descriptor's
warmup and prewarm, and commits an engine with no step program: the runtime serves every
batch eagerly (on the static buffers) from the first step. ``BackgroundCapture`` then
warms, captures and verifies one descriptor at a time and switches each in once it
verifies. The order: the smallest descriptor that holds the first batch seen; then the
largest, so that every batch from then on replays a graph (padded up) and no eager step
competes with the capture for the host; then the smallest holding each batch size seen,
first seen first; then the plan's order. A descriptor that fails is rolled back alone
(its graphs destroyed) and noted in ``failures``; its batches go on being served by a
larger descriptor or eagerly.

The thread warms up the first descriptor again although the foreground just did: some
of CUDA's lazy initialization is per thread (torch gives each thread its own cuBLAS
handle, and a workspace per handle and stream), so the thread's own first matmul must
run outside capture. Tried without it on the H200, the thread's first capture failed
in a process where no thread had used cuBLAS before (the following ones then found the
pool still recording), which is what cuBLAS initializing inside the capture would do.

Why it is safe beside serving:

* **Execution is serialized.** The engine's ``lock`` is held by the runtime for each
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
import functools
import threading
import time
from collections.abc import Iterator

import attrs

from graphflow.engine.allocate import Allocation
from graphflow.engine.buffers import Copies
from graphflow.engine.capture import Captured, capture
from graphflow.engine.context import Context
from graphflow.engine.phase import PhaseResult, run_phase, summarize
from graphflow.engine.rollback import UndoStack
from graphflow.engine.verify import VerifyResult, verify
from graphflow.engine.warmup import DescriptorTime, warmup
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.engine.locus import Locus
from graphflow.plan import BufferRole, Descriptor

__all__ = ["BackgroundCapture"]

#: The longest the thread lets steps go first before it takes the lock for a phase: a
#: step or two. Steps served back to back leave no gap to wait for, so a longer wait only
#: delays the capture (the step after it waits for the phase either way).
SERVING_FIRST_S = 0.05
#: At its start, how long the thread waits for the engine's first step to be served
#: before its own first phase: that step then waits for none of the thread's work, and
#: the thread knows which descriptor to capture first.
FIRST_STEP_S = 0.5


class BackgroundCapture:
    """The capture thread of a lazy engine (see the module docstring)."""

    def __init__(self, ctx: Context, alloc: Allocation, captured: Captured, engine, pending: tuple[Descriptor, ...]):
        self._ctx, self._alloc, self._captured, self._engine = ctx, alloc, captured, engine
        self._pending = list(pending)
        self._asked: list[int] = []  # batch sizes, in the order first seen
        self._cond = threading.Condition()
        self._stopping = False
        self._serving = 0  # steps waiting for the lock or running under it
        self._served = 0  # steps done
        self._touched = tuple(dict.fromkeys((
            *(b.name for b in ctx.plan.buffers if b.role in (BufferRole.INPUT, BufferRole.STATE)),
            *ctx.verify_plan.written)))
        self.lock = engine.lock
        # Where a phase keeps what serving left in the buffers it touches (see ``_kept``):
        # allocated once, as verify's snapshots are, not cloned per phase.
        self._saved = Copies(alloc.buffers, self._touched)
        self.failures: dict[Descriptor, CaptureError] = {}
        self.verified: list[VerifyResult] = []
        self.times: list[DescriptorTime] = []
        self.phases: list[PhaseResult] = []
        self.started_at = time.perf_counter()
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="graphflow-background-capture", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for every descriptor to be captured (or to have failed); False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

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
        """Capture nothing more; returns once the descriptor under way is done."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()

    # -- the thread ---------------------------------------------------------------------
    def _next(self) -> Descriptor | None:
        with self._cond:
            if not self._pending:
                return None
            # The descriptor that serves the first batch seen; then the largest, so that
            # every batch from then on replays a graph (padded up) instead of running the
            # model eagerly beside the capture; then, for each batch size asked for, first
            # seen first, the one that serves it best (the smallest that holds it, FULL
            # before PIECEWISE), if still pending; then the plan's order.
            candidates = [*self._pending, *self._engine.programs]
            largest = max(d.size for d in candidates)
            for batch in (*self._asked[:1], largest, *self._asked[1:]) if self._asked else ():
                holders = [d for d in candidates if d.size >= batch]
                if holders:
                    best = min(holders, key=lambda d: (d.size, d.mode.value != "FULL"))
                    if best in self._pending:
                        return best
            return self._pending[0]

    def _run(self) -> None:
        from graphflow.engine.jit import registry as jit_registry

        # Listeners see the thread's work as a pipeline of its own: a progress display
        # draws it as it would a foreground run.
        events = attrs.evolve(self._ctx, stack=UndoStack(), locus=Locus())
        events.emit(EventKind.PIPELINE_BEGIN, total=len(self._pending))
        try:
            with self._cond:
                self._cond.wait_for(lambda: self._served or self._stopping, timeout=FIRST_STEP_S)
            while not self._stopping:
                descriptor = self._next()
                if descriptor is None:
                    break
                with self._cond:
                    self._pending.remove(descriptor)
                ctx = attrs.evolve(self._ctx, stack=UndoStack(), locus=Locus())
                jit_registry.attach(ctx.locus)
                graphs = len(self._captured.graphs)
                try:
                    self._one(ctx, descriptor)
                except Exception as error:  # noqa: BLE001 - rolled back alone; serving goes on
                    self._failed(ctx, descriptor, error)
                    del self._captured.graphs[graphs:]  # destroyed by the rollback: not the engine's
                finally:
                    jit_registry.detach(ctx.locus)
        finally:
            with self.lock:
                self._captured.close()  # gc unfrozen, tripwires removed
                self._alloc.owned.free_snapshots()
                self._saved.clear()
                self._engine.report = self._final_report()
                self._engine._adopt(events.stack)
            self.finished_at = time.perf_counter()
            events.emit(EventKind.PIPELINE_END, total=len(self._ctx.descriptors), pool_bytes=self._engine.report.pool_bytes)

    def _final_report(self):
        """The engine's report with what the thread did: once ``done``, ``engine.report``
        reads as a foreground run's would, with the descriptors that went live."""
        report, ctx = self._engine.report, self._ctx
        live = tuple(d for d in ctx.descriptors if d in self._engine.programs)
        return attrs.evolve(report, descriptors=live, graphs=len(self._captured.graphs),
                            phases=summarize([*report.phases, *self.phases]),
                            verify=(*report.verify, *self.verified), times=(*report.times, *self.times),
                            pool_bytes=self._alloc.pool_bytes(ctx), pool_estimate=dict(self._captured.pool_estimate))

    def _one(self, ctx: Context, descriptor: Descriptor) -> None:
        index = ctx.descriptors.index(descriptor) + 1
        alloc, captured, phases = self._alloc, self._captured, self.phases
        kept = functools.partial(self._kept, descriptor)
        warmed = run_phase(ctx, phases, Phase.WARMUP, kept(lambda: warmup(ctx, alloc, descriptor, index)))
        self.times.append(warmed.time)
        # A CUDA capture records without running: no lock. The CPU backend's runs the region.
        body = lambda: capture(ctx, alloc, captured, descriptor, index)  # noqa: E731
        self.times.append(run_phase(ctx, phases, Phase.CAPTURE, body if ctx.backend.captures_graphs else kept(body)))
        captured.settle()  # before verify takes the lock: steps are served while the graphs instantiate
        program = captured.programs[descriptor]
        if ctx.options.verify:
            result, took = run_phase(ctx, phases, Phase.VERIFY,
                                     kept(lambda: verify(ctx, alloc, captured, descriptor, index, warmed)))
            self.verified.append(result)
            self.times.append(took)
        with self.lock:
            self._engine._adopt(ctx.stack)
            self._engine.programs[descriptor] = program
            self._engine.version += 1

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

    def _kept(self, descriptor: Descriptor, body):
        """``body`` under the engine's lock, every buffer it may touch given back as it was."""

        def kept():
            views = self._alloc.buffers.views(descriptor.size)
            with self._cond:  # steps first; bounded, should several serving threads never pause
                self._cond.wait_for(lambda: not self._serving or self._stopping, timeout=SERVING_FIRST_S)
            with self.lock:
                saved = self._saved.take(views, descriptor.size)
                try:
                    return body()
                finally:
                    for name, value in saved.items():
                        views[name].copy_(value)

        return kept
