"""bench/ready_bench.py on the CPU (its --smoke mode): the rows, rounds and lazy runs it
records are what its table claims, so a GPU session does not find a broken bench."""

from __future__ import annotations

import json
import sys

import pytest

from bench import ready_bench


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One smoke run, read by every test that checks what it records (a run takes seconds)."""
    out = tmp_path_factory.mktemp("ready")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["ready_bench.py", "--smoke", "--plans", "FULL", "--rounds", "3", "--out", str(out)])
        assert ready_bench.main() == 0
    return json.loads((out / "ready-full.json").read_text())["plans"]["FULL"]


def test_each_row_keeps_its_fastest_round_and_its_ratio_paired_over_the_rounds(results):
    assert "warm_pass_s" in results
    hand = results["rows"]["hand loop"]["rounds_total_s"]
    for run in ("hand loop", "graphflow bare", "graphflow default"):
        row = results["rows"][run]
        assert len(row["rounds_total_s"]) == 3
        assert row["total_s"] == min(row["rounds_total_s"])
        assert row["vs_hand"] == pytest.approx(sum(row["rounds_total_s"]) / sum(hand))
    assert results["rows"]["hand loop"]["vs_hand"] == pytest.approx(1.0)
    assert results["lazy"]["vs_hand_last_round"] == pytest.approx(results["lazy"]["all_live_s"] / hand[-1])
    assert results["rows"]["graphflow default"]["bit_exact"] is True
    assert "errors" not in results["rows"]


def test_lazy_runs_with_and_without_steps_served_and_says_where_the_thread_waited(results):
    idle, serving = results["lazy-idle"], results["lazy"]
    assert idle["served_steps"] == 0 and serving["served_steps"] > 0
    for lazy in (idle, serving):
        assert lazy["failures"] == {} and lazy["verified_bit_exact"] is True
        thread = lazy["thread"]
        assert {"warmup", "capture", "waiting"} <= set(thread)
        assert sum(v for k, v in thread.items() if k != "wall") == pytest.approx(thread["wall"])
    assert serving["served_bit_exact"] is True and serving["checked_steps"] >= 1
    assert serving["first_use_checked"] >= 1
    # The steps served while the thread captured: checks (the largest, live before ready,
    # checks on its first batch) in their own column, the others in the worst step's.
    timed = [serving["worst_step"], serving["worst_first_use_step_vs_eager"]]
    assert any(t is not None for t in timed)
    if serving["worst_step"] is not None:
        assert serving["worst_step_vs_eager"] > 0 and str(serving["worst_step"]["batch"]) in serving["eager_step_s"]


def test_the_first_use_run_checks_every_descriptor_verify_left_out(results):
    checks = results["first-use"]
    assert checks["checked_before_ready"] + checks["checked_on_first_use"] == 3  # --smoke: three sizes
    assert checks["failed"] == 0 and checks["unchecked_after"] == 0


def test_rounds_alternate_their_order_and_pair_only_rounds_both_finished():
    order, clock = [], iter(range(1, 100))

    def measure(run, fail_round=None):
        def one():
            order.append(run)
            if len([r for r in order if r == run]) == fail_round:
                raise RuntimeError("injected")
            return {"total_s": float(next(clock))}
        return one

    rows: dict = {}
    ready_bench._rounds(rows, [("hand loop", measure("hand loop")), ("b", measure("b", fail_round=2))], 4,
                        lambda what: None)
    assert order == ["hand loop", "b", "b", "hand loop", "hand loop", "b", "b", "hand loop"]
    # The clock ticks once per finished run: b took 2, (failed), 5, 6; the hand loop 1, 3, 4, 7.
    assert rows["b"]["rounds_total_s"] == [2.0, None, 5.0, 6.0]
    assert rows["b"]["vs_hand"] == pytest.approx((2 + 5 + 6) / (1 + 4 + 7))
    assert list(rows["errors"]) == ["b (round 2)"]


def test_the_rounds_are_saved_without_any_lazy_run(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ready_bench.py", "--smoke", "--plans", "FULL", "--runs", "hand,bare",
                                      "--rounds", "2", "--out", str(tmp_path)])
    assert ready_bench.main() == 0
    rows = json.loads((tmp_path / "ready-full.json").read_text())["plans"]["FULL"]["rows"]
    assert set(rows) == {"hand loop", "graphflow bare"}
    assert len(rows["graphflow bare"]["rounds_total_s"]) == 2 and "vs_hand" in rows["graphflow bare"]


def test_the_at_once_rows_run_when_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ready_bench.py", "--smoke", "--plans", "FULL", "--rounds", "1", "--no-warm",
                                      "--runs", "hand,bare-at-once,default-at-once", "--out", str(tmp_path)])
    assert ready_bench.main() == 0
    rows = json.loads((tmp_path / "ready-full.json").read_text())["plans"]["FULL"]["rows"]
    assert set(rows) == {"hand loop", "bare, at once", "default, at once"}
    assert rows["default, at once"]["bit_exact"] is True and rows["bare, at once"]["bit_exact"] is None


def test_the_restart_run_restores_in_a_new_process_or_says_why_not(tmp_path, monkeypatch):
    """The restart row runs two fresh processes of bench/restart_bench.py: on the CPU nothing
    is saved (it records no graphs), so the new process says so in one line and captures,
    bit-exact to the capturing process and to the eager step; the row is in the JSON and
    the table."""
    monkeypatch.setattr(sys, "argv", ["ready_bench.py", "--smoke", "--plans", "FULL", "--rounds", "1", "--no-warm",
                                      "--runs", "hand,restart", "--out", str(tmp_path)])
    assert ready_bench.main() == 0
    entry = json.loads((tmp_path / "ready-full.json").read_text())["plans"]["FULL"]
    restart = entry["restart"]
    assert "holds no saved graphs" in restart["refused"] and (restart["restored"], restart["captured"]) == (0, 0)
    assert restart["bit_exact_to_capture"] is True and restart["bit_exact_to_eager"] is True
    assert restart["live_s"] > 0 and restart["vs_hand_last_round"] == pytest.approx(
        restart["live_s"] / entry["rows"]["hand loop"]["rounds_total_s"][-1])
