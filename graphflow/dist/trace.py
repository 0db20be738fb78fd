"""Per-rank capture traces: what each rank did, in order, and where ranks first differ.

Every phase boundary and every collective call becomes one trace event, a flat dict
with a per-rank monotonic counter ``n``. Two things consume the events:

* ``TraceLog`` keeps, per *scope* (the world, or one channel group), a running hash
  of the events so far and the last few of them. The phase barrier
  (``graphflow.dist.barrier``) compares these across ranks, so a divergence is caught at the
  next boundary and reported with the first differing event. It is always on during
  capture; it never touches a file.
* ``Tracer`` writes the events to one JSON-lines file per rank when tracing is on
  (``Tracer(dir, rank)``, ``graphflow run --trace DIR`` or ``GRAPHFLOW_TRACE=DIR``).
  When it is off, nothing is written and the runtime's hot path costs one ``None``
  check (see ``bench/trace_bench.py``).

A trace records the capture; it is no part of it. A file that cannot be written (a
full disk, a dead mount) never fails the capture: the ``Tracer`` warns once
(``TraceWriteWarning``, naming the file and the error), writes nothing more, counts the
events it lost, and at close cuts the file back to the events it last flushed whole and
ends it with one ``trace_incomplete`` record (``INCOMPLETE``: how many events were lost
and why), when the file can still be written then.

``diff_traces`` reads the files back and names the first event where ranks differ,
ignoring the fields that legitimately differ between ranks (``IGNORED_FIELDS``); an
incomplete trace is compared only as far as it was written. This module imports no
torch.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import hashlib
import json
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "CallPath",
    "IGNORED_FIELDS",
    "INCOMPLETE",
    "ScopeState",
    "TRACE_ENV",
    "TraceDiff",
    "TraceLog",
    "TraceReadError",
    "TraceWriteWarning",
    "Tracer",
    "UNKNOWN",
    "comparable",
    "describe",
    "diff_traces",
    "first_difference",
    "incomplete",
    "majority",
    "read_trace",
    "written",
]

#: The environment variable that turns tracing on: a directory for the rank files.
TRACE_ENV = "GRAPHFLOW_TRACE"

#: Fields that differ between healthy ranks: who wrote the event, when, and a p2p peer.
IGNORED_FIELDS = frozenset({"rank", "ts", "peer"})

#: The ``event`` of the record an incomplete trace ends with: ``lost`` (events not in the
#: file) and ``error`` (the OS error that stopped the writing).
INCOMPLETE = "trace_incomplete"


class TraceWriteWarning(RuntimeWarning):
    """A trace file could not be written: the capture goes on, the trace is incomplete."""


class CallPath(enum.Enum):
    """How a collective call was served (the ``path`` field of a trace event)."""

    CAPTURED = "captured"  # inside a capture region: the real collective, recorded into the graph
    EAGER_WARMUP = "eager_warmup"  # warmup with policy ``real``: the real collective, eagerly
    PREPARE = "prepare"  # warmup with policy ``prepare``: prewarm hook, no communication
    PLACEHOLDER = "placeholder"  # warmup with policy ``placeholder``: deterministic fill, no communication
    OUTSIDE_CAPTURE = "outside_capture"  # verify, after commit, or no pipeline: the real collective


def comparable(event: Mapping[str, Any]) -> dict[str, Any]:
    """The part of an event that every healthy rank agrees on."""
    return {k: v for k, v in event.items() if k not in IGNORED_FIELDS}


def _canonical(event: Mapping[str, Any]) -> bytes:
    return json.dumps(comparable(event), sort_keys=True, separators=(",", ":"), default=str).encode()


@attrs.frozen
class ScopeState:
    """One scope's agreement state: how many events, their running hash, the last few."""

    count: int
    digest: str
    window: tuple[tuple[int, dict], ...]  # (index within the scope, event)


class _Scope:
    __slots__ = ("count", "digest", "window")

    def __init__(self, window: int):
        self.count = 0
        self.digest = hashlib.blake2b(digest_size=16).hexdigest()
        self.window: collections.deque[tuple[int, dict]] = collections.deque(maxlen=window)

    def add(self, event: dict) -> None:
        h = hashlib.blake2b(self.digest.encode(), digest_size=16)
        h.update(_canonical(event))
        self.digest = h.hexdigest()
        self.window.append((self.count, event))
        self.count += 1

    def state(self) -> ScopeState:
        return ScopeState(self.count, self.digest, tuple(self.window))


