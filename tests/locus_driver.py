"""Moving an engine ``Locus`` by hand, as the pipeline does, for tests of its listeners.

The channel runtime and the JIT registry read where the pipeline is from the engine's
locus, not from events; a test that drives them without a pipeline moves a locus the
way the pipeline does and hands it over with PIPELINE_BEGIN.
"""

from __future__ import annotations

import attrs

from graphflow.engine.locus import Locus, Where
from graphflow.events import Event, EventKind


class LocusDriver:
    """``event(kind, **fields)``: the event the pipeline would emit, with the locus moved."""

    def __init__(self) -> None:
        self.locus = Locus()

    def event(self, kind: EventKind, **fields) -> Event:
        here = self.locus.here
        if kind is EventKind.PHASE_BEGIN:
            here = Where(fields["phase"])
        elif kind is EventKind.DESCRIPTOR_BEGIN:
            here = Where(here.phase, fields.get("descriptor"))
        elif kind is EventKind.REGION_BEGIN:
            here = attrs.evolve(here, region=fields.get("region"))
        elif kind is EventKind.SEGMENT_BEGIN:
            here = attrs.evolve(here, segment=fields.get("segment"))
        self.locus.here = here
        return Event(kind, locus=self.locus, **fields)

    def after(self, kind: EventKind) -> None:
        """Close the block an END event ends (the pipeline leaves it after notifying)."""
        here = self.locus.here
        if kind is EventKind.SEGMENT_END:
            self.locus.here = attrs.evolve(here, segment=None)
        elif kind is EventKind.REGION_END:
            self.locus.here = attrs.evolve(here, region=None)
        elif kind is EventKind.DESCRIPTOR_END:
            self.locus.here = Where(here.phase)
        elif kind in (EventKind.PHASE_END, EventKind.PIPELINE_END, EventKind.ROLLBACK):
            self.locus.here = Where()
