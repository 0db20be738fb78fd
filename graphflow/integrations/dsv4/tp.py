"""The dsv4 decoder split across ranks: attention heads and experts sharded, one all-reduce each.

Each rank builds the whole seeded model (the weights are random, drawn the same on every
rank) and keeps its shard, so a tensor-parallel step equals the unsharded one up to
summation order. Per rank, with ``W`` ranks and ``r`` this rank:

* attention: heads ``[r*H/W, (r+1)*H/W)``. The latent (MQA: one key/value per token)
  and its caches are replicated: every rank writes the same latent into its own cache.
  The output projection is row-parallel; its partial sum is all-reduced on ``tp_ar``
  in the layer's ``mix`` segment.
* MoE: the router is replicated (every rank picks the same top-k of all experts);
  a rank runs experts ``[r*E/W, (r+1)*E/W)`` with the other experts' weights zeroed in
  its routing (``moe``, on s0), plus its slice of the shared expert's intermediate
  dimension (``shared``, on s2). The layer's ``ffn_out`` segment adds the two partial
  sums and all-reduces them once, on ``tp_ar``.
* embedding, hyper-connections, norms and the head are replicated.

So a layer makes two all-reduces of ``[B, d]``, always, whatever the routing, both in
segments on s0 (``mix`` and ``ffn_out``): the collective sequence depends on the batch
size alone, the same on every rank, which is what lets FULL capture record it. The
segments and their order are the dense model's (model.py), run by the same
``decode_step``.

The plans ``plans/dsv4_tp_piecewise.yaml`` and ``plans/dsv4_tp_full.yaml`` are written
for 2 ranks; ``plans.plan_variant(path, world_size=N)`` gives the plan for another number of ranks
(the sharded buffers ``q`` and ``o`` hold ``n_heads / world_size`` heads). See docs/tp.md.
"""

from __future__ import annotations

import torch
from torch import nn

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.mhc import HyperConnection
from graphflow.integrations.dsv4.model import (DecoderLayer, DSV4Model, check_rms_kernel, check_shapes, decode_step,
                                              expected_shapes)
from graphflow.integrations.dsv4.moe import count_experts, dense, gathered, swiglu, uses_gather

__all__ = ["TPDecoderLayer", "TPModel", "Shard", "build_tp_model", "tp_shapes"]

#: The channel every all-reduce of the model goes through.
TP_CHANNEL = "tp_ar"


class Shard:
    """One rank's slice of a dimension of ``total`` split ``world_size`` ways."""

    def __init__(self, total: int, rank: int, world_size: int, what: str):
        if total % world_size:
            raise ValueError(f"{what} ({total}) must be divisible by world_size ({world_size})")
        self.size = total // world_size
        self.start = rank * self.size
        self.stop = self.start + self.size

    def __repr__(self) -> str:
        return f"Shard({self.start}:{self.stop})"


class _SingleRank:
    """The all-reduce of a group of one rank: the identity."""

    @staticmethod
    def all_reduce(tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.contiguous().clone(), requires_grad=False)