class TraceLog:
    """A rank's events: numbered, hashed per scope, and written to ``sink`` if tracing.

    Scopes exist because ranks need only agree within the group that communicates:
    phase boundaries and world-group collectives go to scope ``"world"``, a collective
    on group ``tp`` to scope ``"tp"`` (and only ``tp``'s members compare it).
    """

    def __init__(self, rank: int, sink: Tracer | None = None, *, window: int = 16):
        self.rank = rank
        self.sink = sink
        self._window = window
        self._counter = 0
        self._scopes: dict[str, _Scope] = {}

    @property
    def counter(self) -> int:
        return self._counter

    def record(self, fields: Mapping[str, Any], scopes: Sequence[str] = ("world",)) -> dict:
        """Number the event, add it to each scope's hash and window, write it if tracing."""
        event = {"rank": self.rank, "n": self._counter, **fields}
        self._counter += 1
        for name in scopes:
            scope = self._scopes.get(name)
            if scope is None:
                scope = self._scopes[name] = _Scope(self._window)
            scope.add(event)
        if self.sink is not None:
            self.sink.write(event)
        return event

    def state(self, scope: str = "world") -> ScopeState:
        found = self._scopes.get(scope)
        return found.state() if found is not None else _Scope(self._window).state()


class Tracer:
    """A rank's JSON-lines trace file: one event per line, flushed at each boundary.

    ``path`` is a directory (the file is ``rank{rank}.jsonl`` in it) or, when it ends in
    ``.jsonl``, the file itself. Construction is cheap; the file opens at the first event.
    A write that fails degrades the trace instead of raising (see the module
    docstring): ``lost`` counts the events not in the file, ``error`` is the OS error.
    """

    def __init__(self, path: str | os.PathLike, rank: int = 0):
        path = Path(path)
        self.path = path if path.suffix == ".jsonl" else path / f"rank{rank}.jsonl"
        self.rank = rank
        self.lost = 0
        self.error: OSError | None = None
        self._file = None
        self._mode = "wb"  # the first open starts the file; a reopen after close appends
        self._pending = 0  # events written since the last flush that reached the file
        self._flushed = 0  # where the file ends after that flush: what a failure cuts it back to

    @classmethod
    def from_env(cls, rank: int, env: Mapping[str, str] | None = None) -> Tracer | None:
        """A tracer for ``GRAPHFLOW_TRACE=DIR``, or None when the variable is unset or empty."""
        value = (os.environ if env is None else env).get(TRACE_ENV, "")
        return cls(value, rank) if value else None

    @property
    def incomplete(self) -> bool:
        """Whether events were lost: the file does not hold the whole trace."""
        return self.error is not None

    def write(self, event: Mapping[str, Any]) -> None:
        if self.error is not None:
            self.lost += 1
            return
        line = json.dumps({**event, "ts": time.time()}, default=str) + "\n"
        self._pending += 1
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self._open()
                self._mode = "ab"
                self._flushed = self._file.tell()
            self._file.write(line.encode("utf-8"))
        except OSError as error:
            self._fail(error)

    def flush(self) -> None:
        if self._file is None:
            return
        try:
            self._file.flush()
        except OSError as error:
            self._fail(error)
            return
        self._pending = 0
        self._flushed = self._file.tell()

    def close(self) -> None:
        if self._file is not None:
            self.flush()
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as error:
                self._fail(error)
        if self.error is not None:
            self._mark_incomplete()

    def _open(self):
        return open(self.path, self._mode)

    def _fail(self, error: OSError) -> None:
        """Stop writing: the events not flushed whole are lost, and so is every later one."""
        if self.error is None:
            self.error = error
            warnings.warn(f"graphflow: cannot write trace {self.path}: {_os_error(error)}; the capture goes on, "
                          "the trace is incomplete from here", TraceWriteWarning, stacklevel=3)
        self.lost += self._pending
        self._pending = 0
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):  # its unflushed bytes are what close cuts away
                file.close()

    def _mark_incomplete(self) -> None:
        """End the file with the ``INCOMPLETE`` record right after its last whole flush,
        over whatever a failed write left there, and cut it there. Written before the cut,
        so a file that cannot take the record is never cut into a trace that looks whole."""
        record = {"rank": self.rank, "event": INCOMPLETE, "lost": self.lost, "error": _os_error(self.error),
                  "ts": time.time()}
        with contextlib.suppress(OSError), open(self.path, "r+b") as file:
            file.seek(self._flushed)
            file.write((json.dumps(record, default=str) + "\n").encode("utf-8"))
            file.flush()
            file.truncate()

    def __repr__(self) -> str:
        return f"Tracer({str(self.path)!r})"


