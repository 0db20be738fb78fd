"""Turns: a lazy recording gives way to the engine's steps at module calls (CPU, threads).

The order of events is forced with events, not timing: the recording thread lets a step
start, waits until that step is waiting for its turn, and then makes its next module call.
"""

from __future__ import annotations

import threading

import pytest
import torch

from graphflow.engine.turns import Turns

LAYERS = 6


class _Recorded(torch.nn.Module):
    """A stand-in for a forward being recorded: its layers log their calls; after layer
    ``ask_after`` it asks the step thread to begin and waits until that step waits."""

    def __init__(self, log: list, turns: Turns, go: threading.Event, ask_after: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(LAYERS))
        self.log, self.turns, self.go, self.ask_after = log, turns, go, ask_after

    def forward(self, x):
        for index, layer in enumerate(self.layers):
            x = layer(x)
            self.log.append(f"r{index}")
            if index == self.ask_after:
                self.go.set()
                while not self.turns._waiting:
                    threading.Event().wait(0.001)
        return x


def _together(*targets) -> None:
    threads = [threading.Thread(target=target) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "the step and the recording deadlocked"


def _run(pausing: bool, slice_ticks: int = 0) -> tuple[list, Turns]:
    """A recording and a step that asks after layer 1; with ``slice_ticks``, the clock
    advances one tick per recorded layer and the slice is that many ticks."""
    ticks = [0]
    turns, log, go = Turns(slice_s=slice_ticks, clock=lambda: ticks[0]), [], threading.Event()
    model = _Recorded(log, turns, go, ask_after=1)
    for layer in model.layers:
        layer.register_forward_hook(lambda *_: ticks.__setitem__(0, ticks[0] + 1))

    def record() -> None:
        with turns.recording(pausing=pausing):
            model(torch.zeros(1))

    def step() -> None:
        go.wait()
        with turns.step():
            torch.nn.Identity()(torch.zeros(1))  # a module call of the step's own: never a pause
            log.append("step")

    _together(record, step)
    return log, turns


def test_a_pausing_recording_lets_a_waiting_step_in_at_its_next_module_call():
    log, turns = _run(pausing=True)
    assert log == ["r0", "r1", "step", *(f"r{i}" for i in range(2, LAYERS))]
    assert turns.pauses == 1


def test_a_whole_recording_makes_the_step_wait_for_its_end():
    log, turns = _run(pausing=False)
    assert log == [*(f"r{i}" for i in range(LAYERS)), "step"]
    assert turns.pauses == 0


def test_a_recording_gives_way_only_once_it_has_run_its_slice():
    """The clock advances one tick per recorded layer: with a slice of three ticks, the
    step that waits from layer 1 on gets in at the first module call three ticks after
    the recording began, not before."""
    log, turns = _run(pausing=True, slice_ticks=3)
    assert log == ["r0", "r1", "r2", "step", *(f"r{i}" for i in range(3, LAYERS))]
    assert turns.pauses == 1


def test_a_recording_begins_only_after_the_step_in_progress():
    turns, log = Turns(), []
    stepping, recorded = threading.Event(), threading.Event()

    def record() -> None:
        stepping.wait()
        with turns.recording(pausing=True):
            log.append("recording")
        recorded.set()

    thread = threading.Thread(target=record)
    thread.start()
    with turns.step():
        stepping.set()
        assert not recorded.wait(0.2)
        log.append("step")
    thread.join(30)
    assert log == ["step", "recording"]


def _busy(turns: Turns, step_done=lambda: None) -> dict:
    """Two threads step so that one is always in progress (a busy engine's calls, back to
    back, leave no gap a recording could wait for; ``step_done`` runs at the end of each
    step) while a third records once, whole; the clock when it asked and when it began."""
    stop, began = threading.Event(), threading.Event()
    gates = [threading.Semaphore(1), threading.Semaphore(0)]
    times: dict = {}

    def stepping(me: int) -> None:
        other = 1 - me
        while not stop.is_set():
            if not gates[me].acquire(timeout=0.05):
                continue
            with turns.step():  # half way through, the other thread's step begins
                threading.Event().wait(0.003)
                gates[other].release()
                threading.Event().wait(0.003)
                step_done()

    def record() -> None:
        began.wait()
        times["asked"] = turns._clock()
        with turns.recording(pausing=False):
            times["began"] = turns._clock()
        stop.set()

    steppers = [threading.Thread(target=stepping, args=(i,)) for i in (0, 1)]
    recorder = threading.Thread(target=record, daemon=True)
    for thread in (*steppers, recorder):
        thread.start()
    threading.Event().wait(0.05)
    began.set()
    recorder.join(30)
    stop.set()
    for thread in steppers:
        thread.join(30)
    assert not recorder.is_alive() and "began" in times, "the recording never had its turn"
    return times


def test_a_recording_is_not_starved_by_steps_that_leave_no_gap():
    """With no slice, a recording that wants to begin goes before the steps asked after
    it, and begins once the step in progress ends."""
    _busy(Turns())


def test_busy_steps_have_one_slice_before_a_recording_goes_first():
    """Each step one tick of the clock: a recording that wants to begin lets the steps run
    for its slice of three ticks, then goes before the next ones. Going first at once, it
    took the host between each of a step's three calls; waiting for a gap, it never began."""
    ticks = [0]
    times = _busy(Turns(slice_s=3, clock=lambda: ticks[0]), lambda: ticks.__setitem__(0, ticks[0] + 1))
    # Three ticks of steps after it asked, then the steps already in progress (the two
    # threads' overlap): a few more at most, never an unbounded wait.
    assert 3 <= times["began"] - times["asked"] <= 6, times


def test_the_pause_hook_is_gone_after_a_recording():
    turns = Turns()
    before = len(torch.nn.modules.module._global_forward_pre_hooks)
    with turns.recording(pausing=True):
        assert len(torch.nn.modules.module._global_forward_pre_hooks) == before + 1
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == before
    with pytest.raises(RuntimeError), turns.recording(pausing=True):
        raise RuntimeError("a capture that fails")
    assert len(torch.nn.modules.module._global_forward_pre_hooks) == before
    with turns.step():
        pass  # nothing left holding the turn
