"""A progress display for the capture pipeline: a listener that draws what the events say.

Capture is long work per descriptor (warmup, capture, verify, one descriptor after
another), so progress is per descriptor, not per phase. On a terminal a live bar shows
descriptors done of all, the descriptor and phase running now, the graphs captured,
the elapsed time and the capture pool; anywhere else (a log file, CI) it prints a plain
line when a descriptor is done, at most one every ``interval_s`` seconds (and always the
last), so a log shows movement without a line per graph. At the end, one line per mode
says what was captured, the way vLLM ends its capture: ``captured 67 FULL descriptors
(67 graphs) in 21.8 s, pool 0.09 GiB``. ``quiet`` silences it all; ``prefix`` (``rank 1:
``) tells ranks apart when several share one stderr; ``graphs=False`` says regions, for
the CPU backend, which captures no graph. It reads events only, and no
per-segment ones.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from graphflow.events import Event, EventKind, Phase
from graphflow.view.units import format_bytes, plural

__all__ = ["ProgressDisplay"]


class _Mode:
    """What one mode's descriptors did, for its closing line."""

    __slots__ = ("descriptors", "graphs", "seconds")

    def __init__(self) -> None:
        self.descriptors = 0
        self.graphs = 0
        self.seconds = 0.0


class ProgressDisplay:
    """A ``Listener`` drawing the pipeline's progress on stderr (or ``file``)."""

    #: Descriptor, region and phase events are enough.
    segment_events = False

    def __init__(self, *, quiet: bool = False, file: TextIO | None = None, force_terminal: bool | None = None,
                 interval_s: float = 2.0, prefix: str = "", graphs: bool = True):
        self.quiet = quiet
        self.noun = "graph" if graphs else "region"  # the CPU backend captures no graph: it replays regions
        self.console = Console(file=file or sys.stderr, force_terminal=force_terminal, highlight=False)
        self.interval_s = interval_s
        self.prefix = prefix
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._reset()

    def _reset(self) -> None:
        self._done = 0
        self._total = 0
        self._graphs = 0
        self._pool: int | None = None
        self._began = time.perf_counter()
        self._last_line = float("-inf")
        self._modes: dict[str, _Mode] = {}
        self._ended = False

    def on_event(self, event: Event) -> None:
        if self.quiet:
            return
        kind = event.kind
        if kind is EventKind.PIPELINE_BEGIN:
            self._reset()
            self._total = event.total or 0
        elif kind is EventKind.PHASE_BEGIN and event.phase is Phase.ALLOCATE:
            self._line("allocate: building the model, streams and static buffers")
        elif kind is EventKind.PHASE_END and event.phase is Phase.ALLOCATE:
            self._line(f"allocate: done in {event.elapsed_s:.2f} s")
            self._start_bar()
        elif kind is EventKind.DESCRIPTOR_BEGIN and event.descriptor is not None:
            if self._progress is None and not self._ended:  # a lazy engine's capture thread has no allocate
                self._start_bar()
            self._update(f"{event.descriptor} {event.phase.value if event.phase else ''}")
        elif kind is EventKind.REGION_END:
            self._graphs += 1
        elif kind is EventKind.DESCRIPTOR_END and event.descriptor is not None:
            self._descriptor_end(event)
        elif kind is EventKind.PIPELINE_END:
            self._stop()
            self._ended = True
            for mode, done in self._modes.items():
                if not done.descriptors:  # a lazy engine's first warmup: its capture thread reports them
                    continue
                self._line(f"captured {plural(done.descriptors, mode + ' descriptor')} "
                           f"({plural(done.graphs, self.noun)}) in {done.seconds:.1f} s{self._pool_text(event.pool_bytes)}")
        elif kind is EventKind.ROLLBACK:
            self._stop()
            phase = event.phase.value if event.phase else "pipeline"
            self._line(f"{phase}: failed, rolled back ({event.error})")

    def _descriptor_end(self, event: Event) -> None:
        mode = self._modes.setdefault(event.descriptor.mode.value, _Mode())
        mode.seconds += event.elapsed_s
        if event.pool_bytes is not None:
            self._pool = event.pool_bytes
        if event.phase is not Phase.CAPTURE:
            return
        mode.graphs = self._graphs - sum(m.graphs for m in self._modes.values() if m is not mode)
        self._done += 1  # captured: its graphs exist (verify, when it runs, follows)
        mode.descriptors += 1
        self._update(str(event.descriptor))
        now = time.perf_counter()
        if self._progress is None and (now - self._last_line >= self.interval_s or self._done == self._total):
            self._last_line = now
            self._line(f"captured {self._done}/{self._total}: {event.descriptor}, {plural(self._graphs, self.noun)}, "
                       f"{now - self._began:.1f} s{self._pool_text(self._pool)}")

    def _pool_text(self, pool: int | None) -> str:
        return f", pool {format_bytes(pool)}" if self.noun == "graph" else ""

    # -- drawing -----------------------------------------------------------------------
    def _line(self, text: str) -> None:
        (self._progress.console if self._progress is not None else self.console).print(
            f"{self.prefix}{text}", markup=False, soft_wrap=True)

    def _start_bar(self) -> None:
        if not self.console.is_terminal or self._total == 0:
            return
        self._progress = Progress(
            TextColumn(f"{self.prefix}capture"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[now]:<24}"), TextColumn("{task.fields[graphs]} " + self.noun + "s"),
            TimeElapsedColumn(),
            TextColumn("pool {task.fields[pool]}"), console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task("capture", total=self._total, now="", graphs=0, pool=format_bytes(None))

    def _update(self, now: str) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self._done, now=now, graphs=self._graphs,
                                  pool=format_bytes(self._pool))

    def _stop(self) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self._done, graphs=self._graphs, pool=format_bytes(self._pool))
            self._progress.stop()
            self._progress = None
            self._task = None