def _os_error(error: OSError) -> str:
    return f"[Errno {error.errno}] {error.strerror}" if error.strerror else str(error)


class TraceReadError(ValueError):
    """A trace file is missing or not JSON lines; ``str()`` names file and line."""


def read_trace(path: str | os.PathLike) -> list[dict]:
    """A trace file's events, in order. Raises TraceReadError naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise TraceReadError(f"{path}: cannot read: {e.strerror or e}") from e
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceReadError(f"{path}:{number}: not a JSON trace event: {e.msg}") from e
        if not isinstance(event, dict):
            raise TraceReadError(f"{path}:{number}: not a JSON trace event: expected an object")
        events.append(event)
    return events


@attrs.frozen
class TraceDiff:
    """Where traces first differ: the event index, who differs, and what each rank had.

    ``events[i]`` is trace ``i``'s event at ``index`` (None when that trace ended
    before it); ``majority`` are the traces that agree with the most others and
    ``differing`` the rest.
    """

    index: int
    events: tuple[dict | None, ...]
    majority: tuple[int, ...]
    differing: tuple[int, ...]


#: An event a rank no longer holds (older than its published window): never compared.
UNKNOWN = object()


def majority(groups: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The largest group of ranks (or traces) that agree; ties go to the lowest member.

    Both ``trace diff`` and the phase barrier call the other groups the differing ones,
    so they always blame the same ranks.
    """
    return tuple(max(groups, key=lambda g: (len(g), -g[0])))


def first_difference(sequences: Sequence[Sequence[Mapping[str, Any] | None]], *, offset: int = 0) -> TraceDiff | None:
    """The first position where the sequences' comparable events differ, or None.

    A sequence that ends early differs from one that goes on (its event is None); an
    ``UNKNOWN`` event is left out of the comparison. ``offset`` is the index of the
    sequences' first position (a barrier compares windows, not whole traces).
    """
    length = max((len(s) for s in sequences), default=0)
    for index in range(length):
        column = [s[index] if index < len(s) else None for s in sequences]
        keys = {i: None if e is None else _canonical(e) for i, e in enumerate(column) if e is not UNKNOWN}
        if len(set(keys.values())) <= 1:
            continue
        groups: dict[bytes | None, list[int]] = {}
        for i, key in keys.items():
            groups.setdefault(key, []).append(i)
        normal = majority(list(groups.values()))
        differing = tuple(i for i in keys if i not in normal)
        return TraceDiff(offset + index, tuple(None if e is UNKNOWN else dict(e) if e is not None else None
                                               for e in column), normal, differing)
    return None


def incomplete(events: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The ``INCOMPLETE`` record a trace ends with when its tracer lost events, or None."""
    return events[-1] if events and events[-1].get("event") == INCOMPLETE else None


def written(events: Sequence[Mapping[str, Any]]) -> Sequence[Mapping[str, Any]]:
    """A trace's events without the ``INCOMPLETE`` record it may end with."""
    return events[:-1] if incomplete(events) is not None else events


def diff_traces(traces: Sequence[Sequence[Mapping[str, Any]]]) -> TraceDiff | None:
    """Compare whole per-rank traces event by event (see ``first_difference``).

    An incomplete trace stops where its file does, not where its rank did: every trace
    is compared only up to the events every incomplete one holds, so the events a
    tracer lost never read as a divergence. A complete trace that ends before that
    still differs.
    """
    horizon = min((len(t) - 1 for t in traces if incomplete(t) is not None), default=None)
    return first_difference([written(t)[:horizon] for t in traces])


def describe(event: Mapping[str, Any] | None) -> str:
    """One line for an event, the way ``trace diff`` and DivergenceError print it."""
    if event is None:
        return "(no event: the trace ends here)"
    kind = event.get("event", "?")
    parts = [f"#{event.get('n', '?')} {kind}"]
    for key in ("phase", "descriptor", "region", "segment", "channel", "op", "shape", "path", "capturing"):
        value = event.get(key)
        if value is not None:
            parts.append(f"{key}={value}")
    return " ".join(parts)
