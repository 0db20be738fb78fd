"""Mixture of experts: a router picks top-k of grouped experts per token, plus a shared expert.

Everything is capture-safe: no shape depends on routing. Expert token counts go into a
preallocated buffer with ``scatter_add_`` (``bincount`` returns a tensor whose length
depends on the data, and reads it back to size it). The routed FFN runs one of two
ways, chosen by the batch size alone (a static shape, so the choice never varies
between warmup, capture and replay):

* gather: each (token, expert) pair copies its expert's weights and runs a batched
  matmul;
* dense: every expert runs on every token and a routing matrix with zeros for the
  experts not chosen combines them; this reads each expert's weights once, at the
  bandwidth a matmul reads them.

Counting bytes, gather moves three weight reads a pair (copy in, copy out, matmul),
but the copy (``index_select``) runs far below a matmul's bandwidth: on the H200 it
took 13 us for one 4 MiB expert, and at B=1 with 8 experts (2 chosen) the whole
61-layer step replayed 0.8 ms faster dense. So gather is chosen only while the chosen
pairs are a small fraction of the experts, ``8 * B * top_k < n_experts`` (decode at
small batch over many experts, as in DeepSeek's 256).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.weights import WeightSource

__all__ = ["MoE", "Router", "SharedExpert", "count_experts", "dense", "gathered", "swiglu", "uses_gather"]


def count_experts(ids: torch.Tensor, counts: torch.Tensor) -> None:
    """Add how many times each expert was chosen in ids [B, k] to counts [E] (int64), in place."""
    flat = ids.flatten()
    counts.scatter_add_(0, flat, torch.ones_like(flat))


#: How many expert reads of the dense path one gathered (token, expert) pair costs (module docstring).
GATHER_COST = 8


def uses_gather(batch: int, top_k: int, n_experts: int) -> bool:
    """Whether the gather path is the faster one at this batch size (module docstring)."""
    return GATHER_COST * batch * top_k < n_experts


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Router(nn.Module):
    """DeepSeek-style routing: sqrt(softplus) affinities, a selection bias, normalized top-k weights.

    The bias (aux-loss-free load balancing) shifts which experts are selected but not
    their weights.
    """

    def __init__(self, config: DSV4Config, source: WeightSource):
        super().__init__()
        self.top_k = config.top_k
        self.proj = source.normal(config.hidden_size, config.n_experts)
        self.bias = nn.Parameter(
            source.normal(config.n_experts, std=0.1).float(), requires_grad=False
        )

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [B, d] → expert ids [B, k] (int64) and weights [B, k] (h's dtype)."""
        scores = torch.sqrt(F.softplus(torch.matmul(h, self.proj).float()))  # [B, E]
        ids = torch.topk(scores + self.bias, self.top_k, dim=-1).indices
        weights = torch.gather(scores, 1, ids)
        return ids, (weights / weights.sum(dim=-1, keepdim=True)).to(h.dtype)


class MoE(nn.Module):
    """Routed experts with grouped weights w13 [E, d, 2f] and w2 [E, f, d]."""

    def __init__(self, config: DSV4Config, source: WeightSource):
        super().__init__()
        d, f, e = config.hidden_size, config.moe_inter, config.n_experts
        self.n_experts = e
        self.router = Router(config, source)
        self.w13 = source.normal(e, d, 2 * f, fan_in=d)
        self.w2 = source.normal(e, f, d, fan_in=f)

    def forward(self, h: torch.Tensor, counts: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """h [B, d] → [B, d]; adds this step's expert counts to counts [E], or at
        ``offset + expert`` of a flat counts tensor (one row of several layers' counts)."""
        ids, weights = self.router(h)
        count_experts(ids if offset is None else ids + offset, counts)
        if uses_gather(h.shape[0], ids.shape[1], self.n_experts):
            return gathered(h, ids, weights, self.w13, self.w2)
        routing = torch.zeros(h.shape[0], self.n_experts, device=h.device, dtype=h.dtype).scatter_(1, ids, weights)
        return dense(h, routing, self.w13, self.w2)


def gathered(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
             w2: torch.Tensor) -> torch.Tensor:
    """The routed FFN by gathering each (token, expert) pair's weights: h [B, d], ids and
    weights [B, k] (ids index w13 [E, d, 2f] and w2 [E, f, d]) → [B, d]."""
    batch, k = ids.shape
    flat = ids.flatten()
    x = h.unsqueeze(1).expand(batch, k, h.shape[1]).reshape(batch * k, 1, h.shape[1])  # [B*k, 1, d]
    act = swiglu(torch.bmm(x, w13.index_select(0, flat)))  # [B*k, 1, f]
    out = torch.bmm(act, w2.index_select(0, flat)).view(batch, k, -1)  # [B, k, d]
    return torch.bmm(weights.unsqueeze(1), out).squeeze(1)


def dense(h: torch.Tensor, routing: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The routed FFN with every expert on every token: h [B, d], routing [B, E] (each
    token's weight per expert of w13 [E, d, 2f] and w2 [E, f, d]) → [B, d]."""
    act = swiglu(torch.matmul(h.unsqueeze(0), w13))  # [E, B, f]
    out = torch.bmm(act, w2)  # [E, B, d]
    return torch.bmm(out.permute(1, 2, 0), routing.unsqueeze(-1)).squeeze(-1)  # [B, d]


class SharedExpert(nn.Module):
    """The always-on expert every token goes through."""

    def __init__(self, config: DSV4Config, source: WeightSource):
        super().__init__()
        d, f = config.hidden_size, config.shared_inter
        self.w13 = source.normal(d, 2 * f)
        self.w2 = source.normal(f, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.matmul(swiglu(torch.matmul(h, self.w13)), self.w2)
