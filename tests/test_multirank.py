"""Three CPU processes over gloo: seed 000 reproduced, diagnosed, and fixed by the policy.

One set of worker processes runs every scenario (tests/multirank_model.py), so torch is
imported and the process group set up once; each test reads its scenario's per-rank
results and traces. After the divergence scenario the same process group serves the
next scenarios: no rank was left inside a mismatched collective. The last scenario has
a rank stall past the barrier timeout; it too leaves the group usable.

Ranks as processes: the whole module is slow (CI's second step, ``pytest -m slow``).
"""

from __future__ import annotations

import re

import pytest

from graphflow.dist.chrome_trace import chrome_trace
from graphflow.cli import main
from graphflow.dist.trace import comparable, describe, diff_traces, read_trace
from graphflow.plan import WarmupPolicy

pytestmark = pytest.mark.slow
from graphflow.plan.rules import validate
from multirank_model import (BARRIER_TIMEOUT_S, SCENARIOS, SIZES, STALL_TIMEOUT_S, STALLED_RANK, family_plan,
                             run_workers, step_plan)

WORLD = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("multirank")
    return out, run_workers(out, WORLD, list(SCENARIOS))


def _traces(out, name):
    return [read_trace(out / name / f"rank{r}.jsonl") for r in range(WORLD)]


def _first_difference(out) -> int:
    return diff_traces(_traces(out, "seed-placeholder")).index


class TestPlaceholderWarmupDiverges:
    """warmup: placeholder with the legacy rank-local contents (GF503 would refuse the plan)."""

    def test_validation_refuses_the_plan_unless_gf503_is_turned_off(self):
        plan = family_plan(step_plan(WarmupPolicy.PLACEHOLDER), "target")
        report = validate(plan)
        assert [(d.code, d.message) for d in report.diagnostics] == [
            ("GF503", "channel tp_ar warms up with a placeholder output that reaches data-dependent segment route "
                      "after reduce")]
        assert validate(plan, disable={"GF503"}).ok

    def test_every_rank_raises_divergence_error_naming_rank_and_call_within_the_timeout(self, run):
        out, results = run
        n = _first_difference(out)
        for rank, result in enumerate(results["seed_placeholder"]):
            assert result["type"] == "DivergenceError", result
            assert (result["phase"], result["descriptor"], result["ranks"]) == ("warmup", "FULL(B=67)", [0])
            assert result["elapsed_s"] < BARRIER_TIMEOUT_S
            lines = result["message"].splitlines()
            assert lines[0].endswith("rank(s) 0 differ from rank(s) 1, 2")
            where = "" if rank == 0 else " segment=route"  # ranks 1 and 2 stopped before calling ep_ar in route
            assert lines[0].startswith(f"[phase=warmup descriptor=FULL(B=67){where} rank={rank}] ranks diverged at ")
            assert lines[2] == f"  rank 0: #{n} descriptor_end phase=warmup descriptor=FULL(B=67)"
            assert lines[3] == (f"  rank 1: #{n} collective phase=warmup descriptor=FULL(B=67) segment=route "
                                "channel=ep_ar op=all_reduce shape=[67, 4] path=eager_warmup capturing=False")

    def test_ranks_agreed_through_all_piecewise_descriptors_first(self, run):
        out, _ = run
        traces, n = _traces(out, "seed-placeholder"), _first_difference(out)
        ends = [e["descriptor"] for e in traces[0][:n] if e["event"] == "descriptor_end" and e["phase"] == "warmup"]
        assert ends == [f"PIECEWISE(B={s})" for s in sorted(SIZES, reverse=True)]
        assert (traces[0][n - 1]["channel"], traces[0][n - 1]["path"]) == ("tp_ar", "placeholder")
        assert traces[0][n - 1]["descriptor"] == "FULL(B=67)"

    def test_trace_diff_names_the_first_divergent_call(self, run, capsys):
        out, _ = run
        assert main(["trace", "diff", str(out / "seed-placeholder")]) == 1
        lines = capsys.readouterr().out.splitlines()
        n = _first_difference(out)
        assert lines[0] == f"traces differ at event {n}: rank 0 differs from rank 1, rank 2"
        assert f">    {n}  rank 0  #{n} descriptor_end phase=warmup descriptor=FULL(B=67)" in lines


    def test_the_exported_timeline_marks_rank_0_on_the_event_trace_diff_names(self, run):
        out, _ = run
        traces = _traces(out, "seed-placeholder")
        n = _first_difference(out)
        document = chrome_trace(traces)
        marks = {e["pid"]: e for e in document["traceEvents"] if e.get("cat") == "divergence" and e["s"] == "t"}
        assert (marks[0]["name"], marks[0]["args"]["n"]) == ("first divergence", n)
        assert marks[0]["args"]["this rank"] == describe(traces[0][n])
        start = min(e["ts"] for t in traces for e in t)
        for rank in range(WORLD):
            assert marks[rank]["ts"] == pytest.approx((traces[rank][n]["ts"] - start) * 1e6, abs=0.01)
        names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
        assert names == {0: f"rank 0 — diverged at event #{n}", 1: "rank 1", 2: "rank 2"}


