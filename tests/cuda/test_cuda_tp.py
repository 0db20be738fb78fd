"""The tensor-parallel dsv4 model on every GPU of the machine, one NCCL rank each.

The scenarios of tests/test_tp.py, launched with ``backend="nccl"``: each rank on
``cuda:{rank}`` with its own stream, the plans placed on that device, real CUDA graphs
with the all-reduces captured in them. Needs at least 2 GPUs (up to 8 are used; the
tiny config's 24 heads and experts divide 2, 3, 4, 6 and 8).

One difference from the CPU run: the seed's legacy dispatch reads the routing on the
host, which no CUDA graph can capture, so ``warmup: real`` is shown on the TP model
itself (the ``full`` scenario), while ``placeholder`` still runs the legacy dispatch
and must end in a DivergenceError during warmup, before any capture.
"""

from __future__ import annotations

import pytest
import torch

from graphflow.cli import main
from graphflow.dist.launch import NVLS_ENV, launch
from test_tp import BARRIER_TIMEOUT_S, FAULTY_RANK, SCENARIOS, SIZES, TINY, run_scenarios

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs")]

NAMES = tuple(name for name in SCENARIOS if name != "seed_real")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    size = next(n for n in (8, 6, 4, 3, 2) if n <= torch.cuda.device_count())
    out = tmp_path_factory.mktemp(f"tp-nccl{size}")
    ranks = launch(run_scenarios, size, "nccl", args=(str(out), NAMES), timeout_s=540)
    for r in ranks:
        assert r.ok, r.traceback
    return size, out, {name: [r.value[name] for r in ranks] for name in NAMES}


def test_every_rank_runs_with_nvlink_multicast_off(world):
    size, _, results = world
    assert results["env"] == [NVLS_ENV] * size


def test_tp_step_equals_the_unsharded_step_on_every_rank(world):
    _, _, results = world
    for result in results["equal"]:
        assert "max_abs_diff" in result, result
        assert result["max_abs_diff"] < 1e-4
    sums = [r["logits_sum"] for r in results["equal"]]
    assert all(s == sums[0] for s in sums)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_capture_replays_equal_eager_and_traces_agree(world, mode, capsys):
    size, out, results = world
    want = "PIECEWISE" if mode == "piecewise" else "FULL"
    per_size = TINY["n_layers"] + 1 if mode == "piecewise" else 1
    for result in results[mode]:
        assert result["ok"], result
        assert result["captures_graphs"] is True
        assert result["graphs"] == per_size * len(SIZES)
        assert result["verify"] == [[f"{want}(B={s})", True] for s in sorted(SIZES, reverse=True)]
    logits = [r["logits"] for r in results[mode]]
    assert all(l == logits[0] for l in logits)
    assert main(["trace", "diff", str(out / mode)]) == 0
    assert capsys.readouterr().out.startswith(f"{size} traces agree")


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_fault_on_one_rank_raises_everywhere_and_leaves_every_rank_clean(world, mode):
    size, _, results = world
    for rank, result in enumerate(results[f"fault_{mode}"]):
        assert not result["ok"] and result["elapsed_s"] < BARRIER_TIMEOUT_S, result
        want = "CaptureError" if rank == FAULTY_RANK else "DivergenceError"
        assert (result["type"], result["phase"]) == (want, "capture"), result
        assert (result["buffers_alive"], result["model_alive"], result["gc_frozen"], result["ids"],
                result["capturing"], result["memory_delta"]) == (0, False, 0, {}, False, 0), result
        assert result["all_reduce_after"] == float(size)


def test_placeholder_warmup_feeding_routing_ends_in_divergence_error(world):
    size, _, results = world
    for result in results["seed_placeholder"]:
        assert (result["type"], result["phase"]) == ("DivergenceError", "warmup"), result
        assert result["elapsed_s"] < BARRIER_TIMEOUT_S
