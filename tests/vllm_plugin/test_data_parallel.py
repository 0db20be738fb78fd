"""Two data-parallel engines in one vLLM world: each captures behind barriers of its own.

Four processes run ``dp_worker.py``: vLLM's own ``init_distributed_environment`` and
``initialize_model_parallel`` for a MoE model with ``data_parallel_size=2`` and
``tensor_parallel_size=2`` put all four ranks into one gloo world (its DP groups span the
engines), and each rank runs vLLM's real V1 capture through the plugin. vLLM itself
couples the engines' captures (``graph_capture`` enters the DP group's communicator,
whose graph buffers are registered collectively), so the first two captures run on both
engines together, engine 1 with another ``GRAPHFLOW_VLLM_AGREE`` than engine 0 the first
time. Then engine 1 alone captures a third time, with rank 3 on another setting than
rank 2 (a partly configured engine), while engine 0 waits elsewhere.

With barriers over vLLM's world, engine 1's third capture would have waited for engine 0
until the timeout; here each engine agrees among its own ranks only, in its own
namespace, and the engines may differ in their settings.
"""


import pytest

pytest.importorskip("vllm")

from tests.vllm_plugin.ranks import free_port, run_ranks  # noqa: E402

TIMEOUT_S = 30
CALLS = "GRAPHFLOW_VLLM_AGREE=calls"
CAPTURES = {0: ["-", "-"], 1: ["-", "-"], 2: [CALLS, "-", "-"], 3: [CALLS, "-", CALLS]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each rank's results, one per capture."""
    root = tmp_path_factory.mktemp("dp")
    port = free_port()
    return run_ranks("dp_worker.py", [[str(rank), str(port), str(root / f"rank{rank}.json"), *CAPTURES[rank]]
                                      for rank in range(4)], root, TIMEOUT_S, "a rank hung")


def test_vllm_puts_both_engines_in_one_world(runs):
    for rank, results in enumerate(runs):
        assert results[0]["world"] == 4
        assert results[0]["tp"] == ([0, 1] if rank < 2 else [2, 3])
        assert results[0]["dp"] == ([0, 2] if rank % 2 == 0 else [1, 3])  # across the engines


def test_each_engine_agrees_only_among_its_own_ranks(runs):
    for rank, results in enumerate(runs):
        engine = rank // 2
        for generation, result in enumerate(results, start=1):
            assert result["sessions"] == [{"namespace": f"graphflow-vllm/engine{engine}/{generation}",
                                           "members": [2 * engine, 2 * engine + 1]}]


def test_engines_with_different_settings_each_capture(runs):
    for rank, results in enumerate(runs):
        assert [r["outcome"] for r in results[:2]] == ["captured", "captured"], results


def test_an_engine_capturing_alone_does_not_wait_for_the_other(runs):
    third = [runs[2][2], runs[3][2]]
    assert [r["outcome"] for r in third] == ["diverged", "diverged"], third
    for r in third:
        assert r["seconds"] < TIMEOUT_S / 2 and r["ranks"] == [3]  # a tie: the lower rank's settings are the norm
        assert "GRAPHFLOW_VLLM_AGREE is 'boundaries' on rank(s) 2 and 'calls' on rank(s) 3" in r["message"]
