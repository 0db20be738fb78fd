"""The lazy-capture core on its own (``graphflow.engine.lazy``), with a capturer that
records which keys it was asked to capture and how: the order of keys, retries, failures
shaped once, first-use rejections undone on the thread, stopping. The engine and
transformers' serving each drive it with their own capturer (tests/test_background.py,
tests/test_hf_serving.py)."""

from __future__ import annotations

import threading

import pytest

from graphflow.engine.lazy import TRIES, KeyState, LazyCapture
from graphflow.engine.turns import Turns
from graphflow.errors import CaptureError


class Recorder:
    """A capturer of letters: ``fail`` maps a key to how many of its tries fail."""

    def __init__(self, fail=None, hold: threading.Event | None = None) -> None:
        self.fail = dict(fail or {})
        self.captured: list[tuple[str, bool]] = []  # (key, pausing)
        self.undone: list[tuple[str, bool]] = []  # (key, final)
        self.threads: set[str] = set()
        self.hold = hold
        self.core: LazyCapture | None = None
        self.prepared = self.finished = False

    def prepare(self) -> None:
        self.prepared = True

    def capture(self, key, turns, pausing) -> None:
        self.threads.add(threading.current_thread().name)
        if self.hold is not None:
            assert self.hold.wait(30)
        self.captured.append((key, pausing))
        if self.fail.get(key, 0) > 0:
            self.fail[key] -= 1
            raise RuntimeError(f"{key} broke")
        self.core.captured(key, checked=False)

    def undo(self, key, error, final) -> CaptureError:
        self.undone.append((key, final))
        return CaptureError(f"{key}: {error}", hint="served eagerly")

    def finish(self) -> None:
        self.finished = True


def _core(keys="abcd", **kwargs) -> tuple[LazyCapture, Recorder]:
    recorder = Recorder(kwargs.pop("fail", None), kwargs.pop("hold", None))
    core = LazyCapture(recorder, tuple(keys), turns=Turns(), first_step_s=kwargs.pop("first_step_s", 30.0), **kwargs)
    recorder.core = core
    return core, recorder


def test_the_first_key_asked_then_the_most_asked_then_the_plans_order():
    hold = threading.Event()
    core, recorder = _core("abcdef", hold=hold)
    core.start()
    try:
        core.ask("c")  # the first step's key: the thread begins with it
        for key in ("e", "d", "e"):  # asked while "c" is recorded: "e" twice, "d" once
            core.ask(key)
        hold.set()
        assert core.wait(30)
    finally:
        hold.set()
        core.stop()
    assert [k for k, _ in recorder.captured] == ["c", "e", "d", "a", "b", "f"]
    assert recorder.prepared and recorder.finished
    assert set(core.states.values()) == {KeyState.CAPTURED}


def test_first_is_captured_before_start_returns_and_the_rest_in_order():
    core, recorder = _core("abcd", first="c")
    core.start()
    try:
        assert [k for k, _ in recorder.captured] == ["c"]  # before any step asked for anything
        assert core.states["c"] is KeyState.CAPTURED
        core.ask("b")
        assert core.wait(30)
    finally:
        core.stop()
    assert [k for k, _ in recorder.captured] == ["c", "b", "a", "d"]


def test_a_first_key_that_fails_before_ready_is_tried_again_later():
    core, recorder = _core("ab", first="b", fail={"b": 1}, first_step_s=0.05)
    core.start()
    assert core.states["b"] is KeyState.PLANNED and core.tries == {"b": 1}
    assert core.wait(30)
    assert [k for k, _ in recorder.captured] == ["b", "b", "a"]
    assert set(core.states.values()) == {KeyState.CAPTURED}


def test_it_waits_for_the_first_step_for_a_while_only():
    core, recorder = _core("ab", first_step_s=0.05)
    core.start()
    assert core.wait(30)
    assert [k for k, _ in recorder.captured] == ["a", "b"]


def test_a_key_that_fails_is_tried_again_whole_until_it_succeeds_or_runs_out():
    core, recorder = _core("abc", fail={"b": 1, "c": TRIES}, first_step_s=0.0)
    core.start()
    assert core.wait(30)
    tried = [(k, pausing) for k, pausing in recorder.captured]
    assert tried.count(("b", True)) == 1 and tried.count(("b", False)) == 1, "a second try records whole"
    assert tried.count(("c", True)) == 1 and tried.count(("c", False)) == TRIES - 1
    assert core.states["b"] is KeyState.CAPTURED and core.states["c"] is KeyState.FAILED
    assert core.tries == {"b": 1, "c": TRIES}
    assert list(core.failures) == ["c"] and "c broke" in core.failures["c"].message
    assert recorder.undone == [("b", False), *[("c", False)] * (TRIES - 1), ("c", True)]


