"""The tensor-parallel dsv4 model on 2 and 3 CPU processes over gloo (graphflow.dist.launch).

One launch per world size runs every scenario in turn, so torch is imported and the
process group set up once; each test reads its scenario's per-rank results. The
scenarios are module functions: tests/cuda/test_cuda_tp.py runs the same ones on NCCL.
"""

from __future__ import annotations

import gc
import json
import pathlib
import re
import time
import weakref

import attrs
import pytest
import torch

from graphflow.dist.channels import ChannelRuntime
from graphflow.cli import main
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.model import DSV4Model, decode_step
from graphflow.integrations.dsv4.plans import plan_variant
from graphflow.integrations.dsv4.tp import TPDecoderLayer, TPModel, build_tp_model
from graphflow.dist.launch import NVLS_ENV, launch
from graphflow.plan import Channel, ChannelKind, WarmupPolicy
from graphflow.session import Session
from graphflow.dist.trace import CallPath, Tracer, diff_traces, read_trace
from graphflow.plan.rules import validate

#: Objects the interpreter holds frozen before graphflow runs: torch 2.11's import leaves
#: 375 frozen on the GPU machine (Python 3.12), none here. A pipeline, failed or not,
#: must leave no more than these.
FROZEN_AT_IMPORT = gc.get_freeze_count()

PLANS = pathlib.Path(__file__).resolve().parents[1] / "plans"
#: A tiny config that 1, 2, 3, 4, 6 and 8 ranks divide: 24 heads, 24 experts, shared width 24.
TINY = dict(vocab_size=64, hidden_size=32, n_layers=2, hc_streams=2, n_heads=24, kv_dim=8, rope_dim=4, n_experts=24,
            top_k=2, moe_inter=8, shared_inter=24, compress_every=4, max_len=32, block_size=8, max_batch=4,
            sinkhorn_iters=5)
SIZES = (1, 4)
BARRIER_TIMEOUT_S = 10.0
FAULTY_RANK = 1


def plan_for(mode: str, world: int, *, policy: WarmupPolicy = WarmupPolicy.REAL):
    plan = plan_variant(PLANS / f"dsv4_tp_{mode}.yaml", world_size=world, sizes=SIZES, **TINY)
    tp = attrs.evolve(plan.channel("tp_ar"), warmup=policy)
    return attrs.evolve(plan, channels=[tp], capture=attrs.evolve(plan.capture, barrier_timeout_s=BARRIER_TIMEOUT_S))


# -- models for the fault and seed scenarios ------------------------------------------------

class FaultyLayer(TPDecoderLayer):
    """Raises in one rank's capture of its mix segment (the first all-reduce); remembers the
    static buffers it saw."""

    runtime: ChannelRuntime | None = None
    seen: list = []

    def post_attention(self, o, post_mix, res_mix, x, h, ffn_post, ffn_logits) -> None:
        self.seen.append(weakref.ref(x._base if x._base is not None else x))
        if self.runtime.site.phase is Phase.CAPTURE and self.runtime.rank == FAULTY_RANK:
            raise RuntimeError(f"injected capture fault on rank {FAULTY_RANK}")
        super().post_attention(o, post_mix, res_mix, x, h, ffn_post, ffn_logits)


class LegacyAllReduce:
    """The seed's custom all-reduce: in warmup its output was uninitialized, rank-local memory."""

    def __init__(self, handle, rank: int):
        self.handle = handle
        self.garbage = torch.Generator().manual_seed(rank)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.handle.all_reduce(t)
        if self.handle.path() is CallPath.PLACEHOLDER:
            t.copy_(torch.randn(t.shape, generator=self.garbage))
        return t


