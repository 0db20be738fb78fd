"""Lazy capture: one thread records graphs while a server steps, for every integration.

A server that turns lazy capture on answers at once: a step whose graph is not live yet
runs eagerly, and a thread of the process records the graphs one key at a time (a
descriptor of a graphflow engine, a key of transformers' continuous batching). What
differs between integrations is only how one key is captured and how it goes live
(``Capturer``); ``LazyCapture`` is everything else, written once:

* **Order.** ``first``, before the thread lets the server step (``start`` returns after
  it: the engine's largest descriptor, so that every batch replays a graph, padded up,
  from the first step on, and no step runs eagerly beside a recording: eager steps beside
  the first recording of the 61-layer FULL plan took up to 1.88x an eager step of their
  size on the H100); then the key that serves the first step asked for; then the keys
  steps asked for, most asked first, first asked on ties; then, with ``ahead``, the rest
  in the integration's order, but for the keys ``on_demand`` names: those are captured
  only once a step asks for them (speed-ups most of which a workload may never reach
  are not recorded beside steps that wait for the GPU). Without ``ahead`` (a plan too
  large to capture whole) the thread waits for steps to ask.
* **Turns with the steps** (``graphflow.engine.turns``): a recording and a step never run
  at once. A recording gives way to a waiting step at its next pause point once it has
  run its slice (the integration sizes the slice to its eager steps); a turn that must
  not be interleaved (a warm run on the server's buffers) does not pause.
* **Retries.** A key whose capture fails is tried again later, up to ``tries`` times in
  all, each later try whole (no pause with its capture open), in case a step's work
  beside the paused capture broke it. Then it fails for good: its steps run on a larger
  key or eagerly, and ``failures`` says why, as a ``CaptureError``.
* **States** (``KeyState``): planned, captured (its first step checks it against the
  eager step), live, failed; written here and by the integration's first-use check
  (``checked``), nowhere else, but for the keys an integration settled before the thread
  starts (``settled``: a foreground capture's verdicts), which the thread leaves alone.

What may overlap, and why it is safe:

* A step and a recording's host work never overlap (``Turns``). Two threads that both
  drive the one caching allocator of a device, one of them inside a capture, broke every
  lazy capture of a 61-layer engine on the H100 and the H200 (captures invalidated, the
  allocator's pool accounting asserting, the serving thread's eager step refused as
  "not permitted when stream is capturing", the process aborted).
* A step may run while a recording is paused with its capture open: the capture is in
  thread-local mode (``capture_error_mode="thread_local"``: only the recording thread is
  refused what a capture forbids), on streams and a pool the steps never use, so the
  step's allocations, syncs and launches are its own. The step must not draw random
  numbers on the device (the device's generator counts itself inside a capture while one
  is open, whichever thread draws): an integration whose steps may says so
  (``pausing=False``), and its recordings run whole between two steps.
* Instantiating a recorded graph (``cudaGraphInstantiate``) runs beside the steps: it is
  outside any capture and touches nothing a step uses.
* Nothing here synchronizes the whole device while a capture may be open, and nothing
  releases a pool but the capture thread (emptying the allocator's cache is refused
  while a capture is open): a rejected graph's undo is queued for the thread.

The thread runs without autograd (grad mode is per thread), on its own current stream
(also per thread), and starts no capture until the caller's first step has been served
or ``first_step_s`` has passed.
"""

from __future__ import annotations

import contextlib
import enum
import threading
import time
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

import torch

from graphflow.engine.turns import Turns
from graphflow.errors import CaptureError

__all__ = ["TRIES", "Capturer", "KeyState", "LazyCapture"]

#: A key's capture is tried this many times before its steps go eager for good.
TRIES = 3

K = TypeVar("K", bound=Hashable)


class KeyState(enum.StrEnum):
    """Where a key of a lazy capture stands."""

    PLANNED = "planned"  # in the plan, not captured yet
    CAPTURED = "captured"  # captured, not yet checked against the eager step on its first batch
    LIVE = "live"  # steps replay it
    FAILED = "failed"  # its capture or its check failed for good: its steps go to a larger key or eagerly
    UNPLANNED = "unplanned"  # asked for by a step, not in the plan


