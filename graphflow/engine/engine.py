"""The committed result: the ``Engine`` the runtime replays, and its report.

``commit`` is the last phase: every graph made ready to replay, and the run's report.
``publish`` then hands the step programs, the static buffers and the model to an
``Engine`` once the report holds every phase's result, commit's included: the engine is
made whole at once and frozen, so no reader ever sees one half set up. What changes
afterwards has a place of its own: what ``close`` lets go of (``Held``), and a lazy
engine's switched-in programs (``graphflow.engine.background.LiveSwitch``). The engine
keeps the run's rollback stack, so that closing it releases exactly what rollback would
have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs
import torch

from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Backend, Call
from graphflow.engine.buffers import StaticBuffers
from graphflow.engine.capture import Captured
from graphflow.engine.model.compiled import CompileReport, compile_report
from graphflow.engine.context import Context
from graphflow.engine.execute import bind
from graphflow.engine.phase import Outcome, PhaseResult
from graphflow.engine.rollback import UndoStack
from graphflow.engine.verify import VerifyResult
from graphflow.engine.warmup import DescriptorTime
from graphflow.events import Phase
from graphflow.plan import Descriptor, Plan, Segment

if TYPE_CHECKING:
    from graphflow.engine.background import BackgroundCapture, LiveSwitch

__all__ = ["Engine", "Held", "Outcome", "PhaseResult", "PipelineReport", "commit", "publish"]


@attrs.frozen
class PipelineReport:
    """What a committed pipeline did; ``graphflow run`` prints it.

    ``times`` holds each descriptor's seconds in warmup, capture and verify, with the
    capture pool's size after it when it was measured (a warmup left out by
    ``capture.warmup: auto`` is there, ``skipped``); ``verify`` the descriptors verify
    compared (``RunOptions.verify``: a sample of them by default); ``prewarm`` lists the
    JIT specializations compiled, loaded and launched before capture; ``compile`` what
    ``torch.compile`` did for each compiled segment during warmup. ``pool_probe``: per
    mode, what a pool of its own reserved for one more run of its first (largest)
    descriptor's step after its warmup, known before any capture: ``pool_forecast``
    beside the measured ``pool_bytes``.
    """

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
    times: tuple[DescriptorTime, ...] = ()
    prewarm: object | None = None  # the JIT registry's PrewarmReport (graphflow.engine.jit), when it prewarmed
    pool_estimate: dict[str, int] = attrs.field(factory=dict)  # per mode (graphflow.engine.memory)
    #: Per compiled segment, what torch.compile did (graphflow.engine.model.compiled), when the plan compiles any.
    compile: CompileReport | None = None
    pool_probe: dict[str, int] = attrs.field(factory=dict)  # per mode (graphflow.engine.warmup.Warmed.pool_probe_bytes)

    def phase(self, phase: Phase) -> PhaseResult:
        return next(r for r in self.phases if r.phase is phase)

    @property
    def pool_forecast(self) -> int | None:
        """The capture pool as forecast before any capture: the largest pool probe of any
        mode (the modes share the pool, and graphs captured one after
        another reuse its blocks); None where the backend cannot tell (the CPU's)."""
        return max(self.pool_probe.values(), default=None)

    @property
    def warmups_skipped(self) -> int:
        """How many descriptors went to capture without a warmup (``capture.warmup: auto``)."""
        return sum(1 for t in self.times if t.skipped and t.phase is Phase.WARMUP)


@attrs.define(eq=False)
class Held:
    """What a committed engine holds until it closes: the model, its uncompiled callables,
    and the step programs, which reach the static buffers and the graphs.

    ``release`` lets go of all of them (at ``Engine.close()``, or on a rollback before the
    caller has the engine), so that memory returns to its baseline even while the caller
    still holds the engine or an error of the run.
    """

    model: object
    segments: tuple[tuple[Segment, Callable[..., object]], ...]
    #: A lazy engine's are its ``LiveSwitch``'s: the capture thread switches them in there.
    programs: dict[Descriptor, tuple[Call, ...]]

    def release(self) -> None:
        self.model = None
        self.segments = ()
        self.programs.clear()


@attrs.frozen(eq=False)
class Engine:
    """A committed pipeline: captured graphs, static buffers, the model, and their undos.

    ``programs`` maps each captured descriptor to its step: a tuple of bare callables
    (graph replays and bound eager breaks, in order) that ``graphflow.runtime.Runner``
    runs. ``segments`` pairs each segment with the model's own callable, uncompiled even
    where the plan compiles it: the eager step (``eager_calls``, the runtime's fallback
    for a batch above every descriptor) runs the model as written, and never compiles
    at serving time. ``close()`` releases everything, as rollback would.

    A lazy engine (``RunOptions(lazy=True)``) serves while its ``background`` thread
    captures: ``live`` is what the two share (``graphflow.engine.background.LiveSwitch``),
    the only part of the engine that changes while it serves; its programs and report are
    the live switch's. None for an engine captured in the foreground.
    """

    plan: Plan
    backend: Backend
    buffers: StaticBuffers
    rank: int
    _held: Held
    _report: PipelineReport
    _stack: UndoStack
    live: LiveSwitch | None = None
    background: BackgroundCapture | None = None

    @property
    def model(self) -> object:
        return self._held.model

    @property
    def segments(self) -> tuple[tuple[Segment, Callable[..., object]], ...]:
        return self._held.segments

    @property
    def programs(self) -> dict[Descriptor, tuple[Call, ...]]:
        return self._held.programs

    @property
    def report(self) -> PipelineReport:
        """A lazy engine's grows with its capture thread's work: once the thread is done,
        it reads as a foreground run's would, with the descriptors that went live."""
        return self._report if self.live is None else self.live.report

    @property
    def descriptors(self) -> tuple[Descriptor, ...]:
        return tuple(self.programs)

    def eager_calls(self, size: int, views: dict[str, torch.Tensor] | None = None) -> tuple[Call, ...]:
        """The whole step at ``size`` as bound eager calls (on the static views by default)."""
        views = self.buffers.views(size) if views is None else views
        return tuple(bind(segment, fn, views) for segment, fn in self.segments)

    def close(self) -> None:
        """Destroy graphs, release pools and buffers, drop the model; raise if an undo failed.

        A background capture is stopped first (after the descriptor under way)."""
        if self.background is not None:
            self.background.stop()
        self._held.release()
        failures = self._stack.unwind()
        if failures is not None:
            raise failures

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def commit(ctx: Context, alloc: Allocation, captured: Captured, verified: tuple[VerifyResult, ...],
           times: tuple[DescriptorTime, ...]) -> PipelineReport:
    """The commit phase: every graph ready to replay, and the report of the run (its
    phases are added once this phase has ended, by ``graphflow.engine.pipeline``)."""
    captured.settle()
    return PipelineReport(
        backend=ctx.backend.name, captures_graphs=ctx.backend.captures_graphs, rank=ctx.rank,
        descriptors=ctx.descriptors, graphs=len(captured.graphs), phases=(), verify=verified,
        pool_bytes=alloc.pool_bytes(ctx), buffer_bytes=alloc.buffers.nbytes(),
        remapped=tuple(sorted(ctx.backend.remapped.items())), times=times,
        pool_estimate=dict(captured.pool_estimate), compile=compile_report(alloc.fns))


def publish(ctx: Context, alloc: Allocation, captured: Captured, report: PipelineReport,
            live: LiveSwitch | None = None, background: BackgroundCapture | None = None) -> Engine:
    """The committed ``Engine``, with the run's rollback stack: the engine's ``close()``
    releases exactly what rollback would have, and a rollback before the caller has the
    engine (a listener failing at PIPELINE_END) lets go of what it holds as well."""
    held = Held(alloc.model, tuple((s, alloc.uncompiled[s.name]) for s in ctx.segments),
                dict(captured.programs) if live is None else live.programs)
    ctx.stack.push("unpublish the engine", held.release)
    return Engine(ctx.plan, ctx.backend, alloc.buffers, ctx.rank, held, report, ctx.stack, live, background)