class LegacyDispatchLayer(TPDecoderLayer):
    """The seed engine's expert dispatch: routing read on the host, one all-reduce per chosen expert.

    Which collectives run depends on the routing: ranks that route differently make
    different calls, the seed's hang.
    """

    ep = None

    def routed(self, h, ids, weights):
        total = torch.zeros_like(h)
        for expert in range(self.config.n_experts):
            rows = (ids == expert).any(1).nonzero().flatten()  # read on the host: the tokens sent to it
            if rows.numel() == 0:
                continue  # the seed's dispatch skipped idle experts
            share = torch.zeros(rows.numel(), h.shape[1], dtype=h.dtype, device=h.device)
            if self.experts.start <= expert < self.experts.stop:
                gate, up = torch.matmul(h[rows], self.w13[expert - self.experts.start]).chunk(2, dim=-1)
                weight = ((ids[rows] == expert).to(h.dtype) * weights[rows]).sum(1, keepdim=True)
                share = torch.matmul(torch.nn.functional.silu(gate) * up, self.w2[expert - self.experts.start]) * weight
            self.ep.all_reduce(share)
            total.index_add_(0, rows, share)
        return total / len(self.ep.binding.members)  # post_ffn all-reduces it once more


# -- scenarios: each runs on every rank and returns a picklable dict -------------------------

def _outcome(fn) -> dict:
    start = time.monotonic()
    try:
        value = fn() or {}
        return {"ok": True, "elapsed_s": time.monotonic() - start, **value}
    except CaptureError as e:
        return {"ok": False, "elapsed_s": time.monotonic() - start, "type": type(e).__name__, "message": str(e),
                "phase": e.phase, "ranks": list(getattr(e, "ranks", ())), "rank": e.rank}


def scenario_env(ctx, out) -> dict:
    import os

    return {name: os.environ.get(name) for name in NVLS_ENV}


