"""The placeholder divergence on three gloo ranks, through vLLM's real TP group and capture.

Each rank runs ``rank_worker.py``: vLLM's ``GroupCoordinator`` and ``CudaCommunicator``
route the model's all-reduces to vLLM's ``CustomAllreduce.custom_all_reduce``, whose IPC
kernel is a sum over gloo. During the warmup that vLLM runs inside its capture context,
the placeholder hands each rank its own leftover values (the caching allocator's freed
block); they feed top-1 routing, so the ranks' expert all-reduces differ. With the plugin
every rank raises DivergenceError at the end of that warmup, naming the first differing
call, and ``graphflow trace diff`` names the same call; with ``real`` or ``prepare`` the
ranks agree and capture. For an MoE model the plan sees the routing and the plugin
refuses the placeholder before capture (GF503).
"""

import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from tests.vllm_plugin.ranks import free_port, run_ranks  # noqa: E402

from graphflow.dist.trace import diff_traces, read_trace  # noqa: E402

WORLD = 3
TIMEOUT_S = 20
SCENARIOS = [("llama-tiny", "placeholder"), ("llama-tiny", "real"), ("llama-tiny", "prepare"),
             ("moe-tiny", "placeholder")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario on three ranks: {(model, policy): (per-rank results, trace dir)}."""
    root = tmp_path_factory.mktemp("ranks")
    port = free_port()
    traces = {scenario: root / f"{scenario[0]}-{scenario[1]}" for scenario in SCENARIOS}
    args = [f"{model}:{policy}:{traces[(model, policy)]}" for model, policy in SCENARIOS]
    results = run_ranks("rank_worker.py", [[str(rank), str(WORLD), str(port), str(root / f"rank{rank}.json"), *args]
                                           for rank in range(WORLD)], root, TIMEOUT_S,
                        "a rank hung: the barriers should have turned the divergence into an error")
    return {scenario: ([r[i] for r in results], traces[scenario]) for i, scenario in enumerate(SCENARIOS)}


def test_the_plugin_was_loaded_by_vllms_entry_point_machinery(runs):
    results, _ = runs[SCENARIOS[0]]
    assert all(r["loaded"] for r in results)


def test_a_placeholder_feeding_routing_is_a_divergence_error_on_every_rank(runs):
    results, _ = runs[("llama-tiny", "placeholder")]
    assert [r["outcome"] for r in results] == ["diverged"] * WORLD, [r.get("message") for r in results]
    assert len({r["routes"][0].__repr__() for r in results}) > 1  # the ranks really routed differently
    assert all(r["seconds"] < TIMEOUT_S for r in results)  # at the barrier, not at a timeout
    barrier = {r["message"].split("ranks diverged at barrier ")[1].split(":")[0] for r in results}
    assert barrier == {"'phase_end warmup target PIECEWISE(tokens=8)' (#2)"}
    for r in results:
        assert r["phase"] == "warmup" and r["descriptor"] == "target PIECEWISE(tokens=8)"
        assert r["ranks"] and r["event"]["event"] == "collective" and r["event"]["path"] == "placeholder"
        assert "first differing event" in r["message"] and "op=all_reduce shape=" in r["message"]


def test_trace_diff_names_the_first_divergent_call(runs):
    results, trace = runs[("llama-tiny", "placeholder")]
    files = sorted(trace.glob("rank*.jsonl"))
    assert len(files) == WORLD
    diff = diff_traces([read_trace(f) for f in files])
    assert diff is not None
    events = [e for e in diff.events if e is not None]
    assert {e["event"] for e in events} == {"collective"} and len({tuple(e["shape"]) for e in events}) > 1
    assert all(e["phase"] == "warmup" and e["path"] == "placeholder" for e in events)
    cli = subprocess.run([sys.executable, "-m", "graphflow", "trace", "diff", *map(str, files)],
                         capture_output=True, text=True)
    assert cli.returncode == 1
    assert f"traces differ at event {diff.index}" in cli.stdout
    assert results[0]["event"]["n"] == diff.events[0]["n"]  # the error and the diff name the same call


@pytest.mark.parametrize("policy", ["real", "prepare"])
def test_real_or_prepare_warmups_agree_and_capture(runs, policy):
    results, trace = runs[("llama-tiny", policy)]
    assert [r["outcome"] for r in results] == ["captured"] * WORLD, [r.get("message") for r in results]
    assert len({repr(r["routes"]) for r in results}) == 1
    traces = [read_trace(f) for f in sorted(trace.glob("rank*.jsonl"))]
    assert len(traces) == WORLD and diff_traces(traces) is None
    paths = {e["path"] for e in traces[0] if e["event"] == "collective"}
    assert paths == {"eager_warmup" if policy == "real" else "prepare", "captured"}
    ends = [e for e in traces[0] if e["event"] == "phase_end" and e["phase"] == "capture"]
    assert len(ends) == 7  # every descriptor captured: PIECEWISE 8, 4, 2, 1, FULL 4, 2, 1
    warmed = {(tuple(e["shape"]), e["dtype"]) for e in traces[0] if e.get("path") == "prepare"}
    for r in results:
        prepared = [(tuple(shape), dtype.removeprefix("torch.")) for shape, dtype in r["prepared"]]
        if policy == "prepare":  # every shape the warmup met, prepared once, before capture launched it
            assert sorted(prepared) == sorted(warmed) and len(set(prepared)) == len(prepared)
        else:
            assert prepared == []


def test_an_moe_model_with_a_placeholder_is_refused_before_capture_on_every_rank(runs):
    results, trace = runs[("moe-tiny", "placeholder")]
    assert [r["outcome"] for r in results] == ["refused"] * WORLD
    for rank, r in enumerate(results):
        assert r["phase"] == "validate" and f"rank={rank}" in r["message"]
        assert "GF503" in r["message"] and "target.L0.mlp" in r["message"]
    assert not trace.exists()  # nothing ran: no trace
