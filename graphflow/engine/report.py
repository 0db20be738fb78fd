"""What a committed pipeline did: the report ``graphflow run`` prints, a lazy engine's
growing as its capture thread works."""

from __future__ import annotations

import attrs

from graphflow.engine.model.compiled import CompileReport
from graphflow.engine.phase import PhaseResult
from graphflow.engine.verify import VerifyResult
from graphflow.engine.warmup import DescriptorTime
from graphflow.events import Phase
from graphflow.plan import Descriptor

__all__ = ["PipelineReport"]


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
    #: What saving the graphs (``RunOptions.save_graphs``) or restoring them (``graphs_from``) did
    #: (``graphflow.engine.restart.run.Restart``); None when the run did neither.
    restart: object | None = None

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
