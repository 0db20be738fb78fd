"""The decoder and the segment entry points the dsv4 plans call.

Each entry point has the engine's calling convention: ``fn(*reads, *writes)`` with the
segment's buffers as views for the current batch size, writing its outputs in place
and returning nothing. A segment talks to the next only through those buffers; the
only tensors the model owns are its weights and the block table, which never change.

One decode step (T = 1), per plan (stream in brackets):

    embed:                  tokens, positions → x (streams), rope (cos | sin)
    per layer  pre     [s0] x, rope → q, kv (roped latents), post_mix, res_logits
               attn    [s0] eager (Python-int counts from positions_host, a host buffer)
                            or static (device counts, FULL) → o
               res     [s1] res_logits → res_mix (Sinkhorn)
               mix     [s0] o, post_mix, res_mix, x → x (mixed), h, ffn_post, ffn_logits
               ffn_res [s1] ffn_logits → ffn_res (Sinkhorn)
               shared  [s2] h → shared_out (shared expert)
               moe     [s0] h → moe_out (router, expert counts, routed experts)
               ffn_out [s0] x, moe_out + shared_out, ffn_post, ffn_res → x
    head:                   x → logits

The Sinkhorn normalizations and the shared expert depend on nothing else the main
chain computes, so they are segments of their own on side streams (s1, s2): an engine
that forks the plan's DAG across streams runs them concurrently with attention and
the routed experts (docs/dsv4.md: 20.4 → 17.0 ms a FULL step on an H200).

The plans are declared here too, with graphflow's decorators: ``piecewise_step`` and
``full_step`` call the entry points in that order, and
``graphflow.plan_from_module(model, step=...)`` gives plans equal to
``plans/dsv4_mini_piecewise.yaml`` and ``plans/dsv4_mini_full.yaml`` (docs/decorators.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import graphflow
from graphflow.errors import PlanError
from graphflow.integrations.dsv4.attention import Compressor, PagedLayout, eager_attention, static_attention
from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.kernels import cute_available, jit_kernel, rms_norm
from graphflow.integrations.dsv4.mhc import HyperConnection
from graphflow.integrations.dsv4.moe import MoE, SharedExpert
from graphflow.integrations.dsv4.rope import apply_rope, rope_table
from graphflow.integrations.dsv4.weights import WeightSource

__all__ = ["DSV4Model", "DecoderLayer", "build_model", "check_plan", "check_rms_kernel", "check_shapes", "expected_shapes"]

#: The device the plans name; the engine places the buffers there.
_DEVICE = "cuda:0"
#: The descriptor sizes of the mini plans.
_MINI_SIZES = (1, 2, 4, 8, 16, 32)
#: The buffers one layer uses and the next overwrites, shared by all layers (docs/dsv4.md).
_TRANSIENTS = ("res_logits", "h", "ffn_post", "ffn_logits", "ffn_res", "shared_out", "moe_out")


def _declared_shape(stem: str):
    """A buffer declaration's shape, read from the module's config (see ``expected_shapes``)."""
    return lambda module: expected_shapes(module.config)[stem]


def _model_dtype(module) -> str:
    return module.config.dtype


class DecoderLayer(nn.Module):
    layer = graphflow.position()
    q = graphflow.buffer("q{layer}", shape=_declared_shape("q"), dtype=_model_dtype, device=_DEVICE)
    kv = graphflow.buffer("kv{layer}", shape=_declared_shape("kv"), dtype=_model_dtype, device=_DEVICE)
    post_mix = graphflow.buffer("post_mix{layer}", shape=_declared_shape("post_mix"), dtype=_model_dtype,
                                device=_DEVICE)
    res_mix = graphflow.buffer("res_mix{layer}", shape=_declared_shape("res_mix"), dtype=_model_dtype,
                               device=_DEVICE)
    o = graphflow.buffer("o{layer}", shape=_declared_shape("o"), dtype=_model_dtype, device=_DEVICE)
    kv_cache = graphflow.buffer("kv_cache{layer}", shape=_declared_shape("kv_cache"), dtype=_model_dtype,
                                device=_DEVICE, role="state")  # paged: max_batch seqs x blocks_per_seq
    comp_cache = graphflow.buffer("comp_cache{layer}", shape=_declared_shape("comp_cache"), dtype=_model_dtype,
                                  device=_DEVICE, role="state", pad="keep")  # a row per sequence: padding keeps it

    def __init__(self, index: int, config: DSV4Config, layout: PagedLayout, source: WeightSource):
        super().__init__()
        d = config.hidden_size
        self.index = index
        self.config = config
        self.layout = layout
        self.attn_mix = HyperConnection(d, config.hc_streams, config.sinkhorn_iters, config.norm_eps, source,
                                        config.rms_kernel)
        self.attn_norm = source.ones(d)
        # q for every head and the new token's latent in one projection: [d, (H + 1) * kv_dim].
        self.qkv = source.normal(d, (config.n_heads + 1) * config.kv_dim)
        self.compressor = Compressor(config, source)
        self.out = source.normal(config.n_heads * config.kv_dim, d)
        self.ffn_mix = HyperConnection(d, config.hc_streams, config.sinkhorn_iters, config.norm_eps, source,
                                       config.rms_kernel)
        self.ffn_norm = source.ones(d)
        self.moe = MoE(config, source)
        self.shared = SharedExpert(config, source)
        # Where this layer's expert counts start in the flat [layers * experts] view of
        # expert_load, as a tensor: torch.compile specializes on an int attribute, and
        # one compile of routed_experts then serves every layer.
        self.register_buffer("load_offset", torch.tensor(index * config.n_experts, device=source.device),
                             persistent=False)

    @graphflow.segment("L{layer}.pre", stream="s0", reads=["x", "rope"],
                       writes=["q{layer}", "kv{layer}", "post_mix{layer}", "res_logits"])
    def pre_attention(self, x, rope, q, kv, post_mix, res_logits) -> None:
        """x [B, n, d], rope [B, r] → q [B, H, kv_dim], kv [B, kv_dim], post_mix [B, n], res_logits [B, n, n].

        The heads are q's: a tensor-parallel shard (tp.py) runs this with its own ``qkv``
        columns and a q of its heads only.
        """
        c = self.config
        heads = q.shape[1]
        h_pre, h_post, logits = self.attn_mix.gates(x)
        h = rms_norm(HyperConnection.pre(x, h_pre), self.attn_norm, c.norm_eps, c.rms_kernel)
        qkv = torch.matmul(h, self.qkv).view(-1, heads + 1, c.kv_dim)
        qkv[..., : c.rope_dim] = apply_rope(qkv[..., : c.rope_dim], rope)
        q.copy_(qkv[:, :heads])
        kv.copy_(qkv[:, heads])
        post_mix.copy_(h_post)
        res_logits.copy_(logits)

    @graphflow.eager_break("L{layer}.attn", stream="s0",
                           reads=["q{layer}", "kv{layer}", "positions", "positions_host", "kv_cache{layer}",
                                  "comp_cache{layer}"],
                           writes=["o{layer}", "kv_cache{layer}", "comp_cache{layer}"])
    def attention(self, q, kv, positions, positions_host, kv_cache, comp_cache, o) -> None:
        """The eager break: counts are Python ints (not capturable), read from the host copy
        of the positions, so the GPU is never waited for (see docs/dsv4.md)."""
        eager_attention(self.layout, self.compressor, q, kv, positions, positions_host.tolist(), kv_cache,
                        comp_cache, o)

    @graphflow.segment("L{layer}.attn", stream="s0",
                       reads=["q{layer}", "kv{layer}", "positions", "kv_cache{layer}", "comp_cache{layer}"],
                       writes=["o{layer}", "kv_cache{layer}", "comp_cache{layer}"])
    def static_attention(self, q, kv, positions, kv_cache, comp_cache, o) -> None:
        """The capturable form: counts on the device, shapes fixed by the batch size."""
        static_attention(self.layout, self.compressor, q, kv, positions, kv_cache, comp_cache, o)

    @graphflow.segment("L{layer}.res", stream="s1", reads=["res_logits"], writes=["res_mix{layer}"])
    def attention_residual(self, res_logits, res_mix) -> None:
        """res_logits [B, n, n] → res_mix [B, n, n], Sinkhorn-normalized: on s1, beside the attention."""
        res_mix.copy_(self.attn_mix.residual_mix(res_logits))

    @graphflow.segment("L{layer}.mix", stream="s0",
                       reads=["o{layer}", "post_mix{layer}", "res_mix{layer}", "x"],
                       writes=["x", "h", "ffn_post", "ffn_logits"])
    def post_attention(self, o, post_mix, res_mix, x, h, ffn_post, ffn_logits) -> None:
        """o [B, H, kv_dim] projected and mixed into x [B, n, d] in place; the FFN's input h [B, d],
        its post_mix [B, n] and residual-mix logits [B, n, n]."""
        self.mix_streams(torch.matmul(o.flatten(1), self.out), post_mix, res_mix, x, h, ffn_post, ffn_logits)

    def mix_streams(self, attn, post_mix, res_mix, x, h, ffn_post, ffn_logits) -> None:
        """The attention output attn [B, d] mixed into x; then the FFN's gates, pre-mix and norm."""
        x.copy_(HyperConnection.post(x, attn, post_mix, res_mix))
        h_pre, h_post, logits = self.ffn_mix.gates(x)
        h.copy_(rms_norm(HyperConnection.pre(x, h_pre), self.ffn_norm, self.config.norm_eps, self.config.rms_kernel))
        ffn_post.copy_(h_post)
        ffn_logits.copy_(logits)

    @graphflow.segment("L{layer}.ffn_res", stream="s1", reads=["ffn_logits"], writes=["ffn_res"])
    def ffn_residual(self, ffn_logits, ffn_res) -> None:
        """ffn_logits [B, n, n] → ffn_res [B, n, n], Sinkhorn-normalized: on s1, beside the experts."""
        ffn_res.copy_(self.ffn_mix.residual_mix(ffn_logits))

    @graphflow.segment("L{layer}.shared", stream="s2", reads=["h"], writes=["shared_out"])
    def shared_expert(self, h, shared_out) -> None:
        """h [B, d] → shared_out [B, d]: on s2, beside the routed experts."""
        shared_out.copy_(self.shared(h))

    @graphflow.segment("L{layer}.moe", stream="s0", data_dependent=True, reads=["h", "expert_load"],
                       writes=["moe_out", "expert_load"])
    def routed_experts(self, h, expert_load, moe_out) -> None:
        """h [B, d] → moe_out [B, d]; this layer's expert counts into expert_load."""
        moe_out.copy_(self.moe(h, expert_load.view(-1), self.load_offset))

    @graphflow.segment("L{layer}.ffn_out", stream="s0", reads=["x", "moe_out", "shared_out", "ffn_post", "ffn_res"],
                       writes=["x"])
    def post_ffn(self, x, moe_out, shared_out, ffn_post, ffn_res) -> None:
        """The FFN's output moe_out + shared_out [B, d] mixed into x [B, n, d] in place."""
        x.copy_(HyperConnection.post(x, moe_out + shared_out, ffn_post, ffn_res))


