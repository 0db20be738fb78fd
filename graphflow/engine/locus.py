"""Where the pipeline is: phase, descriptor, region, segment, as nested blocks.

A failure must name the place it happened, and only that place. A mutable cursor that
every phase updates by hand leaves a finished segment's name behind for the next error
to report. Here each place is a block, ``with locus.at(segment=...)``, that restores
the outer place when it ends; the first block an exception leaves records where it was
raised, so rollback names the innermost place even though every block has closed by the
time it runs. Listeners (the channel runtime) read ``locus.here`` instead of keeping a
copy of their own. This module imports no torch.
"""

from __future__ import annotations

from typing import Any

import attrs

from graphflow.events import Phase

__all__ = ["Locus", "Where"]


@attrs.frozen
class Where:
    """A place in the pipeline; ``listener`` names the listener being notified, if any."""

    phase: Phase | None = None
    descriptor: Any = None
    region: str | None = None
    segment: str | None = None
    listener: str | None = None


class Locus:
    """The pipeline's current place (``here``), narrowed for a block by ``at``."""

    __slots__ = ("here", "_failed")

    def __init__(self) -> None:
        self.here = Where()
        self._failed: tuple[BaseException, Where] | None = None

    def at(self, **fields: Any) -> _Block:
        """A block at ``here`` with ``fields`` replaced (``phase=`` also clears the rest)."""
        here = self.here
        if "phase" in fields:
            return _Block(self, Where(**fields))
        if "descriptor" in fields:
            return _Block(self, Where(here.phase, fields["descriptor"], fields.get("region"), fields.get("segment")))
        return _Block(self, attrs.evolve(here, **fields))

    def segment(self, name: str) -> _Block:
        """The block of one segment call (the hot path: no ``evolve``)."""
        here = self.here
        return _Block(self, Where(here.phase, here.descriptor, here.region, name))

    def failure(self, exc: BaseException) -> Where:
        """Where ``exc`` (or an exception it was raised from) left its innermost block."""
        if self._failed is not None and _chained(exc, self._failed[0]):
            return self._failed[1]
        return self.here

    def forget(self) -> None:
        """Drop the recorded failure (it holds the exception, and so its traceback)."""
        self._failed = None


class _Block:
    __slots__ = ("locus", "where", "outer")

    def __init__(self, locus: Locus, where: Where):
        self.locus = locus
        self.where = where
        self.outer = None

    def __enter__(self) -> Where:
        self.outer = self.locus.here
        self.locus.here = self.where
        return self.where

    def __exit__(self, kind, exc, tb) -> bool:
        locus = self.locus
        # Innermost first: an outer block keeps the place an inner one recorded for this
        # exception or for one it was raised from.
        if exc is not None and (locus._failed is None or not _chained(exc, locus._failed[0])):
            locus._failed = (exc, self.where)
        locus.here = self.outer
        return False


def _chained(exc: BaseException, cause: BaseException) -> bool:
    """Whether ``cause`` is ``exc`` or in the chain it was raised from (cause or context)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if exc is cause:
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False
