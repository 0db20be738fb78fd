"""The dsv4 integration: its model pieces, its plans, and replay = eager over a decode.

The decode tests run graphflow's pipeline and runtime on the CPU backend (the GPU
version, every descriptor, is tests/cuda/test_cuda_dsv4.py).
"""

import pathlib

import attrs
import networkx as nx
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import PlanError
from graphflow.integrations.dsv4 import DSV4Config, build_model
from graphflow.integrations.dsv4.attention import PagedLayout, eager_attention, static_attention
from graphflow.integrations.dsv4.decode import decode_both, step_inputs
from graphflow.integrations.dsv4.mhc import sinkhorn
from graphflow.integrations.dsv4.model import check_plan
from graphflow.integrations.dsv4.moe import MoE, count_experts, uses_gather
from graphflow.integrations.dsv4.plans import plan_variant
from graphflow.integrations.dsv4.weights import WeightSource
from graphflow.plan.loader import load_plan
from graphflow.plan import Mode
from graphflow.runtime import Runner
from graphflow.plan.rules import validate

PLANS = pathlib.Path(__file__).resolve().parents[1] / "plans"
MINI = DSV4Config()


def _state(config: DSV4Config, batch: int, seed: int = 0):
    """A random pool and compressed cache, as if many steps had already run."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(config.num_blocks, config.block_size, config.kv_dim, generator=g)
    comp = torch.randn(batch, config.max_compressed, config.kv_dim, generator=g)
    return pool, comp


def _attention_case(layer: int, positions: list[int], *, seed: int, state_seed: int = 0):
    """The mini model, one of its layers, random ``q``/``kv`` for a batch at ``positions``,
    the positions as a tensor, and two equal copies of one cache state: the eager and
    the static attention each get their own, so their updates can be compared."""
    model = build_model()
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(positions), MINI.n_heads, MINI.kv_dim, generator=g)
    kv = torch.randn(len(positions), MINI.kv_dim, generator=g)
    pool, comp = _state(MINI, len(positions), seed=state_seed)
    return (model, model.layers[layer], q, kv, torch.tensor(positions), (pool, comp),
            (pool.clone(), comp.clone()))


class TestSinkhorn:
    def test_rows_and_columns_sum_to_one(self):
        logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(0))
        m = sinkhorn(logits, 50)
        assert torch.allclose(m.sum(-1), torch.ones(64, 4), atol=1e-6)
        assert torch.allclose(m.sum(-2), torch.ones(64, 4), atol=1e-6)
        assert bool((m > 0).all())

    def test_row_error_shrinks_with_iterations_and_columns_are_exact_after_each(self):
        logits = torch.randn(64, 4, 4, generator=torch.Generator().manual_seed(0))
        errors = []
        for iters in (4, 20):
            m = sinkhorn(logits, iters)
            errors.append(float((m.sum(-1) - 1).abs().max()))
            assert torch.allclose(m.sum(-2), torch.ones(64, 4), atol=1e-6)
        assert errors[1] < 1e-3 < errors[0]

    def test_a_doubly_stochastic_input_is_left_unchanged(self):
        uniform = torch.zeros(2, 4, 4)
        assert torch.allclose(sinkhorn(uniform, 3), torch.full((2, 4, 4), 0.25))


class TestCompressor:
    def test_a_compressed_entry_is_appended_exactly_every_m_tokens(self):
        config, m = MINI, MINI.compress_every
        model = build_model()
        layer = model.layers[0]
        pool = torch.zeros(config.num_blocks, config.block_size, config.kv_dim)
        comp = torch.zeros(1, config.max_compressed, config.kv_dim)
        q = torch.randn(1, config.n_heads, config.kv_dim)
        latents = torch.randn(3 * m + 2, config.kv_dim, generator=torch.Generator().manual_seed(1))
        for p in range(3 * m + 2):
            before = comp.clone()
            eager_attention(model.layout, layer.compressor, q, latents[p:p + 1], torch.tensor([p]), [p], pool, comp)
            changed = [c for c in range(config.max_compressed) if not torch.equal(before[0, c], comp[0, c])]
            if (p + 1) % m == 0:
                c = (p + 1) // m - 1
                assert changed == [c], f"position {p}"
                expected = layer.compressor(latents[p + 1 - m:p + 1].unsqueeze(0))
                assert torch.allclose(comp[0, c], expected[0], atol=1e-6)
            else:
                assert changed == [], f"position {p}"
        assert int((comp[0].abs().sum(-1) > 0).sum()) == (3 * m + 2) // m

    def test_the_static_form_appends_at_the_same_positions(self):
        config, m = MINI, MINI.compress_every
        model = build_model()
        layer = model.layers[0]
        pool = torch.zeros(config.num_blocks, config.block_size, config.kv_dim)
        comp = torch.zeros(1, config.max_compressed, config.kv_dim)
        q = torch.randn(1, config.n_heads, config.kv_dim)
        for p in range(2 * m):
            before = comp.clone()
            kv = torch.randn(1, config.kv_dim)
            static_attention(model.layout, layer.compressor, q, kv, torch.tensor([p]), pool, comp)
            appended = not torch.equal(before, comp)
            assert appended == ((p + 1) % m == 0), f"position {p}"


class TestAttentionForms:
    @pytest.mark.parametrize("positions", [[0], [3], [37], [0, 3, 4, 127, 64, 21, 22, 23]])
    def test_eager_and_static_attention_agree_on_the_same_state(self, positions):
        model, layer, q, kv, pos, (pool_e, comp_e), (pool_s, comp_s) = _attention_case(1, positions, seed=2)
        out_e = eager_attention(model.layout, layer.compressor, q, kv, pos, positions, pool_e, comp_e)
        out_s = static_attention(model.layout, layer.compressor, q, kv, pos, pool_s, comp_s)
        assert torch.allclose(out_e, out_s, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool_e, pool_s)
        assert torch.allclose(comp_e, comp_s, atol=1e-6)

    def test_sequences_live_on_pages_the_block_table_scatters(self):
        layout = PagedLayout(MINI, torch.device("cpu"))
        table = layout.block_table
        assert sorted(table.flatten().tolist()) == list(range(MINI.num_blocks))
        assert table[0].tolist() != list(range(MINI.blocks_per_seq))
        slots = layout.slots(torch.tensor([[0, MINI.block_size, MINI.block_size + 1]]))
        assert slots[0].tolist() == [int(table[0, 0]) * MINI.block_size, int(table[0, 1]) * MINI.block_size,
                                     int(table[0, 1]) * MINI.block_size + 1]


class TestHostPositions:
    """The eager attention sizes its work from positions kept on the host, never read back."""

    @pytest.mark.parametrize("name", ["dsv4_mini_piecewise.yaml", "dsv4_61l_decode.yaml"])
    def test_the_piecewise_plans_keep_a_host_copy_read_only_by_the_eager_attentions(self, name):
        plan = load_plan(PLANS / name)
        host = plan.buffer("positions_host")
        assert (host.device, host.role.value, host.shape) == ("cpu", "input", ("B",))
        assert host.values == plan.buffer("positions").values
        readers = [s for s in plan.segments if "positions_host" in s.reads]
        assert [s.name for s in readers] == [f"L{i}.attn" for i in range(plan.model_args["n_layers"])]
        assert not any(s.is_graph for s in readers)

    @pytest.mark.parametrize("name", ["dsv4_mini_full.yaml", "dsv4_61l_full.yaml"])
    def test_the_full_plans_keep_device_lengths_only(self, name):
        plan = load_plan(PLANS / name)
        assert plan.buffer("positions_host") is None
        assert {b.device for b in plan.buffers} == {"cuda:0"}

    def test_a_variant_gives_the_host_positions_the_new_range(self):
        plan = plan_variant(PLANS / "dsv4_61l_decode.yaml", sizes=(1, 8), n_layers=2, max_batch=8, max_len=64)
        assert plan.buffer("positions_host").values == plan.buffer("positions").values == (0, 64)

    def test_the_attention_takes_its_counts_from_the_host_buffer(self):
        # Device positions at 3 (no compressed entry yet), host positions at 9 (two): the
        # key set is then cut from the host's counts, so the result is eager_attention's
        # with the host's list, not with the device's.
        config = MINI
        model = build_model()
        layer = model.layers[0]
        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, config.n_heads, config.kv_dim, generator=g)
        kv = torch.randn(2, config.kv_dim, generator=g)
        pool, comp = _state(config, 2)
        device_positions, host_positions = torch.tensor([3, 3]), torch.tensor([9, 9])
        want = eager_attention(model.layout, layer.compressor, q, kv, device_positions, [9, 9], pool.clone(),
                               comp.clone())
        other = eager_attention(model.layout, layer.compressor, q, kv, device_positions, [3, 3], pool.clone(),
                                comp.clone())
        o = torch.empty_like(q)
        layer.attention(q, kv, device_positions, host_positions, pool, comp, o)
        assert torch.equal(o, want)
        assert not torch.equal(o, other)

    @pytest.mark.parametrize("positions", [[7], [3, 7, 11, 15], [0, 5, 6, 7, 8, 100, 101, 127]])
    def test_both_forms_append_and_attend_alike_when_every_or_some_sequence_is_due(self, positions):
        model, layer, q, kv, pos, (pool_e, comp_e), (pool_s, comp_s) = _attention_case(2, positions, seed=6,
                                                                                       state_seed=1)
        out_e = torch.empty_like(q)
        returned = eager_attention(model.layout, layer.compressor, q, kv, pos, positions, pool_e, comp_e, out_e)
        out_s = static_attention(model.layout, layer.compressor, q, kv, pos, pool_s, comp_s)
        assert returned is out_e
        assert torch.allclose(out_e, out_s, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool_e, pool_s)
        assert torch.allclose(comp_e, comp_s, atol=1e-6)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class TestExperts:
    def test_scatter_add_counts_equal_a_bincount_reference(self):
        ids = torch.randint(0, 8, (32, 2), generator=torch.Generator().manual_seed(3))
        counts = torch.zeros(8, dtype=torch.int64)
        count_experts(ids, counts)
        count_experts(ids[:5], counts)
        assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=8) + torch.bincount(ids[:5].flatten(), minlength=8))

    @pytest.mark.parametrize("experts,batch,gather", [(8, 1, False), (8, 16, False), (32, 1, True), (32, 2, False)])
    def test_the_moe_uses_no_data_dependent_shape_op_and_matches_a_per_token_loop(self, experts, batch, gather):
        config = attrs.evolve(MINI, n_experts=experts)
        moe = MoE(config, WeightSource(0, torch.device("cpu"), torch.float32))
        assert uses_gather(batch, config.top_k, experts) is gather  # both paths are covered
        h = torch.randn(batch, MINI.hidden_size, generator=torch.Generator().manual_seed(4))
        counts = torch.zeros(experts, dtype=torch.int64)
        with _OpLog() as log:
            out = moe(h, counts)
        assert not log.ops & {"bincount", "nonzero", "unique", "masked_select", "_unique2", "item",
                              "_local_scalar_dense"}
        assert "scatter_add_" in log.ops
        ids, weights = moe.router(h)
        expected = torch.stack([
            sum(weights[b, j] * (torch.nn.functional.silu(h[b] @ moe.w13[e, :, :MINI.moe_inter])
                                 * (h[b] @ moe.w13[e, :, MINI.moe_inter:])) @ moe.w2[e]
                for j, e in enumerate(ids[b].tolist()))
            for b in range(batch)])
        assert torch.allclose(out, expected, atol=1e-5)
        assert torch.equal(counts, torch.bincount(ids.flatten(), minlength=experts))

    def test_gather_is_chosen_only_while_the_chosen_experts_are_a_small_fraction(self):
        assert [uses_gather(b, 2, 64) for b in (1, 3, 4, 8)] == [True, True, False, False]
        assert not uses_gather(1, 2, 16)


class TestPlans:
    @pytest.mark.parametrize("name,layers,descriptors,mode", [
        ("dsv4_mini_piecewise.yaml", 4, 6, Mode.PIECEWISE),
        ("dsv4_mini_full.yaml", 4, 6, Mode.FULL),
        ("dsv4_61l_decode.yaml", 61, 67, Mode.PIECEWISE),
        ("dsv4_61l_full.yaml", 61, 67, Mode.FULL),
    ])
    def test_bundled_plans_validate_clean(self, name, layers, descriptors, mode):
        plan = load_plan(PLANS / name)
        assert validate(plan).diagnostics == ()
        assert plan.model_args["n_layers"] == layers
        assert len(plan.descriptors()) == descriptors
        assert plan.capture.modes == (mode,)
        assert sum(s.name.endswith(".attn") for s in plan.segments) == layers

    def test_the_61_layer_plan_has_the_foundation_descriptor_sizes(self):
        plan = load_plan(PLANS / "dsv4_61l_decode.yaml")
        assert plan.capture.sizes == (1, 2, 4, *range(8, 513, 8))

    def test_piecewise_breaks_at_attention_and_full_is_one_graph(self):
        piecewise = load_plan(PLANS / "dsv4_mini_piecewise.yaml")
        full = load_plan(PLANS / "dsv4_mini_full.yaml")
        regions = [r.segments for r in piecewise.regions(Mode.PIECEWISE)]
        assert len(regions) == 5  # [embed, L0.pre], [L0.res .. L0.ffn_out, L1.pre] ... [L3.res .. L3.ffn_out, head]
        assert regions[1] == ("L0.res", "L0.mix", "L0.ffn_res", "L0.shared", "L0.moe", "L0.ffn_out", "L1.pre")
        assert [r.segments for r in full.regions(Mode.FULL)][0][0] == "embed"
        assert len(full.regions(Mode.FULL)) == 1
        assert not any(s.kind.value == "eager" for s in full.segments)

    @pytest.mark.parametrize("name", ["dsv4_61l_decode.yaml", "dsv4_61l_full.yaml"])
    def test_the_61_layer_plans_agree_with_their_model_args(self, name):
        plan = load_plan(PLANS / name)
        check_plan(DSV4Config(**plan.model_args), plan)
        assert plan.buffer("kv_cache60").shape == (512 * 16, 16, 512)

    def test_a_variant_resizes_every_model_buffer(self):
        plan = plan_variant(PLANS / "dsv4_61l_full.yaml", sizes=(1, 8), n_layers=2, max_batch=8)
        assert validate(plan).diagnostics == ()
        assert plan.buffer("kv_cache1").shape == (8 * 16, 16, 512)
        assert plan.buffer("expert_load").shape == (2, 8)
        assert plan.segment("L2.attn") is None

    def test_a_plan_whose_shapes_disagree_with_model_args_is_refused_naming_the_buffer(self):
        plan = load_plan(PLANS / "dsv4_mini_full.yaml")
        args = {**plan.model_args, "kv_dim": 16}
        with pytest.raises(PlanError) as info:
            build_model(**args, plan=plan)
        assert info.value.element == "buffer q0"
        assert info.value.message == ("buffer 'q0' has shape [B, 4, 32] but the dsv4 model built from "
                                      "model_args needs [B, 4, 16] — fix the shape or model_args")
        assert info.value.line == 38


ALL_PLANS = ["dsv4_mini_piecewise.yaml", "dsv4_mini_full.yaml", "dsv4_61l_decode.yaml", "dsv4_61l_full.yaml",
             "dsv4_tp_piecewise.yaml", "dsv4_tp_full.yaml"]
#: A layer's side segments: (stream, the main-chain segment it forks after, the one that joins it).
SIDE = {"res": ("s1", "pre", "mix"), "ffn_res": ("s1", "mix", "ffn_out"), "shared": ("s2", "mix", "ffn_out")}


class TestSideStreams:
    """The Sinkhorn normalizations (s1) and the shared expert (s2) are segments of their own,
    which the plans' DAG leaves free to run beside the main chain (s0)."""

    @pytest.mark.parametrize("name", ALL_PLANS)
    def test_only_the_sinkhorns_and_the_shared_expert_leave_the_main_stream(self, name):
        plan = load_plan(PLANS / name)
        assert {s.name: s.device for s in plan.streams} == {"s0": "cuda:0", "s1": "cuda:0", "s2": "cuda:0"}
        off_main = {s.name: s.stream for s in plan.segments if s.stream != "s0"}
        assert off_main == {f"L{i}.{part}": stream for i in range(plan.model_args["n_layers"])
                            for part, (stream, _, _) in SIDE.items()}

    @pytest.mark.parametrize("name", ALL_PLANS)
    def test_each_side_segment_waits_only_for_its_fork_and_is_awaited_only_after_its_join(self, name):
        # The transients (res_logits, h, ffn_*, shared_out, moe_out) are one buffer for all
        # layers: the write-after-read edges that reuse adds must not order a side segment
        # later than its fork point or earlier than its join, or it would lose its overlap.
        plan = load_plan(PLANS / name)
        dag = plan.dag()
        for i in range(plan.model_args["n_layers"]):
            for part, (_, fork, join) in SIDE.items():
                segment, fork, join = f"L{i}.{part}", f"L{i}.{fork}", f"L{i}.{join}"
                assert fork in dag.predecessors(segment) and join in dag.successors(segment)
                for before in dag.predecessors(segment):
                    assert before == fork or nx.has_path(dag, before, fork), (segment, before)
                for after in dag.successors(segment):
                    assert after == join or nx.has_path(dag, join, after), (segment, after)

    @pytest.mark.parametrize("name", ["dsv4_mini_full.yaml", "dsv4_tp_full.yaml"])
    def test_the_side_segments_are_unordered_against_attention_and_the_routed_experts(self, name):
        plan = load_plan(PLANS / name)
        dag = plan.dag()
        for i in range(plan.model_args["n_layers"]):
            for a, b in (("res", "attn"), ("ffn_res", "moe"), ("shared", "moe"), ("ffn_res", "shared")):
                a, b = f"L{i}.{a}", f"L{i}.{b}"
                assert not nx.has_path(dag, a, b) and not nx.has_path(dag, b, a), (a, b)

    @pytest.mark.parametrize("name", ["dsv4_tp_piecewise.yaml", "dsv4_tp_full.yaml"])
    def test_every_all_reduce_stays_on_the_main_stream_two_a_layer(self, name):
        plan = load_plan(PLANS / name)
        users = [(s.name, s.stream) for s in plan.segments if "tp_ar" in s.channels]
        layers = range(plan.model_args["n_layers"])
        assert users == [(f"L{i}.{part}", "s0") for i in layers for part in ("mix", "ffn_out")]


