"""A progress display for the capture pipeline: a listener that draws what the events say.

Capture is long work per descriptor (warmup, capture, verify, one descriptor after
another), so progress is per descriptor, not per phase. On a terminal a live bar shows
descriptors done of all, the descriptor and phase running now, the graphs captured,
the elapsed time, what is left and the capture pool; anywhere else (a log file, CI, a
pipe) it prints plain lines: the first descriptor's start, then a descriptor started or
captured at most once every ``interval_s`` seconds (and always the last), each with the
elapsed time and, once one is done, an estimate of what is left, so a log shows movement
without a line per graph. Work that prints nothing for ``HEARTBEAT_S`` seconds (building
a 61-layer model, one slow descriptor, a slow timing step) gets a line saying what is
still running, from a small timer thread: a new user who sees nothing for a minute
thinks it hung. ``json=True`` writes every line as one JSON object (``event``,
``phase``, ``descriptor``, ``index``, ``total``, ``elapsed_s``, ``estimate_s``,
``message``), for ``graphflow run --json``, whose stdout holds the report.

At the end, one line per mode says what was captured, the way vLLM ends its capture:
``captured 67 FULL descriptors (67 graphs) in 21.8 s, pool 0.09 GiB``, and how many went
to capture without a warmup (``capture.warmup: auto``; each one's start says so too). The timing step
after capture reports each descriptor as it is timed (``timing_begin``, ``timing``,
``timed``, ``timing_end``). ``quiet`` silences it all; ``prefix`` (``rank 1: ``) tells
ranks apart when several share one stderr; ``graphs=False`` says regions, for the CPU
backend, which captures no graph. It reads events only, and no per-segment ones.
"""

from __future__ import annotations

import json as json_module
import sys
import threading
import time
from typing import Any, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from graphflow.events import Event, EventKind, Phase
from graphflow.units import format_bytes, plural

__all__ = ["HEARTBEAT_S", "NO_GRAPH", "ProgressDisplay", "starting"]

#: Seconds of long work without a line before a line says what is still running.
HEARTBEAT_S = 5.0

#: What a timing on a backend that records no graph says beside its numbers.
NO_GRAPH = "no graph: the CPU backend replays the calls"


def starting(command: str, source: str, plan_name: str, then: str, *, json: bool = False,
             file: TextIO | None = None) -> None:
    """The first line of a command that captures: what it starts, said before the seconds
    (tens, on a busy machine) of loading torch, starting ranks and building the model, in
    which a person who sees nothing thinks it hung. Plain text whether or not stderr is a
    terminal (the live bar comes later), or one JSON line (``event: starting``)."""
    message = f"{command}: {source} ({plan_name}): {then}"
    file = file or sys.stderr
    if json:
        message = json_module.dumps({"event": "starting", "plan": plan_name, "file": source, "message": message})
    file.write(message + "\n")
    file.flush()


class _Mode:
    """What one mode's descriptors did, for its closing line."""

    __slots__ = ("descriptors", "graphs", "seconds", "skipped")

    def __init__(self) -> None:
        self.descriptors = 0
        self.graphs = 0
        self.seconds = 0.0
        self.skipped = 0  # warmups left out (capture.warmup auto)


class _Work:
    """What runs now, for the heartbeat: a phase, a descriptor and its place, and the
    clock an estimate of what is left counts from."""

    __slots__ = ("began", "descriptor", "done", "index", "phase", "total")

    def __init__(self, phase: str, total: int = 0) -> None:
        self.phase = phase
        self.descriptor: Any = None
        self.index: int | None = None
        self.total = total
        self.done = 0
        self.began = time.perf_counter()

    def estimate_s(self, now: float) -> float | None:
        if not self.done or not self.total:
            return None
        return (now - self.began) / self.done * max(self.total - self.done, 0)


