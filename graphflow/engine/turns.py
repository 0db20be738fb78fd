"""Steps before recordings: a lazy capture's recording gives way to the server's steps.

A server's steps and a lazy capture's recording are both Python driving one device from
two threads of one process, and they never run at once: a step runs only while no
recording runs, and a recording only while no step does (what may overlap, and why, is
in ``graphflow.engine.lazy``). Beside a step, a recording takes about half the host from it
under the interpreter lock (an eager step of a host-bound engine then takes up to twice
as long); recorded strictly between steps, it makes the next step wait a whole forward's
recording; and one that gives way to every step as soon as it waits never ends while the
engine is busy (on the H200, no key of 32 went live in 144 back-to-back steps). So a
recording takes slices: at each of its pause points (``pause``: the engine calls it
between the segments it records; with ``hook_modules``, every module call of the
recording thread is one), once it has run ``slice_s`` since it last began or resumed, it
looks whether a step is waiting, and if one is, it pauses until the steps waiting then
have had their turn. A step then waits for one slice
and one segment's or module's recording at most; the caller sizes the slice to its steps.

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
A turn that does not pause is the way to run anything else beside the steps that must
not interleave with them (a warm run on the server's buffers).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

__all__ = ["SLICE_OF_EAGER", "Turns"]

#: A recording runs this share of the server's eager step (its recent ones, averaged:
#: ``eager_took``) before it gives way to a waiting step: a step beside the recordings
#: then waits that long at most, and takes under 1.5x an eager step.
SLICE_OF_EAGER = 0.4


class Turns:
    """Whose turn the host is: the engine's steps, or one recording (see the module docstring)."""

    def __init__(self, slice_s: float = 0.0, clock=time.perf_counter) -> None:
        #: How long a recording runs before it gives way to a waiting step (may change
        #: while recording: ``eager_took`` sizes it to the steps served).
        self.slice_s = slice_s
        self._clock = clock
        self._eager_s: float | None = None
        self._resumed = 0.0
        self._changed = threading.Condition()
        self._waiting = 0  # steps that asked for their turn and have not had it yet
        self._stepping = 0  # steps in progress
        self._wanting = 0  # recordings that want to begin or resume, ahead of steps asking now
        self._recording = False  # a recording runs (not paused)
        self._recorder: int | None = None  # the recording thread, while one records with pauses
        #: How many times recordings paused for a step, over this object's life.
        self.pauses = 0

    def eager_took(self, seconds: float) -> None:
        """A step the server ran eagerly took ``seconds`` of the host: the slice follows
        the eager steps' recent average."""
        self._eager_s = seconds if self._eager_s is None else 0.8 * self._eager_s + 0.2 * seconds
        self.slice_s = SLICE_OF_EAGER * self._eager_s

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
    def recording(self, *, pausing: bool, hook_modules: bool = True) -> Iterator[None]:
        """One graph's recording (or any turn that must not interleave with the steps),
        begun after the steps have had one slice (``_take_turn``); with ``pausing``, after
        each slice it gives way at its next pause point to the steps waiting then, and
        resumes as it began. ``hook_modules``: every module call of this thread is a pause
        point (for a caller that cannot call ``pause`` itself)."""
        with self._changed:
            self._take_turn()
        hook = (torch.nn.modules.module.register_module_forward_pre_hook(self._module_call)
                if pausing and hook_modules else None)
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

    def _module_call(self, module, args) -> None:
        """A module pre-hook on every module of the process while a recording pauses."""
        self.pause()

    def pause(self) -> None:
        """A pause point of a recording that pauses: it acts only on the recording thread,
        once the slice is run, and only when a step waits."""
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