def scenario_equal(ctx, out) -> dict:
    """Four decode steps of the TP model against the unsharded model, from the same state,
    with static (FULL) and eager (PIECEWISE) attention."""
    config = DSV4Config(**TINY)
    plan = ctx.place(plan_for("full", ctx.world_size))
    runtime = ChannelRuntime(plan, rank=ctx.rank, world_size=ctx.world_size, tracer=False, namespace="equal")
    models = {"full": DSV4Model(config, ctx.device),
              "tp": build_tp_model(device=ctx.device, plan=plan, rank=ctx.rank, world_size=ctx.world_size,
                                   channels=runtime.handles, **TINY)}
    steps = {"full": lambda bufs, static: decode_step(models["full"], bufs, static=static),
             "tp": lambda bufs, static: models["tp"].step(bufs, static=static)}
    batch, worst, logits_sum = 4, 0.0, []
    for static in (True, False):
        states = {"full": _state(config, batch, config.n_heads, ctx.device),
                  "tp": _state(config, batch, config.n_heads // ctx.world_size, ctx.device)}
        tokens = torch.randint(0, config.vocab_size, (batch,), generator=torch.Generator().manual_seed(7))
        for step in range(4):
            for name in models:
                bufs = states[name]
                bufs["tokens"].copy_(tokens)
                bufs["positions"].fill_(step)
                bufs["positions_host"].fill_(step)
                steps[name](bufs, static)
            want, got = states["full"]["logits"], states["tp"]["logits"]
            worst = max(worst, float((want - got).abs().max()))
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (static, step, float((want - got).abs().max()))
            assert torch.equal(states["full"]["expert_load"], states["tp"]["expert_load"])
            logits_sum.append(float(got.double().sum()))
            tokens = want.argmax(-1)
    runtime.close()
    return {"max_abs_diff": worst, "logits_sum": logits_sum}


def _state(config: DSV4Config, batch: int, heads: int, device) -> dict[str, torch.Tensor]:
    from graphflow.integrations.dsv4.model import expected_shapes

    bufs = {}
    for stem, shape in expected_shapes(config).items():
        shape = tuple(batch if d == "B" else d for d in shape)
        if stem in ("q", "o"):
            shape = (batch, heads, config.kv_dim)
        dtype = torch.int64 if stem in ("tokens", "positions", "positions_host", "expert_load") else torch.float32
        names = [f"{stem}{i}" for i in range(config.n_layers)] if stem in (
            "q", "kv", "post_mix", "res_mix", "o", "kv_cache", "comp_cache") else [stem]
        for name in names:
            bufs[name] = torch.zeros(shape, dtype=dtype, device="cpu" if stem == "positions_host" else device)
    return bufs


def scenario_capture(ctx, out, mode: str) -> dict:
    """The plan captured on every rank; one replayed step's logits for comparison across ranks."""
    from graphflow.engine import RunOptions

    plan = ctx.place(plan_for(mode, ctx.world_size))
    options = RunOptions(backend="cuda" if ctx.backend == "nccl" else "cpu")
    with Session(plan, options, rank=ctx.rank, world_size=ctx.world_size, trace=str(out / mode),
                 namespace=f"capture-{mode}") as session:

        def run():
            engine = session.capture()
            generator = torch.Generator().manual_seed(3)
            tokens = torch.randint(0, TINY["vocab_size"], (3,), generator=generator).to(ctx.device)
            positions = torch.tensor([0, 5, 11])
            inputs = {"tokens": tokens, "positions": positions.to(ctx.device), "positions_host": positions}
            runner = session.runner
            logits = runner.run(*(inputs[name] for name in runner.inputs))[0]
            return {"graphs": engine.report.graphs, "captures_graphs": engine.report.captures_graphs,
                    "verify": [[str(v.descriptor), v.bit_exact] for v in engine.report.verify],
                    "logits": logits.cpu().tolist()}

        return _outcome(run)


def scenario_fault(ctx, out, mode: str) -> dict:
    """A fault in one rank's capture: every rank raises, rolls back and can communicate after."""
    import torch.distributed as dist

    from graphflow.engine import RunOptions

    plan = ctx.place(plan_for(mode, ctx.world_size))
    # the fault hits the first capture
    options = RunOptions(backend="cuda" if ctx.backend == "nccl" else "cpu", verify=False, sizes=(max(SIZES),))
    session = Session(plan, options, rank=ctx.rank, world_size=ctx.world_size, trace=str(out / f"fault-{mode}"),
                      namespace=f"fault-{mode}")
    runtime = session.channels
    FaultyLayer.runtime, FaultyLayer.seen = runtime, []
    baseline = torch.cuda.memory_allocated(ctx.device) if ctx.backend == "nccl" else 0
    held = [TPModel(DSV4Model(DSV4Config(**TINY), ctx.device), ctx.rank, ctx.world_size, runtime.handles["tp_ar"],
                    layer_type=FaultyLayer)]
    model_ref = weakref.ref(held[0])

    def run():  # the pipeline gets the only reference to the model
        session.capture(held.pop())

    result = _outcome(run)
    FaultyLayer.runtime = None
    gc.collect()
    after = torch.cuda.memory_allocated(ctx.device) if ctx.backend == "nccl" else 0
    capturing = torch.cuda.is_current_stream_capturing() if ctx.backend == "nccl" else False
    ones = torch.ones(1, device=ctx.device)
    dist.all_reduce(ones)  # the process group still works: no rank was left inside a collective
    result.update(buffers_alive=sum(r() is not None for r in FaultyLayer.seen), buffers_seen=len(FaultyLayer.seen),
                  model_alive=model_ref() is not None, gc_frozen=max(0, gc.get_freeze_count() - FROZEN_AT_IMPORT),
                  ids=runtime.registry.taken,
                  capturing=capturing, memory_delta=after - baseline, all_reduce_after=float(ones))
    FaultyLayer.seen = []
    session.close()
    return result


def scenario_seed(ctx, out, policy: WarmupPolicy) -> dict:
    """The seed's legacy all-reduce and host-routed dispatch, with the given tp_ar warmup."""
    from graphflow.engine import RunOptions

    plan = plan_for("full", ctx.world_size, policy=policy)
    ep = Channel("ep_ar", ChannelKind.ALL_REDUCE, "ep", 2, "target")
    plan = ctx.place(attrs.evolve(plan, channels=[*plan.channels, ep], segments=[
        attrs.evolve(s, channels=[*s.channels, "ep_ar"]) if s.name.endswith(".moe") else s for s in plan.segments]))
    skip = {"GF503"} if policy is WarmupPolicy.PLACEHOLDER else set()
    report = validate(plan, disable=skip)
    assert report.ok, report.diagnostics
    options = RunOptions(backend="cuda" if ctx.backend == "nccl" else "cpu", detectors=False, skip_rules=skip)
    with Session(plan, options, rank=ctx.rank, world_size=ctx.world_size, trace=str(out / f"seed-{policy.value}"),
                 namespace=f"seed-{policy.value}") as session:
        LegacyDispatchLayer.ep = session.handles["ep_ar"]
        model = TPModel(DSV4Model(DSV4Config(**TINY), ctx.device), ctx.rank, ctx.world_size,
                        LegacyAllReduce(session.handles["tp_ar"], ctx.rank), layer_type=LegacyDispatchLayer)
        result = _outcome(lambda: {"graphs": session.capture(model).report.graphs})
        LegacyDispatchLayer.ep = None
    return result


SCENARIOS = {
    "env": scenario_env,
    "equal": scenario_equal,
    "piecewise": lambda ctx, out: scenario_capture(ctx, out, "piecewise"),
    "full": lambda ctx, out: scenario_capture(ctx, out, "full"),
    "fault_piecewise": lambda ctx, out: scenario_fault(ctx, out, "piecewise"),
    "fault_full": lambda ctx, out: scenario_fault(ctx, out, "full"),
    "seed_placeholder": lambda ctx, out: scenario_seed(ctx, out, WarmupPolicy.PLACEHOLDER),
    "seed_real": lambda ctx, out: scenario_seed(ctx, out, WarmupPolicy.REAL),
}


def run_scenarios(ctx, out: str, names: tuple[str, ...]) -> dict:
    """Every scenario in turn on one rank: a scenario's failure is its result, not the launch's."""
    import traceback

    torch.set_num_threads(1)
    results = {}
    for name in names:
        try:
            results[name] = SCENARIOS[name](ctx, pathlib.Path(out))
        except Exception as e:  # reported to the test, which fails showing it
            results[name] = {"ok": False, "type": type(e).__name__, "message": str(e),
                             "traceback": traceback.format_exc()}
    return results


# -- tests ---------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def world(request, tmp_path_factory):
    """(world size, trace directory, results[scenario][rank]) for one launch. It starts
    ranks as processes: each test that takes it is marked slow, as is each that launches."""
    size = request.param
    out = tmp_path_factory.mktemp(f"tp{size}")
    ranks = launch(run_scenarios, size, "gloo", args=(str(out), tuple(SCENARIOS)), timeout_s=120)
    for r in ranks:
        assert r.ok, r.traceback
    return size, out, {name: [r.value[name] for r in ranks] for name in SCENARIOS}


@pytest.mark.slow
class TestLaunch:
    def test_every_rank_runs_with_nvlink_multicast_off(self, world):
        size, _, results = world
        assert results["env"] == [NVLS_ENV] * size


class TestShardedStepEqualsUnsharded:
    @pytest.mark.slow
    def test_logits_and_expert_counts_match_the_unsharded_model_on_every_rank(self, world):
        size, _, results = world
        for result in results["equal"]:
            assert "max_abs_diff" in result, result
            assert result["max_abs_diff"] < 1e-4

    @pytest.mark.slow
    def test_every_rank_computes_the_same_logits(self, world):
        _, _, results = world
        sums = [r["logits_sum"] for r in results["equal"]]
        assert all(s == sums[0] for s in sums), sums

    def test_indivisible_heads_are_refused_naming_the_dimension(self):
        with pytest.raises(ValueError, match=r"^n_heads \(24\) must be divisible by world_size \(5\)$"):
            build_tp_model(rank=0, world_size=5, channels={"tp_ar": None}, **TINY)

    def test_a_plan_for_another_world_size_is_refused(self):
        plan = plan_for("full", 2)
        with pytest.raises(ValueError, match="written for world_size 2, the run has 3"):
            build_tp_model(plan=plan, rank=0, world_size=3, channels={"tp_ar": None}, **TINY)

    def test_more_than_one_rank_without_the_channel_is_refused(self):
        with pytest.raises(ValueError, match="needs channel 'tp_ar'"):
            build_tp_model(rank=0, world_size=2, **TINY)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["piecewise", "full"])
class TestCapture:
    def test_every_descriptor_verifies_bit_exact_on_every_rank(self, world, mode):
        size, _, results = world
        want_mode = "PIECEWISE" if mode == "piecewise" else "FULL"
        for result in results[mode]:
            assert result["ok"], result
            assert result["verify"] == [[f"{want_mode}(B={s})", True] for s in sorted(SIZES, reverse=True)]

    def test_graph_counts_match_the_plan(self, world, mode):
        _, _, results = world
        # PIECEWISE: embed+pre, then per layer res..ffn_out+pre (the last one with head), per size;
        # FULL: 1 per size.
        per_size = TINY["n_layers"] + 1 if mode == "piecewise" else 1
        assert [r["graphs"] for r in results[mode]] == [per_size * len(SIZES)] * len(results[mode])

    def test_replayed_logits_are_identical_across_ranks(self, world, mode):
        _, _, results = world
        logits = [r["logits"] for r in results[mode]]
        assert all(l == logits[0] for l in logits)

    def test_traces_are_identical_across_ranks(self, world, mode, capsys):
        size, out, _ = world
        assert main(["trace", "diff", str(out / mode)]) == 0
        assert capsys.readouterr().out.startswith(f"{size} traces agree")
        trace = read_trace(out / mode / "rank0.jsonl")
        calls = [e for e in trace if e["event"] == "collective" and e["phase"] in ("warmup", "capture")]
        assert {(e["phase"], e["path"], e["channel"]) for e in calls} == {("warmup", "eager_warmup", "tp_ar"),
                                                                          ("capture", "captured", "tp_ar")}
        # Two all-reduces per layer per step: warmup_iters steps per descriptor, then one
        # captured; the first (largest) descriptor warms up once more, for the host-state
        # check's second read (every rank runs it, so their collectives still pair up).
        plan = plan_for(mode, size)
        per_step = 2 * TINY["n_layers"]
        assert len(calls) == per_step * (len(SIZES) * (plan.capture.warmup_iters + 1) + 1)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["piecewise", "full"])