class Capturer(Protocol[K]):
    """What an integration gives the core: how to capture one key and switch it in."""

    def prepare(self) -> None:
        """Once, on the capture thread, before its first capture (libraries that keep
        per-thread state made at a first call: cuBLAS's handle, cuDNN's plans)."""

    def capture(self, key: K, turns: Turns, pausing: bool) -> None:
        """Record ``key``'s graphs, taking ``turns.recording(pausing=...)`` for the
        recording (and, where the integration can, calling ``turns.pause`` between the
        pieces it records); switch them in and say so (``LazyCapture.captured``). Raises
        on failure, having undone nothing: ``undo`` follows."""

    def undo(self, key: K, error: BaseException, final: bool) -> CaptureError:
        """Undo what a failed ``capture`` of ``key`` left (its graphs, a pool no capture
        can use again) and say why, as a ``CaptureError`` naming the key; ``final``: no
        try is left."""

    def finish(self) -> None:
        """Once, on the capture thread, after its last capture (or when stopped)."""


class LazyCapture(Generic[K]):
    """The capture thread of a lazy engine or server (see the module docstring)."""

    def __init__(self, capturer: Capturer[K], keys: Sequence[K], *, turns: Turns, first: K | None = None,
                 ahead: bool = True, on_demand: Collection[K] = (), pausing: bool = True, tries: int = TRIES,
                 first_step_s: float | None = None,
                 settled: Mapping[K, KeyState] | None = None, name: str = "graphflow-lazy-capture") -> None:
        self.capturer = capturer
        self.turns = turns
        self.states: dict[K, KeyState] = dict.fromkeys(keys, KeyState.PLANNED)
        self.states.update(settled or {})
        self.failures: dict[K, CaptureError] = {}
        #: Keys whose capture failed at least once, and how many times.
        self.tries: dict[K, int] = {}
        self._plan = list(keys)
        self._before_ready, self._ahead, self._pausing, self._most = first, ahead, pausing, tries
        self._on_demand = frozenset(on_demand)
        self._recording = False  # a key's capture is under way
        #: When the thread first had nothing left to capture unless a step asks.
        self.caught_up_at: float | None = None
        self._first_step_s = first_step_s
        self._asked: dict[K, int] = {}  # first asked first
        self._first: K | None = None
        self._stepped = False
        self._stopping = False
        self._changed = threading.Condition()
        #: Keys whose first-use check failed, their undo still to run on the thread.
        self._rejected: list[tuple[K, BaseException]] = []
        self._ended = False  # the thread captures nothing more: a rejected key is undone where it is rejected
        self._undoing = threading.Lock()
        self._name = name
        self._thread: threading.Thread | None = None
        self._prepared = threading.Event()
        self._prepare_error: BaseException | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    # -- what the serving side says --------------------------------------------------------
    def ask(self, key: K | None) -> None:
        """A step wanted ``key``'s graph (None: a step that no key serves). The first call
        also lets the thread begin."""
        if self._ended:  # nothing more is captured: a step's cost stays a flag read
            return
        with self._changed:
            counted = key is not None and self.states.get(key) in (KeyState.PLANNED, None)
            if counted:
                if key not in self.states:
                    self.states[key] = KeyState.UNPLANNED
                self._asked[key] = self._asked.get(key, 0) + 1
                if self._first is None:
                    self._first = key
            if counted or not self._stepped:  # the thread wakes only when its order may change
                self._stepped = True
                self._changed.notify_all()

    def checked(self, key: K, error: BaseException | None) -> None:
        """A captured key's first batch compared its replay with the eager step: live, or
        (``error``) failed for good, its undo queued for the capture thread."""
        with self._changed:
            if error is None:
                self.states[key] = KeyState.LIVE
                return
            self.states[key] = KeyState.FAILED
            self.failures[key] = error if isinstance(error, CaptureError) else CaptureError(str(error))
            self._rejected.append((key, error))
            self._changed.notify_all()
            ended = self._ended
        if ended:  # no capture can be open any more: undone here, at once
            with self._undoing:
                self._undo_rejected(in_step=True)

    # -- what the capturer says ----------------------------------------------------------
    def captured(self, key: K, *, checked: bool) -> None:
        """``key``'s graphs are switched in: live, or waiting for their first batch's check."""
        with self._changed:
            self.states[key] = KeyState.LIVE if checked else KeyState.CAPTURED

    # -- the thread's life ---------------------------------------------------------------
    def start(self) -> None:
        """Start the thread and wait for its ``Capturer.prepare`` and the capture of
        ``first``; raise what ``prepare`` raised (the thread has then ended). A failed
        capture of ``first`` is tried again later, as any key's."""
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._prepared.wait()
        if self._prepare_error is not None:
            self._thread.join()
            raise self._prepare_error

    @property
    def done(self) -> bool:
        return self.finished_at is not None

    @property
    def busy(self) -> bool:
        """Whether the thread is recording a key or has one to record now (one asked for,
        or, with ``ahead``, one not on demand): what a step leaves host work to."""
        with self._changed:
            return not self.done and not self._stopping and (self._recording or self._next() is not None)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every key is captured or failed, but those captured only once asked
        for (``on_demand``) that no step asked for yet (without ``ahead``: until stopped);
        False on timeout."""
        if self._thread is None:
            return True
        with self._changed:
            return self._changed.wait_for(lambda: self.done or self._caught_up(), timeout)

    def _caught_up(self) -> bool:
        """Under ``_changed``: nothing left to capture unless a step asks for it."""
        return self.caught_up_at is not None and not self._recording and self._next() is None

    def stop(self) -> None:
        """Capture nothing more; returns once the key under way is done and the thread
        has finished."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- on the thread -------------------------------------------------------------------
    def _run(self) -> None:
        # Grad mode is per thread: the caller's ``no_grad`` does not reach this one, and
        # a capture with autograd on keeps every activation of an in-place write alive.
        with torch.no_grad():
            try:
                self.capturer.prepare()
            except BaseException as exc:  # noqa: BLE001 - raised by ``start`` on the caller's thread
                self._prepare_error = exc
                self._prepared.set()
                self.finished_at = time.perf_counter()
                return
            try:
                try:
                    if self._before_ready is not None and self.states.get(self._before_ready) is KeyState.PLANNED:
                        self._one(self._before_ready)
                finally:
                    self._prepared.set()
                self._loop()
            finally:
                with self._changed:
                    self._ended = True
                with self._undoing:
                    try:
                        self._undo_rejected()
                    finally:
                        self.capturer.finish()
                        with self._changed:
                            self.finished_at = time.perf_counter()
                            self._changed.notify_all()

    def _loop(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._stepped or self._stopping, timeout=self._first_step_s)
        while True:
            self._undo_rejected()
            with self._changed:
                key = self._next()
                # The keys only steps' asks bring (every key without ``ahead``): wait for one.
                while key is None and self._asks_to_come() and not self._stopping and not self._rejected:
                    if self.caught_up_at is None and self._ahead:
                        self.caught_up_at = time.perf_counter()
                    self._changed.notify_all()
                    self._changed.wait()
                    key = self._next()
                if self._stopping or (key is None and not self._asks_to_come()):
                    return
                self._recording = key is not None
            if key is not None:
                try:
                    self._one(key)
                finally:
                    with self._changed:
                        self._recording = False
                        self._changed.notify_all()

    def _asks_to_come(self) -> bool:
        """Under ``_changed``: whether a step's ask may still bring a key to capture."""
        return not self._ahead or any(self.states[k] is KeyState.PLANNED for k in self._on_demand)

    def _next(self) -> K | None:
        """The next key to capture (see the module docstring), under ``_changed``."""
        open_ = [k for k in self._plan if self.states[k] is KeyState.PLANNED]
        if not open_:
            return None
        waiting = set(open_)
        # sorted is stable: most asked first, first asked on ties.
        asked = sorted((k for k in self._asked if k in waiting), key=lambda k: -self._asked[k])
        first = (self._first,) if self._first in waiting else ()
        chosen = (*first, *asked)
        if chosen:
            return chosen[0]
        return next((k for k in open_ if k not in self._on_demand), None) if self._ahead else None

    def _one(self, key: K) -> None:
        tries = self.tries.get(key, 0)
        try:
            self.capturer.capture(key, self.turns, pausing=self._pausing and tries == 0)
        except Exception as exc:  # noqa: BLE001 - the key is rolled back alone; serving goes on
            tries = self.tries[key] = tries + 1
            final = tries >= self._most
            with self.turns.recording(pausing=False):  # pools may be released: no step meanwhile
                error = self.capturer.undo(key, exc, final)
            with self._changed:
                if final:
                    self.states[key] = KeyState.FAILED
                    self.failures[key] = error
                else:
                    self._asked.setdefault(key, 0)  # again soon, whole between two steps

    def _undo_rejected(self, *, in_step: bool = False) -> None:
        """The undos of keys their first batch rejected: on the thread, in a turn of their
        own; once the thread has ended, in the step that rejected them (``in_step``)."""
        with self._changed:
            rejected, self._rejected = self._rejected, []
        for key, error in rejected:
            with contextlib.nullcontext() if in_step else self.turns.recording(pausing=False):
                self.capturer.undo(key, error, True)