@pytest.fixture(scope="module", params=["dsv4_mini_piecewise.yaml", "dsv4_mini_full.yaml"])
def engine(request):
    engine = run_pipeline(load_plan(PLANS / request.param), RunOptions(backend="cpu", sizes=(1, 8)))
    yield engine
    engine.close()


class TestDecodeReplay:
    def test_every_descriptor_verified_bit_exact(self, engine):
        assert [(v.descriptor.size, v.bit_exact) for v in engine.report.verify] == [(8, True), (1, True)]

    @pytest.mark.parametrize("size", [1, 8])
    def test_64_step_greedy_decode_replays_bit_for_bit(self, engine, size):
        replayed, eager = decode_both(engine, size, 64)
        assert torch.equal(replayed.tokens, eager.tokens)
        for step in range(64):
            assert torch.equal(replayed.logits[step], eager.logits[step]), f"logits differ at step {step}"

    def test_the_runner_fills_the_host_positions_on_the_cpu_and_zeroes_the_padding(self, engine):
        runner = Runner(engine)
        piecewise = engine.plan.buffer("positions_host") is not None
        assert runner.inputs == (("tokens", "positions", "positions_host") if piecewise else ("tokens", "positions"))
        inputs = step_inputs(runner.inputs, torch.tensor([1, 2, 3]), [5, 6, 7])
        runner.run(*inputs)
        views = engine.buffers.views(8)
        assert views["positions"].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
        if piecewise:
            assert views["positions_host"].device.type == "cpu"
            assert views["positions_host"].tolist() == [5, 6, 7, 0, 0, 0, 0, 0]

    def test_the_decode_refuses_an_input_it_cannot_supply(self):
        with pytest.raises(ValueError) as info:
            step_inputs(("tokens", "lengths"), torch.tensor([1]), [0])
        assert str(info.value) == "the dsv4 decode supplies tokens, positions and positions_host, not ['lengths']"

    def test_both_plans_decode_the_same_tokens(self):
        traces = []
        for name in ("dsv4_mini_piecewise.yaml", "dsv4_mini_full.yaml"):
            with run_pipeline(load_plan(PLANS / name), RunOptions(backend="cpu", sizes=(4,), verify=False)) as engine:
                traces.append(decode_both(engine, 4, 24)[0])
        assert torch.equal(traces[0].tokens, traces[1].tokens)
        assert torch.allclose(traces[0].logits, traces[1].logits, atol=1e-4)
