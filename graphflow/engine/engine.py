"""The committed result: the ``Engine`` the runtime replays, and its report.

``commit`` is the last phase: it hands the step programs, the static buffers and the
model to an ``Engine``, together with the run's rollback stack, so that closing the
engine releases exactly what rollback would have.
"""

from __future__ import annotations

from collections.abc import Callable

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

__all__ = ["Engine", "Outcome", "PhaseResult", "PipelineReport", "commit"]


@attrs.frozen
class PipelineReport:
    """What a committed pipeline did; ``graphflow run`` prints it.

    ``times`` holds each descriptor's seconds in warmup, capture and verify, with the
    capture pool's size after it when it was measured; ``prewarm`` lists the JIT
    specializations compiled, loaded and launched before capture; ``compile`` what
    ``torch.compile`` did for each compiled segment during warmup.
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

    def phase(self, phase: Phase) -> PhaseResult:
        return next(r for r in self.phases if r.phase is phase)


@attrs.define(eq=False)
class Engine:
    """A committed pipeline: captured graphs, static buffers, the model, and their undos.

    ``programs`` maps each captured descriptor to its step: a tuple of bare callables
    (graph replays and bound eager breaks, in order) that ``graphflow.runtime.Runner``
    runs. ``segments`` pairs each segment with the model's own callable, uncompiled even
    where the plan compiles it: the eager step (``eager_calls``, the runtime's fallback
    for a batch above every descriptor) runs the model as written, and never compiles
    at serving time. ``close()`` releases everything, as rollback would.
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
    #: Lazy engines only (``RunOptions(lazy=True)``): the capture thread, the lock the
    #: runtime and that thread take to run the model, and a count of programs switched in.
    background: object | None = None
    lock: object | None = None
    version: int = 0

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
        self.programs = {}
        self.model = None
        self.segments = ()
        failures = self._stack.unwind()
        if failures is not None:
            raise failures

    def _adopt(self, stack: UndoStack) -> None:
        """Take over the undos of a descriptor captured in the background."""
        self._stack.adopt(stack)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def commit(ctx: Context, alloc: Allocation, captured: Captured, verified: tuple[VerifyResult, ...],
           times: tuple[DescriptorTime, ...]) -> Engine:
    """Publish the step programs in an ``Engine``; its report's phases are added last."""
    captured.settle()
    report = PipelineReport(
        backend=ctx.backend.name, captures_graphs=ctx.backend.captures_graphs, rank=ctx.rank,
        descriptors=ctx.descriptors, graphs=len(captured.graphs), phases=(), verify=verified,
        pool_bytes=alloc.pool_bytes(ctx), buffer_bytes=alloc.buffers.nbytes(),
        remapped=tuple(sorted(ctx.backend.remapped.items())), times=times,
        pool_estimate=dict(captured.pool_estimate), compile=compile_report(alloc.fns))
    engine = Engine(ctx.plan, ctx.backend, alloc.model, alloc.buffers, dict(captured.programs),
                    tuple((s, alloc.uncompiled[s.name]) for s in ctx.segments), report, ctx.rank, ctx.stack)

    def unpublish() -> None:
        engine.programs = {}
        engine.model = None
        engine.segments = ()

    ctx.stack.push("unpublish the engine", unpublish)
    return engine
