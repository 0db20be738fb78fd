"""Events the capture pipeline emits, and the listener protocol that consumes them.

The engine emits one event at every pipeline, phase, descriptor and region boundary,
and around every segment call of warmup, capture and verify (``SEGMENT_BEGIN/END``,
only when someone listens). Listeners drive the progress display, the per-rank trace
and the cross-rank phase barriers: each reads the same events, so none needs to reach
into the engine. A listener that raises fails the pipeline, which then rolls back like
any other failure. This module imports no torch.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Protocol

import attrs

__all__ = ["EventKind", "Event", "Listener", "Phase"]


class Phase(enum.StrEnum):
    """The pipeline's phases, in the order they run (see ``graphflow.engine``).

    A ``str`` too, equal to its value and printed as it: an error's phase reads, compares
    and serializes (JSON, the CLI's report) as the name a user sees, ``warmup``.
    """

    ALLOCATE = "allocate"
    WARMUP = "warmup"
    PREWARM = "prewarm"
    CAPTURE = "capture"
    VERIFY = "verify"
    COMMIT = "commit"
    ROLLBACK = "rollback"


class EventKind(enum.Enum):
    PIPELINE_BEGIN = "pipeline_begin"
    PHASE_BEGIN = "phase_begin"
    DESCRIPTOR_BEGIN = "descriptor_begin"
    REGION_BEGIN = "region_begin"
    SEGMENT_BEGIN = "segment_begin"
    SEGMENT_END = "segment_end"
    REGION_END = "region_end"
    DESCRIPTOR_END = "descriptor_end"
    #: A descriptor a phase left out (its warmup, under ``capture.warmup: auto``): said,
    #: so that progress and reports show no silent gap.
    DESCRIPTOR_SKIPPED = "descriptor_skipped"
    PHASE_END = "phase_end"
    PIPELINE_END = "pipeline_end"
    ROLLBACK = "rollback"


@attrs.frozen
class Event:
    """One boundary. ``descriptor``, ``region`` and ``segment`` are set where they apply.

    ``segment`` names the segment a ``SEGMENT_BEGIN/END`` brackets, so a listener (the
    channel trace) knows which segment is running without guessing from the region.

    ``index``/``total`` count descriptors within a phase (for progress);
    ``elapsed_s`` is seconds since the phase began; ``pool_bytes`` is the capture pool's
    size when known. ``defer`` registers an undo on the pipeline's rollback stack: a
    listener that takes a resource at an event gives it back through it. ``locus`` is
    the pipeline's place (``graphflow.engine.locus.Locus``): a listener that needs to
    know where the pipeline is between events (the channel runtime, inside a segment)
    reads ``locus.here`` instead of keeping a copy.
    """

    kind: EventKind
    rank: int = 0
    phase: Phase | None = None
    descriptor: Any = None
    region: str | None = None
    segment: str | None = None
    index: int | None = None
    total: int | None = None
    elapsed_s: float = 0.0
    pool_bytes: int | None = None
    error: str | None = None
    defer: Callable[[str, Callable[[], None]], None] | None = attrs.field(default=None, eq=False, repr=False)
    locus: Any = attrs.field(default=None, eq=False, repr=False)


class Listener(Protocol):
    def on_event(self, event: Event) -> None: ...