class TPDecoderLayer(nn.Module):
    """One decoder layer's shard; same entry points and calling convention as ``DecoderLayer``."""

    def __init__(self, full: DecoderLayer, rank: int, world_size: int, tp, reduce: torch.Tensor):
        super().__init__()
        c = full.config
        self.index, self.config, self.layout, self.tp = full.index, c, full.layout, tp
        self.register_buffer("reduce", reduce, persistent=False)  # [max_batch, d], shared by the layers
        self.heads = Shard(c.n_heads, rank, world_size, "n_heads")
        self.experts = Shard(c.n_experts, rank, world_size, "n_experts")
        inter = Shard(c.shared_inter, rank, world_size, "shared_inter")
        # Replicated: mixing, norms, the compressor and the router.
        self.attn_mix, self.attn_norm, self.compressor = full.attn_mix, full.attn_norm, full.compressor
        self.ffn_mix, self.ffn_norm, self.router = full.ffn_mix, full.ffn_norm, full.moe.router
        # This rank's heads' queries, then the shared latent: [d, (H/W + 1) * kv_dim].
        qkv = full.qkv.view(c.hidden_size, c.n_heads + 1, c.kv_dim)
        self.qkv = _frozen(torch.cat([qkv[:, self.heads.start:self.heads.stop], qkv[:, c.n_heads:]], 1)
                           .flatten(1))
        self.out = _frozen(full.out[self.heads.start * c.kv_dim:self.heads.stop * c.kv_dim])  # [H/W * kv_dim, d]
        self.w13 = _frozen(full.moe.w13[self.experts.start:self.experts.stop])  # [E/W, d, 2f]
        self.w2 = _frozen(full.moe.w2[self.experts.start:self.experts.stop])  # [E/W, f, d]
        gate, up = full.shared.w13.chunk(2, dim=-1)  # column-parallel halves, each [d, f_shared]
        self.shared_w13 = _frozen(torch.cat([gate[:, inter.start:inter.stop], up[:, inter.start:inter.stop]], 1))
        self.shared_w2 = _frozen(full.shared.w2[inter.start:inter.stop])  # row-parallel: [f_shared/W, d]

    # Attention, and everything around it but the output projection, runs on this rank's
    # heads as the whole layer runs on all of them: these methods read only the layout,
    # the compressor, the mixing and norm weights, ``qkv`` (this rank's columns) and the
    # shapes of q and o.
    pre_attention = DecoderLayer.pre_attention
    attention = DecoderLayer.attention  # the eager break (PIECEWISE)
    static_attention = DecoderLayer.static_attention  # the capturable form (FULL)
    attention_residual = DecoderLayer.attention_residual
    mix_streams = DecoderLayer.mix_streams
    ffn_residual = DecoderLayer.ffn_residual

    def post_attention(self, o, post_mix, res_mix, x, h, ffn_post, ffn_logits) -> None:
        """o [B, H/W, kv_dim] → x [B, n, d] in place after the first all-reduce; the FFN's inputs."""
        reduce = self.reduce[: o.shape[0]]
        torch.matmul(o.flatten(1), self.out, out=reduce)  # this rank's heads' share of the projection
        self.tp.all_reduce(reduce)
        self.mix_streams(reduce, post_mix, res_mix, x, h, ffn_post, ffn_logits)

    def shared_expert(self, h, shared_out) -> None:
        """h [B, d] → shared_out [B, d], this rank's slice of the shared expert (a partial sum)."""
        shared_out.copy_(torch.matmul(swiglu(torch.matmul(h, self.shared_w13)), self.shared_w2))

    def routed_experts(self, h, expert_load, moe_out) -> None:
        """h [B, d] → moe_out [B, d], this rank's experts' partial sum; counts of all experts into expert_load."""
        ids, weights = self.router(h)
        count_experts(ids, expert_load[self.index])
        moe_out.copy_(self.routed(h, ids, weights))

    def post_ffn(self, x, moe_out, shared_out, ffn_post, ffn_res) -> None:
        """The partial sums added, all-reduced once, and mixed into x [B, n, d] in place."""
        reduce = self.reduce[: x.shape[0]]
        torch.add(moe_out, shared_out, out=reduce)
        self.tp.all_reduce(reduce)
        x.copy_(HyperConnection.post(x, reduce, ffn_post, ffn_res))

    def routed(self, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """This rank's experts' share of the routed FFN, h [B, d] → [B, d].

        The path (gather or dense) is the unsharded model's, chosen by the batch size; a
        (token, expert) pair of another rank's expert gets weight zero here.
        """
        local = ids - self.experts.start
        mine = (local >= 0) & (local < self.experts.size)
        weights = weights * mine.to(weights.dtype)
        if uses_gather(h.shape[0], ids.shape[1], self.config.n_experts):
            return gathered(h, local.clamp(0, self.experts.size - 1), weights, self.w13, self.w2)
        routing = torch.zeros(h.shape[0], self.config.n_experts, device=h.device, dtype=h.dtype)
        routing.scatter_(1, ids, weights)
        return dense(h, routing[:, self.experts.start:self.experts.stop], self.w13, self.w2)  # [B, E/W] of them


class TPModel(nn.Module):
    """A rank's shard of ``DSV4Model``, built from the whole model; entry points as in the plans.

    ``tp`` is the handle every all-reduce goes through (``channels["tp_ar"]``).
    ``layer_type`` builds each layer's shard from the whole layer.

    Every all-reduce runs in place on one model-owned buffer (``reduce``, [max_batch, d]),
    never on a temporary: a custom all-reduce needs its input at a fixed, registered
    address, and a collective library that keeps a reference to its input after the
    call (gloo's work objects do, briefly) must not keep alive memory of the graph pool.
    """

    def __init__(self, full: DSV4Model, rank: int, world_size: int, tp, *,
                 layer_type: type[TPDecoderLayer] = TPDecoderLayer):
        super().__init__()
        self.config, self.layout, self.rank, self.world_size = full.config, full.layout, rank, world_size
        self.embedding, self.head_mix = full.embedding, full.head_mix
        self.final_norm, self.lm_head = full.final_norm, full.lm_head
        c = full.config
        self.register_buffer("reduce", torch.zeros(c.max_batch, c.hidden_size, device=full.embedding.device,
                                                   dtype=full.embedding.dtype), persistent=False)
        self.layers = nn.ModuleList(layer_type(layer, rank, world_size, tp, self.reduce) for layer in full.layers)

    # Embedding and head are replicated, so a rank runs the whole model's (x [B, n, d],
    # logits [B, vocab] the same on every rank).
    embed = DSV4Model.embed
    head = DSV4Model.head

    def step(self, bufs, *, static: bool) -> None:
        """One decode step on ``bufs`` (buffer name → view), in the plans' segment order."""
        decode_step(self, bufs, static=static)


def tp_shapes(config: DSV4Config, world_size: int) -> dict[str, tuple]:
    """``expected_shapes`` with the head dimension of ``q`` and ``o`` split ``world_size`` ways."""
    heads = Shard(config.n_heads, 0, world_size, "n_heads").size
    shapes = expected_shapes(config)
    shapes["q"] = shapes["o"] = ("B", heads, config.kv_dim)
    return shapes


def _check_plan(config: DSV4Config, plan, world_size: int) -> None:
    check_shapes(plan, tp_shapes(config, world_size), lambda buffer, want: (
        f"buffer {buffer.name!r} has shape {list(buffer.shape)} but the tensor-parallel dsv4 model on "
        f"{world_size} rank(s) needs {list(want)} — fix the shape, or build the plan with "
        f"plan_variant(path, world_size={world_size})"))


def build_tp_model(*, device: str | torch.device = "cpu", plan=None, rank: int = 0, world_size: int = 1,
                   channels=None, **model_args) -> TPModel:
    """The factory the TP plans name: ``graphflow.integrations.dsv4.tp:build_tp_model``.

    ``channels`` must hold ``tp_ar`` when ``world_size`` > 1 (the engine offers the
    channel runtime's handles). A plan whose ``world_size`` differs from the run's is
    refused: its sharded buffer shapes would not fit.
    """
    config = DSV4Config(**model_args)
    for total, what in ((config.n_heads, "n_heads"), (config.n_experts, "n_experts"),
                        (config.shared_inter, "shared_inter")):
        Shard(total, rank, world_size, what)
    if plan is not None:
        if plan.world_size != world_size:
            raise ValueError(f"plan {plan.name!r} is written for world_size {plan.world_size}, the run has "
                             f"{world_size} — build it with plan_variant(path, world_size={world_size})")
        _check_plan(config, plan, world_size)
    if channels is not None and TP_CHANNEL in channels:
        tp = channels[TP_CHANNEL]
    elif world_size == 1:
        tp = _SingleRank()
    else:
        raise ValueError(f"the tensor-parallel dsv4 model on {world_size} ranks needs channel {TP_CHANNEL!r}: "
                         "declare it in the plan and pass the channel runtime's handles")
    check_rms_kernel(config, torch.device(device))
    return TPModel(DSV4Model(config, torch.device(device)), rank, world_size, tp)