def test_without_ahead_only_what_steps_ask_for_is_captured():
    core, recorder = _core("abcd", ahead=False, first_step_s=0.0)
    core.start()
    try:
        core.ask("c")
        core.ask("zz")  # not in the plan: never captured
        assert not core.wait(0.3), "it waits for more asks"
        assert [k for k, _ in recorder.captured] == ["c"] and core.states["zz"] is KeyState.UNPLANNED
    finally:
        core.stop()
    assert core.done and recorder.finished


def test_keys_on_demand_are_captured_only_once_a_step_asks_for_them():
    core, recorder = _core("abcd", on_demand="cd", first_step_s=0.0)
    core.start()
    try:
        assert core.wait(30), "caught up once every key not on demand is captured"
        assert [k for k, _ in recorder.captured] == ["a", "b"] and not core.done and not core.busy
        assert core.caught_up_at is not None
        core.ask("d")
        assert _eventually(lambda: core.states["d"] is KeyState.CAPTURED)
        assert core.wait(30) and [k for k, _ in recorder.captured] == ["a", "b", "d"]
        assert core.states["c"] is KeyState.PLANNED
    finally:
        core.stop()
    assert core.done and recorder.finished and core.states["c"] is KeyState.PLANNED


def test_once_every_key_on_demand_is_captured_the_thread_ends():
    core, recorder = _core("abc", on_demand="c", first_step_s=0.0)
    core.start()
    try:
        core.ask("c")
        assert _eventually(lambda: core.done)
    finally:
        core.stop()
    assert sorted(k for k, _ in recorder.captured) == ["a", "b", "c"]


def test_busy_while_a_key_is_recorded_or_waits_to_be():
    hold = threading.Event()
    core, recorder = _core("ab", on_demand="b", hold=hold, first_step_s=0.0)
    core.start()
    try:
        assert _eventually(lambda: core.busy), "recording a"
        hold.set()
        assert core.wait(30) and not core.busy
    finally:
        hold.set()
        core.stop()
    assert not core.busy


def _eventually(condition, seconds: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return False


def test_a_key_its_first_batch_rejects_is_undone_on_the_thread():
    core, recorder = _core("ab", first_step_s=0.0)
    hold, reached = threading.Event(), threading.Event()
    capture = recorder.capture

    def capture_b_later(key, turns, pausing):
        if key == "b":
            reached.set()
            assert hold.wait(30)
        capture(key, turns, pausing)

    recorder.capture = capture_b_later
    core.start()
    try:
        assert reached.wait(30) and core.states["a"] is KeyState.CAPTURED
        core.checked("a", CaptureError("replay differs"))
        assert recorder.undone == [], "not beside the recording under way"
        undoing = []
        recorder.undo = lambda key, error, final: (undoing.append(threading.current_thread().name),
                                                   Recorder.undo(recorder, key, error, final))[1]
    finally:
        hold.set()
    assert core.wait(30)
    assert undoing == [core._name] and recorder.undone == [("a", True)]
    assert core.states == {"a": KeyState.FAILED, "b": KeyState.CAPTURED}


def test_once_the_thread_has_ended_a_rejected_key_is_undone_at_once():
    core, recorder = _core("ab", first_step_s=0.0)
    core.start()
    assert core.wait(30)
    core.checked("a", CaptureError("replay differs"))
    core.checked("b", None)
    assert core.states == {"a": KeyState.FAILED, "b": KeyState.LIVE}
    assert recorder.undone == [("a", True)] and "replay differs" in core.failures["a"].message


def test_stop_ends_the_thread_after_the_key_under_way():
    hold = threading.Event()
    core, recorder = _core("abcd", hold=hold, first_step_s=0.0)
    core.start()
    stopping = threading.Thread(target=core.stop)
    stopping.start()
    hold.set()
    stopping.join(30)
    assert not stopping.is_alive() and core.done and recorder.finished
    assert len(recorder.captured) <= 1


def test_a_prepare_that_fails_is_raised_by_start():
    core, recorder = _core("ab")
    recorder.prepare = lambda: (_ for _ in ()).throw(RuntimeError("no device"))
    with pytest.raises(RuntimeError, match="no device"):
        core.start()
    assert core.done and recorder.captured == []


def test_the_thread_runs_without_autograd():
    import torch

    seen = []
    core, recorder = _core("a", first_step_s=0.0)
    capture = recorder.capture
    recorder.capture = lambda key, turns, pausing: (seen.append(torch.is_grad_enabled()), capture(key, turns, pausing))
    core.start()
    assert core.wait(30) and seen == [False]