class DSV4Model(nn.Module):
    """Random-weight DeepSeek-V4-style decoder; see the module docstring for its segments."""

    tokens = graphflow.buffer(shape=_declared_shape("tokens"), dtype="int64", device=_DEVICE, role="input",
                              values=lambda m: (0, m.config.vocab_size))
    positions = graphflow.buffer(shape=_declared_shape("positions"), dtype="int64", device=_DEVICE, role="input",
                                 values=lambda m: (0, m.config.max_len))
    # The same positions on the host: the eager attention sizes its work from them without a sync.
    positions_host = graphflow.buffer(shape=_declared_shape("positions_host"), dtype="int64", device="cpu",
                                      role="input", values=lambda m: (0, m.config.max_len))
    x = graphflow.buffer(shape=_declared_shape("x"), dtype=_model_dtype, device=_DEVICE)  # hyper-connection streams
    rope = graphflow.buffer(shape=_declared_shape("rope"), dtype=_model_dtype, device=_DEVICE)  # cos | sin
    expert_load = graphflow.buffer(shape=_declared_shape("expert_load"), dtype="int64", device=_DEVICE,
                                   role="state")
    logits = graphflow.buffer(shape=_declared_shape("logits"), dtype="float32", device=_DEVICE, role="output")
    # A layer's transients, one buffer each for all layers: a layer ends joined on s0
    # (ffn_out), so the next layer's writes wait for nothing the DAG does not already
    # order (docs/dsv4.md, "Buffers").
    res_logits = graphflow.buffer(shape=_declared_shape("res_logits"), dtype=_model_dtype, device=_DEVICE)
    h = graphflow.buffer(shape=_declared_shape("h"), dtype=_model_dtype, device=_DEVICE)  # the FFN's input
    ffn_post = graphflow.buffer(shape=_declared_shape("ffn_post"), dtype=_model_dtype, device=_DEVICE)
    ffn_logits = graphflow.buffer(shape=_declared_shape("ffn_logits"), dtype=_model_dtype, device=_DEVICE)
    ffn_res = graphflow.buffer(shape=_declared_shape("ffn_res"), dtype=_model_dtype, device=_DEVICE)
    shared_out = graphflow.buffer(shape=_declared_shape("shared_out"), dtype=_model_dtype, device=_DEVICE)
    moe_out = graphflow.buffer(shape=_declared_shape("moe_out"), dtype=_model_dtype, device=_DEVICE)
    s0 = graphflow.stream(device=_DEVICE)  # the main chain
    s1 = graphflow.stream(device=_DEVICE)  # the Sinkhorn normalizations
    s2 = graphflow.stream(device=_DEVICE)  # the shared expert

    def __init__(self, config: DSV4Config, device: torch.device):
        super().__init__()
        self.config = config
        source = WeightSource(config.seed, device, getattr(torch, config.dtype))
        self.layout = PagedLayout(config, device)
        self.embedding = source.normal(config.vocab_size, config.hidden_size, std=1.0)
        self.layers = nn.ModuleList(DecoderLayer(i, config, self.layout, source) for i in range(config.n_layers))
        # The head reads the streams through fixed weights (softmax of a seeded vector).
        self.head_mix = nn.Parameter(torch.softmax(source.normal(config.hc_streams, std=1.0).float(), 0)
                                     .to(source.dtype), requires_grad=False)
        self.final_norm = source.ones(config.hidden_size)
        self.lm_head = source.normal(config.hidden_size, config.vocab_size)

    @graphflow.step(name="dsv4-mini-piecewise", sizes=_MINI_SIZES, modes=["PIECEWISE"])
    def piecewise_step(self, bufs) -> None:
        """One decode step, eager attention between two graphs a layer; ``bufs``: buffer name → view."""
        decode_step(self, bufs, static=False)

    @graphflow.step(name="dsv4-mini-full", sizes=_MINI_SIZES, modes=["FULL"])
    def full_step(self, bufs) -> None:
        """One decode step with static attention: one graph, no eager break."""
        decode_step(self, bufs, static=True)

    @graphflow.segment("embed", stream="s0", reads=["tokens", "positions"], writes=["x", "rope"])
    def embed(self, tokens, positions, x, rope) -> None:
        """tokens [B] → every stream of x [B, n, d]; positions [B] → rope [B, r]."""
        c = self.config
        x.copy_(F.embedding(tokens, self.embedding).unsqueeze(1).expand_as(x))
        rope.copy_(rope_table(positions, c.rope_dim, c.rope_base, rope.dtype))

    @graphflow.segment("head", stream="s0", reads=["x"], writes=["logits"])
    def head(self, x, logits) -> None:
        """x [B, n, d] → logits [B, vocab] (float32)."""
        c = self.config
        h = torch.matmul(self.head_mix, x)  # [B, d]
        logits.copy_(torch.matmul(rms_norm(h, self.final_norm, c.norm_eps, c.rms_kernel), self.lm_head))


