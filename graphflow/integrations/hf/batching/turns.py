"""Steps before recordings: a lazy capture's recording gives way to the engine's steps.

The engine's steps and a lazy capture's recording are both Python driving one device from
two threads of one process. Beside a step, a recording takes about half the host from it
under the interpreter lock (an eager step of a host-bound engine then takes up to twice
as long); recorded strictly between steps, it makes the next step wait a whole forward's
recording; and one that gives way to every step as soon as it waits never ends while the
engine is busy (on the H200, no key of 32 went live in 144 back-to-back steps). So a
recording takes slices: before each module call it records, once it has run ``slice_s``
since it last began or resumed, it looks whether a step is waiting, and if one is, it
pauses until the steps waiting then have had their turn. A step then waits for one slice
and one module's recording at most; the caller sizes the slice to its steps.

A recording that wants to begin or resume lets the steps go first for one slice, then
goes before the steps that ask after that, once the step in progress ends. Waiting for a
gap between steps instead, it may never begin: a busy engine's calls come back to back
from one thread, and the interpreter lock hands over only every few milliseconds (on the
CPU, a real server's only key was never captured in 14 steps). Going first at once, it
takes the host between each of a step's calls (the engine's step is three: its batch,
its forward, its update), each time for a slice: on the H200 a step then waited up to 12
eager steps (711 ms at 64 requests) and the first tokens came 3.4 s late. With a slice
each way, a step waits one slice at most, and the recording has half the host when both
want it.

Pausing leaves the capture open while a step runs. That is safe only where nothing the
step does reaches the capture: the graph is recorded in thread-local capture mode on a
stream and pool of its own (the step's syncs and allocations are then its own), and the
step runs no random op (the device's generator counts itself inside a capture while one
is open, whichever thread draws). The caller says whether both hold (``pausing``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

__all__ = ["Turns"]


class Turns:
    """Whose turn the host is: the engine's steps, or one recording (see the module docstring)."""

    def __init__(self, slice_s: float = 0.0, clock=time.perf_counter) -> None:
        #: How long a recording runs before it gives way to a waiting step (may change
        #: while recording: the caller sizes it to the steps it serves).
        self.slice_s = slice_s
        self._clock = clock
        self._resumed = 0.0
        self._changed = threading.Condition()
        self._waiting = 0  # steps that asked for their turn and have not had it yet
        self._stepping = 0  # steps in progress
        self._wanting = 0  # recordings that want to begin or resume, ahead of steps asking now
        self._recording = False  # a recording runs (not paused)
        self._recorder: int | None = None  # the recording thread, while one records with pauses
        #: How many times recordings paused for a step, over this object's life.
        self.pauses = 0

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One of the engine's calls: waits for a running recording's next module call
        (or, for one recorded without pauses, its end)."""
        with self._changed:
            self._waiting += 1
            while self._recording or self._wanting:
                self._changed.wait()
            self._waiting -= 1
            self._stepping += 1
        try:
            yield
        finally:
            with self._changed:
                self._stepping -= 1
                self._changed.notify_all()

    @contextlib.contextmanager
    def recording(self, *, pausing: bool) -> Iterator[None]:
        """One graph's recording, begun after the steps have had one slice (``_take_turn``);
        with ``pausing``, after each slice it gives way at its next module call to the
        steps waiting then, and resumes as it began."""
        with self._changed:
            self._take_turn()
        hook = torch.nn.modules.module.register_module_forward_pre_hook(self._pause) if pausing else None
        self._resumed = self._clock()
        self._recorder = threading.get_ident() if pausing else None
        try:
            yield
        finally:
            self._recorder = None
            if hook is not None:
                hook.remove()
            with self._changed:
                self._recording = False
                self._changed.notify_all()

    def _pause(self, module, args) -> None:
        """A module pre-hook on every module of the process while a recording pauses:
        it acts only on the recording thread, once the slice is run, and only when a step waits."""
        if (threading.get_ident() != self._recorder or not self._waiting
                or self._clock() - self._resumed < self.slice_s):
            return
        with self._changed:
            self._recording = False
            self._changed.notify_all()
            while self._waiting:  # the steps waiting now take their turn
                self._changed.wait()
            self._take_turn()
            self.pauses += 1
        self._resumed = self._clock()

    def _take_turn(self) -> None:
        """The recording's turn: steps in progress or waiting go first for one slice; then
        steps that ask wait for it, and it begins once the step in progress has ended."""
        asked = self._clock()
        while self._stepping or self._waiting:
            left = self.slice_s - (self._clock() - asked)
            if left <= 0:
                break
            self._changed.wait(left)
        self._wanting += 1
        while self._stepping:
            self._changed.wait()
        self._wanting -= 1
        self._recording = True
