"""A progress display for the capture pipeline: a listener that draws what the events say.

On a terminal it shows a live bar per phase (descriptor i of N, elapsed time, pool
memory) with rich; anywhere else (a log file, CI) it prints one plain line per finished
phase, so logs stay readable. ``quiet`` silences it entirely. It reads events only, so
it knows nothing of the engine, and costs nothing between events.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from graphflow.events import Event, EventKind
from graphflow.render import format_bytes

__all__ = ["ProgressDisplay"]


class ProgressDisplay:
    """A ``Listener`` drawing the pipeline's progress on stderr (or ``file``)."""

    def __init__(self, *, quiet: bool = False, file: TextIO | None = None, force_terminal: bool | None = None):
        self.quiet = quiet
        self.console = Console(file=file or sys.stderr, force_terminal=force_terminal)
        self._progress: Progress | None = None
        self._task: TaskID | None = None

    def on_event(self, event: Event) -> None:
        if self.quiet:
            return
        kind = event.kind
        if kind is EventKind.PHASE_BEGIN:
            self._begin(event)
        elif kind is EventKind.DESCRIPTOR_END and self._progress is not None:
            self._progress.update(self._task, completed=event.index, pool=_pool(event), descriptor=str(event.descriptor))
        elif kind is EventKind.PHASE_END:
            self._end(event)
        elif kind in (EventKind.ROLLBACK, EventKind.PIPELINE_END):
            self._stop()
            if kind is EventKind.ROLLBACK:
                phase = event.phase.value if event.phase else "pipeline"
                self.console.print(f"{phase}: failed, rolled back ({event.error})", markup=False, highlight=False,
                                   soft_wrap=True)

    def _begin(self, event: Event) -> None:
        if not self.console.is_terminal:
            return
        self._stop()
        self._progress = Progress(
            TextColumn("{task.description:<9}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[descriptor]}"),
            TimeElapsedColumn(), TextColumn("pool {task.fields[pool]}"), console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(event.phase.value, total=event.total or 0, pool=_pool(event), descriptor="")

    def _end(self, event: Event) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=event.total or 0, pool=_pool(event))
            self._stop()
            return
        self.console.print(f"{event.phase.value:<9} done in {event.elapsed_s:.3f} s"
                           + (f", pool {format_bytes(event.pool_bytes)}" if event.pool_bytes else ""),
                           markup=False, highlight=False, soft_wrap=True)

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._task = None


def _pool(event: Event) -> str:
    return format_bytes(event.pool_bytes)