def decode_step(model, bufs, *, static: bool) -> None:
    """One decode step in the plans' segment order; ``bufs`` maps buffer name to view.

    Shared by ``DSV4Model`` and the tensor-parallel ``TPModel``, whose layers expose the
    same segment methods; ``static`` picks the FULL plan's static attention.
    """
    x, rope, positions, expert_load = bufs["x"], bufs["rope"], bufs["positions"], bufs["expert_load"]
    res_logits, h, ffn_post, ffn_logits, ffn_res, shared_out, moe_out = (bufs[name] for name in _TRANSIENTS)
    model.embed(bufs["tokens"], positions, x, rope)
    for i, layer in enumerate(model.layers):
        q, kv, o, post_mix, res_mix = (bufs[f"{stem}{i}"] for stem in ("q", "kv", "o", "post_mix", "res_mix"))
        kv_cache, comp_cache = bufs[f"kv_cache{i}"], bufs[f"comp_cache{i}"]
        layer.pre_attention(x, rope, q, kv, post_mix, res_logits)
        if static:
            layer.static_attention(q, kv, positions, kv_cache, comp_cache, o)
        else:
            layer.attention(q, kv, positions, bufs["positions_host"], kv_cache, comp_cache, o)
        layer.attention_residual(res_logits, res_mix)
        layer.post_attention(o, post_mix, res_mix, x, h, ffn_post, ffn_logits)
        layer.ffn_residual(ffn_logits, ffn_res)
        layer.shared_expert(h, shared_out)
        layer.routed_experts(h, expert_load, moe_out)
        layer.post_ffn(x, moe_out, shared_out, ffn_post, ffn_res)
    model.head(x, bufs["logits"])


