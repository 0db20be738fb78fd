"""bench/ready_bench.py on the CPU (its --smoke mode): the rows, rounds and lazy runs it
records are what its table claims, so a GPU session does not find a broken bench."""

from __future__ import annotations

import json
import sys

import pytest

from bench import ready_bench


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ready_bench.py", "--smoke", "--plans", "FULL", "--rounds", "3",
                                      "--out", str(tmp_path)])
    assert ready_bench.main() == 0
    return json.loads((tmp_path / "ready-full.json").read_text())["plans"]["FULL"]


def test_each_row_keeps_its_fastest_round_of_all_it_ran(results):
    assert "warm_pass_s" in results
    for run in ("hand loop", "graphflow bare", "graphflow default"):
        row = results["rows"][run]
        assert len(row["rounds_total_s"]) == 3
        assert row["total_s"] == min(row["rounds_total_s"])
    assert results["rows"]["graphflow default"]["bit_exact"] is True
    assert "errors" not in results["rows"]


def test_lazy_runs_with_and_without_steps_served_and_says_where_the_thread_waited(results):
    idle, serving = results["lazy-idle"], results["lazy"]
    assert idle["served_steps"] == 0 and serving["served_steps"] > 0
    for lazy in (idle, serving):
        assert lazy["failures"] == {} and lazy["verified_bit_exact"] is True
        thread = lazy["thread"]
        assert {"warmup", "capture", "verify", "waiting"} <= set(thread)
        assert sum(v for k, v in thread.items() if k != "wall") == pytest.approx(thread["wall"])
    assert serving["served_bit_exact"] is True and serving["checked_steps"] >= 1