class ProgressDisplay:
    """A ``Listener`` drawing the pipeline's progress on stderr (or ``file``)."""

    #: Descriptor, region and phase events are enough.
    segment_events = False

    def __init__(self, *, quiet: bool = False, file: TextIO | None = None, force_terminal: bool | None = None,
                 interval_s: float = 2.0, prefix: str = "", graphs: bool = True, json: bool = False):
        self.quiet = quiet
        self.noun = "graph" if graphs else "region"  # the CPU backend captures no graph: it replays regions
        self.json = json
        self.console = Console(file=file or sys.stderr, force_terminal=False if json else force_terminal,
                               highlight=False)
        self.interval_s = interval_s
        self.prefix = prefix
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._lock = threading.RLock()  # the pipeline, a lazy engine's capture thread and the heartbeat all draw
        self._beat: threading.Event | None = None
        self._reset()

    def _reset(self) -> None:
        self._done = 0
        self._total = 0
        self._graphs = 0
        self._pool: int | None = None
        self._began = time.perf_counter()
        self._last_line = float("-inf")
        self._modes: dict[str, _Mode] = {}
        self._started: set = set()
        self._skipped: set = set()  # descriptors whose warmup was left out
        self._ended = False
        self._work: _Work | None = None

    def on_event(self, event: Event) -> None:
        if self.quiet:
            return
        with self._lock:
            self._on_event(event)

    def _on_event(self, event: Event) -> None:
        kind = event.kind
        if kind is EventKind.PIPELINE_BEGIN:
            self._reset()
            self._total = event.total or 0
            self._work = _Work("capture", self._total)
            self._start_heartbeat()
        elif kind is EventKind.PHASE_BEGIN and event.phase is Phase.ALLOCATE:
            self._work = _Work("allocate")
            self._line("allocate: building the model, streams and static buffers", "allocate_begin", phase="allocate")
        elif kind is EventKind.PHASE_END and event.phase is Phase.ALLOCATE:
            self._line(f"allocate: done in {event.elapsed_s:.2f} s", "allocate_end", phase="allocate",
                       elapsed_s=round(event.elapsed_s, 3))
            self._work = _Work("capture", self._total)
            self._start_bar()
        elif kind is EventKind.DESCRIPTOR_BEGIN and event.descriptor is not None:
            if self._progress is None and not self._ended:  # a lazy engine's capture thread has no allocate
                self._start_bar()
            self._descriptor_begin(event)
            self._update(f"{event.descriptor} {event.phase.value if event.phase else ''}")
        elif kind is EventKind.REGION_END:
            self._graphs += 1
        elif kind is EventKind.DESCRIPTOR_END and event.descriptor is not None:
            self._descriptor_end(event)
        elif kind is EventKind.DESCRIPTOR_SKIPPED and event.descriptor is not None:
            self._modes.setdefault(event.descriptor.mode.value, _Mode()).skipped += 1
            self._skipped.add(event.descriptor)
        elif kind is EventKind.PIPELINE_END:
            self._stop()
            self._stop_heartbeat()
            self._ended = True
            for mode, done in self._modes.items():
                if not done.descriptors:  # a lazy engine's first warmup: its capture thread reports them
                    continue
                skipped = (f", {done.skipped} straight to capture without a warmup (capture.warmup auto)"
                           if done.skipped else "")
                self._line(f"captured {plural(done.descriptors, mode + ' descriptor')} "
                           f"({plural(done.graphs, self.noun)}) in {done.seconds:.1f} s"
                           f"{self._pool_text(event.pool_bytes)}{skipped}", "captured", phase="capture",
                           elapsed_s=round(done.seconds, 3))
        elif kind is EventKind.ROLLBACK:
            self._stop()
            self._stop_heartbeat()
            phase = event.phase.value if event.phase else "pipeline"
            self._line(f"{phase}: failed, rolled back ({event.error})", "rollback", phase=phase)

    def _descriptor_begin(self, event: Event) -> None:
        work = self._work if self._work is not None else _Work("capture", self._total)
        self._work = work
        work.phase = event.phase.value if event.phase else "capture"
        work.descriptor, work.index = event.descriptor, event.index
        if event.descriptor in self._started:
            return
        self._started.add(event.descriptor)
        now = time.perf_counter()
        if self._progress is None and (len(self._started) == 1 or now - self._last_line >= self.interval_s):
            skipped = ", warmup skipped" if event.descriptor in self._skipped else ""
            self._line(f"{work.phase}: {event.descriptor} started ({event.index}/{event.total}){skipped}, "
                       f"{now - self._began:.1f} s{self._left(work, now)}", "descriptor_begin",
                       **self._fields(work, now))

    def _descriptor_end(self, event: Event) -> None:
        mode = self._modes.setdefault(event.descriptor.mode.value, _Mode())
        mode.seconds += event.elapsed_s
        if event.pool_bytes is not None:
            self._pool = event.pool_bytes
        if event.phase is not Phase.CAPTURE:
            return
        mode.graphs = self._graphs - sum(m.graphs for m in self._modes.values() if m is not mode)
        self._done += 1  # captured: its graphs exist (verify, when it runs, follows)
        if self._work is not None:
            self._work.done = self._done
        mode.descriptors += 1
        self._update(str(event.descriptor))
        now = time.perf_counter()
        if self._progress is None and (now - self._last_line >= self.interval_s or self._done == self._total):
            fields = self._fields(self._work, now) if self._work is not None else {}
            fields.update(phase="capture", descriptor=str(event.descriptor), index=self._done)
            self._line(f"captured {self._done}/{self._total}: {event.descriptor}, {plural(self._graphs, self.noun)}, "
                       f"{now - self._began:.1f} s{self._pool_text(self._pool)}"
                       f"{self._left(self._work, now) if self._work is not None else ''}", "descriptor_done",
                       **fields)

    def _pool_text(self, pool: int | None) -> str:
        return f", pool {format_bytes(pool)}" if self.noun == "graph" else ""

    # -- the timing step after capture ------------------------------------------------
    def timing_begin(self, total: int, steps: int, *, eager_budget_s: float | None = None) -> None:
        """The timing step starts: ``total`` descriptors, ``steps`` steps each way (the
        eager ones within ``eager_budget_s`` seconds, when given)."""
        if self.quiet:
            return
        with self._lock:
            self._work = _Work("timing", total)
            self._began = self._work.began
            each = (f"{plural(steps, 'step')} each, eager and replayed" if eager_budget_s is None else
                    f"{plural(steps, 'replay')} each and up to {plural(steps, 'eager step')} within {eager_budget_s:g} s")
            self._line(f"timing: {plural(total, 'descriptor')}, {each}", "timing_begin", phase="timing", total=total)
            self._start_heartbeat()

    def timing(self, descriptor, index: int) -> None:
        """One descriptor's timing starts (the heartbeat names it)."""
        if self.quiet:
            return
        with self._lock:
            if self._work is not None:
                self._work.descriptor, self._work.index = descriptor, index

    def timed(self, timing, index: int) -> None:
        """One descriptor timed: its eager and replayed step, said at once."""
        if self.quiet:
            return
        with self._lock:
            work = self._work or _Work("timing")
            work.done = index
            now = time.perf_counter()
            eager, replay = timing.eager_s * 1e3, timing.replay_s * 1e3
            if self.noun == "graph":
                what = f"eager {eager:.3f} ms, graph {replay:.3f} ms" + (
                    f" ({timing.eager_s / timing.replay_s:.2f}x)" if timing.replay_s else "")
            else:
                what = f"eager {eager:.3f} ms, replay {replay:.3f} ms ({NO_GRAPH})"
            fields = self._fields(work, now)
            fields.update(descriptor=str(timing.descriptor), eager_ms=eager, replay_ms=replay,
                          eager_runs=timing.eager_runs, replay_runs=timing.replay_runs)
            self._line(f"timed {index}/{work.total}: {timing.descriptor}: {what}, {now - work.began:.1f} s"
                       f"{self._left(work, now)}", "timed", **fields)

    def timing_end(self) -> None:
        with self._lock:
            self._stop_heartbeat()
            self._work = None

    def close(self) -> None:
        """Stop the heartbeat: the command is done, whatever happened."""
        with self._lock:
            self._stop_heartbeat()

    # -- the heartbeat -----------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        if self._beat is not None:
            return
        stop = self._beat = threading.Event()
        threading.Thread(target=self._heartbeat, args=(stop,), name="graphflow-progress", daemon=True).start()

    def _stop_heartbeat(self) -> None:
        if self._beat is not None:
            self._beat.set()
            self._beat = None

    def _heartbeat(self, stop: threading.Event) -> None:
        """Polled a few times per interval, so that a line follows the last one by at most
        ``HEARTBEAT_S`` and a little, whenever the last one came."""
        while not stop.wait(HEARTBEAT_S / 5):
            with self._lock:
                now = time.perf_counter()
                if stop.is_set() or self._progress is not None or now - self._last_line < HEARTBEAT_S:
                    continue
                self._still(now)

    def _still(self, now: float) -> None:
        work = self._work
        if work is None:
            return
        fields = self._fields(work, now)
        if work.phase == "allocate":
            self._line(f"allocate: still building the model, streams and static buffers, "
                       f"{now - work.began:.1f} s", "still_running", **fields)
            return
        if work.descriptor is None:
            self._line(f"{work.phase}: still running, {now - self._began:.1f} s", "still_running", **fields)
            return
        self._line(f"{work.phase}: {work.descriptor} still running ({work.index}/{work.total}), "
                   f"{now - self._began:.1f} s{self._left(work, now)}", "still_running", **fields)

    def _fields(self, work: _Work, now: float) -> dict:
        estimate = work.estimate_s(now)
        return {"phase": work.phase, "descriptor": None if work.descriptor is None else str(work.descriptor),
                "index": work.index, "total": work.total or None,
                "elapsed_s": round(now - (work.began if work.phase in ("allocate", "timing") else self._began), 3),
                "estimate_s": None if estimate is None else round(estimate, 1)}

    @staticmethod
    def _left(work: _Work, now: float) -> str:
        estimate = work.estimate_s(now)
        return "" if estimate is None or work.done >= work.total else f", about {estimate:.0f} s left"

    # -- drawing -----------------------------------------------------------------------
    def _line(self, text: str, event: str = "", **fields) -> None:
        self._last_line = time.perf_counter()
        if self.json:
            record = {"event": event, **fields, "message": f"{self.prefix}{text}"}
            file = self.console.file
            file.write(json_module.dumps(record) + "\n")
            file.flush()
            return
        (self._progress.console if self._progress is not None else self.console).print(
            f"{self.prefix}{text}", markup=False, soft_wrap=True)

    def _start_bar(self) -> None:
        if not self.console.is_terminal or self._total == 0:
            return
        self._progress = Progress(
            TextColumn(f"{self.prefix}capture"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[now]:<24}"), TextColumn("{task.fields[graphs]} " + self.noun + "s"),
            TimeElapsedColumn(), TimeRemainingColumn(),
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