class TestFaultOnOneRank:
    def test_every_rank_raises_within_the_timeout(self, world, mode):
        size, _, results = world
        for rank, result in enumerate(results[f"fault_{mode}"]):
            assert not result["ok"], result
            assert result["elapsed_s"] < BARRIER_TIMEOUT_S
            assert result["phase"] == "capture"
            if rank == FAULTY_RANK:
                assert result["type"] == "CaptureError"
                assert "RuntimeError in region" in result["message"]
                assert f"injected capture fault on rank {FAULTY_RANK}" in result["message"]
            else:
                assert (result["type"], result["ranks"]) == ("DivergenceError", [FAULTY_RANK])
                assert (f"rank {FAULTY_RANK} abandoned the pipeline: RuntimeError: injected capture fault"
                        in result["message"])

    def test_every_rank_is_clean_afterwards(self, world, mode):
        _, _, results = world
        for result in results[f"fault_{mode}"]:
            assert result["buffers_seen"] > 0
            assert (result["buffers_alive"], result["model_alive"], result["gc_frozen"], result["ids"],
                    result["capturing"], result["memory_delta"]) == (0, False, 0, {}, False, 0), result

    def test_the_process_group_still_works(self, world, mode):
        size, _, results = world
        assert [r["all_reduce_after"] for r in results[f"fault_{mode}"]] == [float(size)] * size


