"""Manifold-constrained hyper-connections: several residual streams, mixed around a block.

Instead of one residual ``x + f(x)``, the model carries ``n`` streams ``X`` [B, n, d].
Around each block (attention, FFN), coefficients computed from ``X`` itself choose
the block's input ``H_pre · X``, spread its output back with ``H_post`` and remix the
streams with ``H_res``:

    X' = H_res X + H_post^T f(H_pre X)

``H_res`` is made doubly stochastic by Sinkhorn-Knopp normalization, so the streams'
mean is preserved through any depth (the mixing neither amplifies nor loses signal).
All coefficients are per token and computed on the device: no value leaves the GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from graphflow.integrations.dsv4.kernels import rms_norm
from graphflow.integrations.dsv4.weights import WeightSource

__all__ = ["HyperConnection", "sinkhorn"]


def sinkhorn(logits: torch.Tensor, iters: int) -> torch.Tensor:
    """exp(logits) [..., n, n] alternately row- and column-normalized ``iters`` times.

    Fixed iteration count, no convergence test: a data-dependent stop would need the
    host to read a value back, which a captured graph cannot do.
    """
    m = logits.float().exp()
    for _ in range(iters):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


class HyperConnection(nn.Module):
    """The mixing around one block: gates and residual-mix logits, the Sinkhorn-normalized
    residual mix, pre-mix (streams → block input), post-mix."""

    def __init__(self, hidden: int, streams: int, sinkhorn_iters: int, eps: float, source: WeightSource,
                 rms_kernel: str = "triton"):
        super().__init__()
        self.rms_kernel = rms_kernel
        self.streams = streams
        self.sinkhorn_iters = sinkhorn_iters
        self.eps = eps
        n = streams
        self.norm = source.ones(n * hidden)
        # One projection yields pre (n), post (n) and residual-mix (n*n) logits; the bias
        # starts the residual mix near the identity, as hyper-connections are initialized.
        self.proj = source.normal(n * hidden, 2 * n + n * n, std=0.1 / (n * hidden) ** 0.5)
        bias = torch.zeros(2 * n + n * n, device=source.device, dtype=torch.float32)
        bias[2 * n:] = 2.0 * torch.eye(n, device=source.device).flatten()
        self.bias = nn.Parameter(bias.to(source.dtype), requires_grad=False)

    def gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """H_pre [B, n], H_post [B, n] and the residual mix's raw logits [B, n, n] for streams x [B, n, d].

        The logits are normalized by ``residual_mix``, a separate call, so the Sinkhorn
        iterations (a chain of tiny kernels) can run on a side stream while the main
        chain goes on with the block (docs/dsv4.md).
        """
        n = self.streams
        flat = rms_norm(x.flatten(1), self.norm, self.eps, self.rms_kernel)
        logits = torch.addmm(self.bias, flat, self.proj)  # [B, 2n + n*n]
        gates = torch.sigmoid(logits[:, : 2 * n])
        return gates[:, :n], 2.0 * gates[:, n:], logits[:, 2 * n:].reshape(-1, n, n)

    def residual_mix(self, logits: torch.Tensor) -> torch.Tensor:
        """H_res [B, n, n] (float32, doubly stochastic) from the logits ``gates`` gave."""
        return sinkhorn(logits, self.sinkhorn_iters)

    @staticmethod
    def pre(x: torch.Tensor, h_pre: torch.Tensor) -> torch.Tensor:
        """The block's input: streams x [B, n, d] weighted by h_pre [B, n] → [B, d]."""
        return torch.bmm(h_pre.unsqueeze(1), x).squeeze(1)

    @staticmethod
    def post(x: torch.Tensor, out: torch.Tensor, h_post: torch.Tensor, h_res: torch.Tensor) -> torch.Tensor:
        """The next streams: h_res [B, n, n] @ x [B, n, d] + h_post [B, n] ⊗ out [B, d]."""
        return torch.baddbmm(h_post.unsqueeze(-1) * out.unsqueeze(1), h_res, x)
