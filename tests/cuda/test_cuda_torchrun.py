"""``graphflow run`` under torchrun on this machine's GPUs: one NCCL rank per GPU.

Each rank is a process torchrun started; ``graphflow.dist.distributed.joined`` puts it on
``cuda:{LOCAL_RANK}`` with its own stream and NVLink multicast off, and the TP plans
(written for ``cuda:0``) are placed there, captured into real CUDA graphs with the
all-reduces recorded in them, and verified against eager. The rank count is the largest
that the tiny config divides and the GPUs allow (1 on a one-GPU machine: the TP code
path over NCCL with no peer); the fault and the placeholder divergence need 2.
"""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from graphflow.cli import main
from graphflow.plan.loader import dump_plan
from test_torchrun import Job
from test_tp import FAULTY_RANK, SIZES, TINY, plan_for
from torchrun_models import FAILURE_TIMEOUT_S, SUCCESS_TIMEOUT_S, write_plans

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

MODES = ("piecewise", "full")


def _world() -> int:
    return next(n for n in (8, 6, 4, 3, 2, 1) if n <= torch.cuda.device_count())


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """One torchrun job per mode, one after the other (they share the GPUs): mode → result."""
    out = tmp_path_factory.mktemp("torchrun-nccl")
    world = _world()
    results = {}
    for mode in MODES:
        plan = plan_for(mode, world)
        path = out / f"{mode}.yaml"
        path.write_text(dump_plan(attrs.evolve(plan, capture=attrs.evolve(plan.capture,
                                                                          barrier_timeout_s=SUCCESS_TIMEOUT_S))))
        job = Job(["--standalone", "--nproc-per-node", str(world), "-m", "graphflow", "run", str(path), "--json",
                   "--steps", "3", "--trace", str(out / mode)], out)
        results[mode] = job.result()
    return world, out, results


@pytest.mark.parametrize("mode", MODES)
def test_every_rank_captures_cuda_graphs_that_verify_bit_exact(captured, mode):
    world, _, results = captured
    status, stdout, stderr, _ = results[mode]
    assert status == 0, stderr
    report = json.loads(stdout)
    assert report["ok"] and report["backend"] == "cuda" and report["graphs_captured"] is True
    assert report["group_backend"] == "nccl" and report["world_size"] == world
    per_size = TINY["n_layers"] + 1 if mode == "piecewise" else 1
    assert report["graphs"] == per_size * len(SIZES)
    assert [d["verify"]["bit_exact"] for d in report["descriptors"]] == [True] * len(SIZES)
    assert all(d["speedup"] is not None for d in report["descriptors"])  # graphs replayed and timed
    ranks = report["ranks"]
    assert [(r["rank"], r["ok"], r["verify"], r["device"]) for r in ranks] == [
        (rank, True, "bit-exact", f"cuda:{rank}") for rank in range(world)]


@pytest.mark.parametrize("mode", MODES)
def test_the_all_reduces_are_traced_on_every_rank(captured, mode, capsys):
    world, out, results = captured
    assert results[mode][0] == 0
    traces = sorted((out / mode).glob("rank*.jsonl"))
    assert [p.name for p in traces] == [f"rank{r}.jsonl" for r in range(world)]
    for path in traces:
        events = [json.loads(line) for line in path.read_text().splitlines()]
        calls = {(e["phase"], e["path"], e["channel"]) for e in events
                 if e["event"] == "collective" and e["phase"] in ("warmup", "capture")}
        assert calls == {("warmup", "eager_warmup", "tp_ar"), ("capture", "captured", "tp_ar")}
    if world > 1:
        assert main(["trace", "diff", str(out / mode)]) == 0
        assert capsys.readouterr().out.startswith(f"{world} traces agree")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a fault on one rank needs 2 GPUs")
def test_a_fault_and_the_placeholder_divergence_end_every_rank(tmp_path):
    plans = write_plans(tmp_path)
    run = ["--standalone", "--nproc-per-node", "2", "-m", "graphflow", "run"]
    status, stdout, stderr, _ = Job([*run, str(plans["fault"]), "--json", "--steps", "0", "--no-verify", "--sizes",
                                     str(max(SIZES))], tmp_path).result()
    assert status != 0
    ranks = json.loads(stdout)["ranks"]
    assert all(not r["ok"] and r["seconds"] < FAILURE_TIMEOUT_S for r in ranks), ranks
    assert f"injected capture fault on rank {FAULTY_RANK}" in ranks[FAULTY_RANK]["error"]
    assert f"rank {FAULTY_RANK} abandoned the pipeline" in ranks[1 - FAULTY_RANK]["error"]
    status, stdout, stderr, _ = Job([*run, str(plans["placeholder"]), "--json", "--steps", "0", "--no-detectors"],
                                    tmp_path).result()
    assert status != 0
    for r in json.loads(stdout)["ranks"]:
        assert not r["ok"] and r["error"].startswith("[phase=warmup") and "ranks diverged" in r["error"], r