class TestSeedFailure:
    def test_validation_refuses_the_placeholder_plan_unless_gf503_is_off(self):
        plan = plan_for("full", 2, policy=WarmupPolicy.PLACEHOLDER)
        codes = [d.code for d in validate(plan).diagnostics]
        assert codes and set(codes) == {"GF503"}
        assert validate(plan, disable={"GF503"}).ok

    @pytest.mark.slow
    def test_placeholder_warmup_ends_in_divergence_error_on_every_rank(self, world):
        size, out, results = world
        for result in results["seed_placeholder"]:
            assert result["type"] == "DivergenceError", result
            assert result["phase"] == "warmup"
            assert result["elapsed_s"] < BARRIER_TIMEOUT_S
            assert result["ranks"] and len(result["ranks"]) < size
        assert diff_traces([read_trace(out / "seed-placeholder" / f"rank{r}.jsonl") for r in range(size)]) is not None

    @pytest.mark.slow
    def test_real_warmup_captures(self, world):
        size, _, results = world
        assert [r.get("graphs") for r in results["seed_real"]] == [len(SIZES)] * size, results["seed_real"]


class TestLaunchCommand:
    @pytest.mark.slow
    def test_captures_a_tp_plan_on_two_ranks_with_agreeing_traces(self, tmp_path, capsys):
        from graphflow.plan.loader import dump_plan

        path = tmp_path / "tp.yaml"
        path.write_text(dump_plan(plan_for("full", 2)))
        status = main(["launch", "--nproc", "2", "--sizes", "1", "--trace", str(tmp_path / "trace"), str(path)])
        lines = capsys.readouterr().out.splitlines()
        assert status == 0, lines
        assert [line.split(", verify")[0] for line in lines[:2]] == [
            "rank 0: 1 graph(s), 1 descriptor(s)", "rank 1: 1 graph(s), 1 descriptor(s)"]
        assert all("verify bit-exact" in line for line in lines[:2])
        assert lines[2] == "dsv4-tp-full: captured on 2 rank(s) (gloo)"
        assert main(["trace", "diff", str(tmp_path / "trace")]) == 0

    @pytest.mark.slow
    def test_each_rank_shows_its_progress_on_the_launchers_stderr(self, tmp_path):
        import subprocess
        import sys

        from graphflow.plan.loader import dump_plan

        path = tmp_path / "tp.yaml"
        path.write_text(dump_plan(plan_for("full", 2)))
        # A process of its own, as a user runs it: the ranks write to the stderr it started with.
        done = subprocess.run([sys.executable, "-m", "graphflow", "launch", "--nproc", "2", "--sizes", "1", str(path)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        for rank in range(2):  # each rank's progress as it went, told apart by its prefix
            assert f"rank {rank}: allocate: building the model, streams and static buffers" in done.stderr
            assert re.search(rf"^rank {rank}: captured 1/1: FULL\(B=1\), 1 region, ", done.stderr, re.M), done.stderr
            assert f"rank {rank}: captured 1 FULL descriptor (1 region) in " in done.stderr
        assert done.stdout.splitlines()[-1] == "dsv4-tp-full: captured on 2 rank(s) (gloo)"

    @pytest.mark.slow
    def test_the_launcher_says_what_it_starts_before_torch_loads(self, tmp_path):
        from graphflow.plan.loader import dump_plan
        from tests.torch_loads import before_torch

        path = tmp_path / "tp.yaml"
        path.write_text(dump_plan(plan_for("full", 2)))
        said = f"launch: {path} (dsv4-tp-full): starting 2 gloo ranks, each loading torch and building the model"
        launch = ("graphflow", "launch", "--nproc", "2", "--sizes", "1")
        assert before_torch(*launch, str(path)) == [said]
        assert [json.loads(line)["message"] for line in before_torch(*launch, "--json", str(path))] == [said]
        assert before_torch(*launch, "--quiet", str(path)) == []

    @pytest.mark.slow
    def test_json_reports_every_rank_and_quiet_only_the_result(self, tmp_path, capfd):
        from graphflow.plan.loader import dump_plan

        path = tmp_path / "tp.yaml"
        path.write_text(dump_plan(plan_for("full", 2)))
        assert main(["launch", "--nproc", "2", "--sizes", "1", "--json", str(path)]) == 0
        out, err = capfd.readouterr()
        doc = json.loads(out)
        assert (doc["ok"], doc["plan"], doc["backend"]) == (True, "dsv4-tp-full", "gloo")
        assert [(r["rank"], r["ok"], r["descriptors"], r["verify"]) for r in doc["ranks"]] == [
            (0, True, 1, "bit-exact"), (1, True, 1, "bit-exact")]
        assert "captured 1/1" not in err  # no progress with --json
        assert main(["launch", "--nproc", "2", "--sizes", "1", "--quiet", str(path)]) == 0
        out, err = capfd.readouterr()
        assert out == "dsv4-tp-full: captured on 2 rank(s) (gloo)\n" and "captured 1/1" not in err

    def test_a_plan_for_another_world_size_exits_2_naming_both(self, capsys):
        assert main(["launch", "--nproc", "3", str(PLANS / "dsv4_tp_full.yaml")]) == 2
        assert capsys.readouterr().err.strip().endswith(
            "the plan is written for world_size 2, --nproc is 3 — set world_size in the plan or launch 2 processes")