def expected_shapes(config: DSV4Config) -> dict[str, tuple]:
    """The buffer shapes the model's entry points assume, by buffer name prefix ("B": batch)."""
    c = config
    return {
        "tokens": ("B",),
        "positions": ("B",),
        "positions_host": ("B",),
        "x": ("B", c.hc_streams, c.hidden_size),
        "rope": ("B", c.rope_dim),
        "q": ("B", c.n_heads, c.kv_dim),
        "kv": ("B", c.kv_dim),
        "post_mix": ("B", c.hc_streams),
        "res_mix": ("B", c.hc_streams, c.hc_streams),
        "o": ("B", c.n_heads, c.kv_dim),
        "res_logits": ("B", c.hc_streams, c.hc_streams),
        "h": ("B", c.hidden_size),
        "ffn_post": ("B", c.hc_streams),
        "ffn_logits": ("B", c.hc_streams, c.hc_streams),
        "ffn_res": ("B", c.hc_streams, c.hc_streams),
        "shared_out": ("B", c.hidden_size),
        "moe_out": ("B", c.hidden_size),
        "kv_cache": (c.num_blocks, c.block_size, c.kv_dim),
        "comp_cache": ("B", c.max_compressed, c.kv_dim),
        "expert_load": (c.n_layers, c.n_experts),
        "logits": ("B", c.vocab_size),
    }