class TestRealWarmupAgrees:
    def test_every_rank_commits_every_descriptor(self, run):
        _, results = run
        assert [r.get("graphs") for r in results["seed_real"]] == [2 * len(SIZES)] * WORLD, results["seed_real"]

    def test_the_three_traces_are_identical(self, run, capsys):
        out, _ = run
        traces = _traces(out, "seed-real")
        assert [comparable(e) for e in traces[1]] == [comparable(e) for e in traces[0]]
        assert [comparable(e) for e in traces[2]] == [comparable(e) for e in traces[0]]
        assert main(["trace", "diff", str(out / "seed-real")]) == 0
        assert capsys.readouterr().out.startswith(f"3 traces agree: {len(traces[0])} events each")
        paths = {(e["phase"], e["channel"], e["path"]) for e in traces[0] if e["event"] == "collective"}
        assert paths == {("warmup", "tp_ar", "eager_warmup"), ("warmup", "ep_ar", "eager_warmup"),
                         ("capture", "tp_ar", "captured"), ("capture", "ep_ar", "captured")}


class TestFamilies:
    def test_target_and_draft_hold_distinct_channel_ids(self, run):
        _, results = run
        for result in results["families"]:
            assert result["handle_ids"] == {"target": [1, 2], "draft": [3]}, result

    def test_a_failed_draft_capture_returns_its_ids_and_keeps_the_targets(self, run):
        _, results = run
        target_ids = {"1": "target/tp_ar", "2": "target/ep_ar"}
        for result in results["families"]:
            assert result["ids_after_target"] == target_ids
            assert result["ids_after_draft"] == target_ids

    def test_the_failing_rank_reports_its_error_and_the_others_name_it(self, run):
        _, results = run
        draft = [r["draft"] for r in results["families"]]
        assert draft[1]["type"] == "CaptureError" and "injected draft capture failure" in draft[1]["message"]
        for other in (draft[0], draft[2]):
            assert (other["type"], other["ranks"], other["phase"]) == ("DivergenceError", [1], "capture")
            assert "rank 1 abandoned the pipeline: RuntimeError: injected draft capture failure" in other["message"]

    def test_the_targets_graphs_still_replay_correctly(self, run):
        _, results = run
        assert [r["replay_ok"] for r in results["families"]] == [True] * WORLD


class TestSubgroups:
    """Channel groups bound to their own process groups (new_group_factory), partitioned [0, 1] and [2]."""

    def test_each_rank_is_bound_to_its_partition(self, run):
        _, results = run
        assert [r["tp_members"] for r in results["subgroups"]] == [[0, 1], [0, 1], [2]], results["subgroups"]

    def test_partition_sums_then_world_sum_replay_on_every_rank(self, run):
        _, results = run
        # tp: ranks 0+1 give x*(1+2), rank 2 gives x*3; the world all-reduce sums them: 9 for x = 1.
        assert [r["h"] for r in results["subgroups"]] == [[9.0]] * WORLD
        assert [r["verify_bit_exact"] for r in results["subgroups"]] == [[True, True]] * WORLD

    def test_traces_agree_and_name_each_collectives_group(self, run):
        out, _ = run
        traces = _traces(out, "subgroups")
        assert diff_traces(traces) is None
        assert {e["group"] for t in traces for e in t if e["event"] == "collective"} == {"tp", "world"}


class TestStalledRank:
    """Rank 2 stalls in FULL warmup past the barrier timeout and comes back after the others gave up."""

    def test_every_rank_raises_divergence_error_naming_the_stalled_rank(self, run):
        _, results = run
        for rank, result in enumerate(results["stalled"]):
            first = result.get("first", result)
            assert first["type"] == "DivergenceError", result
            assert (first["phase"], first["descriptor"], first["ranks"]) == ("warmup", "FULL(B=2)", [STALLED_RANK])
        for rank in (0, 1):
            first = results["stalled"][rank]["first"]
            assert first["elapsed_s"] >= STALL_TIMEOUT_S
            assert first["message"].startswith(
                f"[phase=warmup descriptor=FULL(B=2) segment=reduce rank={rank}] rank(s) 2 did not reach barrier "
                f"'all_reduce tp_ar [2, 4] float32' (#")
        late = results["stalled"][STALLED_RANK]["first"]["message"]
        assert re.match(r"\[phase=warmup descriptor=FULL\(B=2\) segment=reduce rank=2\] rank 2 reached barrier "
                        r"'all_reduce tp_ar \[2, 4\] float32' \(#\d+\) too late: rank [01] had given up waiting "
                        rf"for it after {STALL_TIMEOUT_S:g} s", late), late

    def test_a_retry_in_the_same_session_commits_and_the_group_still_pairs_collectives(self, run):
        _, results = run
        for result in results["stalled"]:
            assert result.get("retry", {}).get("graphs") == 4, result
            assert result["sum"] == 6.0
