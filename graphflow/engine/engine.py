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

import functools
from collections.abc import Callable

import attrs
import torch

from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Backend, Call
from graphflow.engine.background import BackgroundCapture, LiveSwitch
from graphflow.engine.buffers import StaticBuffers
from graphflow.engine.capture import Captured
from graphflow.engine.model.compiled import compile_report
from graphflow.engine.context import Context
from graphflow.engine.execute import bind
from graphflow.engine.first_use import Checks, FirstUse
from graphflow.engine.options import Verify
from graphflow.engine.phase import Outcome, PhaseResult
from graphflow.engine.report import PipelineReport
from graphflow.engine.rollback import UndoStack
from graphflow.engine.verify import VerifyResult
from graphflow.engine.warmup import DescriptorTime
from graphflow.errors import CaptureError
from graphflow.plan import Descriptor, Plan, Segment


__all__ = ["Engine", "Held", "Outcome", "PhaseResult", "PipelineReport", "commit", "publish"]


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
    #: The descriptors verify did not check before ready, each checked on its first batch
    #: (``graphflow.engine.first_use``); None with ``RunOptions(verify=False)``.
    first_use: FirstUse | None = None

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

    @property
    def checks(self) -> Checks:
        """How many descriptors were checked against the eager step before ready, and how
        many on their first batch since (a lazy engine checks none before ready)."""
        before = 0 if self.live is not None else len(self._report.verify)
        if self.first_use is None:
            return Checks(before, 0, 0, 0)
        return self.first_use.counts(before)

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
    engine (a listener failing at PIPELINE_END) lets go of what it holds as well.

    A foreground engine checks on their first batch the descriptors verify left out
    (``graphflow.engine.first_use``); one found wrong there is taken out of ``programs``
    and its graphs destroyed. A lazy engine's checks are its live switch's."""
    segments = tuple((s, alloc.uncompiled[s.name]) for s in ctx.segments)
    held = Held(alloc.model, segments, dict(captured.programs) if live is None else live.programs)
    ctx.stack.push("unpublish the engine", held.release)
    first_use = live.first_use if live is not None else None
    if live is None and ctx.options.verify is not Verify.OFF:
        verified = {r.descriptor for r in report.verify}
        first_use = FirstUse(ctx.plan, ctx.verify_plan, alloc.buffers, segments,
                             unchecked=[d for d in held.programs if d not in verified],
                             verdict=functools.partial(_rejected, held.programs, captured.graphs_of))
        ctx.stack.push("drop the first-use checks", first_use.release)
    return Engine(ctx.plan, ctx.backend, alloc.buffers, ctx.rank, held, report, ctx.stack, live, background,
                  first_use)


def _rejected(programs: dict, graphs_of: dict, descriptor: Descriptor, error: CaptureError | None) -> None:
    """A foreground descriptor its first batch found wrong: out of service, its graphs
    destroyed (the run's rollback stack destroys each graph once more at close, which is
    safe)."""
    if error is None:
        return
    programs.pop(descriptor, None)
    for graph in graphs_of.pop(descriptor, ()):
        graph.destroy()