def check_plan(config: DSV4Config, plan) -> None:
    """Fail at build time, naming the buffer, when a plan's shapes disagree with model_args."""
    check_shapes(plan, expected_shapes(config), lambda buffer, want: (
        f"buffer {buffer.name!r} has shape {_shape(buffer.shape)} but the dsv4 model built from "
        f"model_args needs {_shape(want)} — fix the shape or model_args"))


def check_shapes(plan, expected: dict[str, tuple], message) -> None:
    """Raise a PlanError at the first buffer whose shape is not ``expected`` of it.

    ``expected`` is keyed by buffer name without its layer number, with ``"B"`` for the
    plan's size symbol; ``message(buffer, want)`` says what is wrong and the fix, which
    differs between the single-device and tensor-parallel models.
    """
    symbol = plan.capture.size_symbol
    for buffer in plan.buffers:
        want = expected.get(buffer.name.rstrip("0123456789"))
        if want is None:
            continue
        want = tuple(symbol if dim == "B" else dim for dim in want)
        if tuple(buffer.shape) != want:
            origin = plan.origin("buffer", buffer.name)
            raise PlanError(message(buffer, want), **({"file": origin.file, "line": origin.line} if origin else {}),
                            element=f"buffer {buffer.name}")


def _shape(shape) -> str:
    return "[" + ", ".join(str(dim) for dim in shape) + "]"


def build_model(*, device: str | torch.device = "cpu", plan=None, rank: int = 0, world_size: int = 1,
                channels=None, **model_args) -> DSV4Model:
    """The factory plans name: ``graphflow.integrations.dsv4:build_model``.

    ``model_args`` are ``DSV4Config`` fields. The model runs on one device and uses no
    collectives, so it takes ``rank``, ``world_size`` and ``channels`` (which the engine
    offers to any factory that accepts keywords) only to refuse a multi-rank run.
    """
    if world_size != 1:
        raise ValueError(f"the dsv4 model runs on one device (got world_size={world_size}, rank={rank})")
    config = DSV4Config(**model_args)
    if plan is not None:
        check_plan(config, plan)
    check_rms_kernel(config, torch.device(device))
    return DSV4Model(config, torch.device(device))


def check_rms_kernel(config: DSV4Config, device: torch.device) -> None:
    """Refuse a CUDA model whose plan asks for the CuTe DSL RMSNorm where it is not installed;
    else register the plan's JIT kernel now, so a pipeline sees it in graphflow.engine.jit.registry
    from its first event (kernels otherwise register at their first call)."""
    if device.type != "cuda" or config.rms_kernel == "torch":
        return
    if config.rms_kernel == "cute" and not cute_available():
        raise ValueError("model_args rms_kernel: cute needs nvidia-cutlass-dsl (pip install 'graphflow[cutedsl]'); "
                         "install it, or set rms_kernel: triton or torch")
    jit_kernel(config.rms_kernel)
