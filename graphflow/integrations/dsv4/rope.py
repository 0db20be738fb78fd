"""Rotary positions on the first ``rope_dim`` channels of the query and key latents.

The cos|sin table for a step's positions is computed once per step (in ``embed``) into
a buffer every layer reads, instead of once per layer.
"""

from __future__ import annotations

import torch

__all__ = ["apply_rope", "rope_table"]


def rope_table(positions: torch.Tensor, rope_dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """cos | sin of each position's angles: positions [B] → [B, rope_dim]."""
    half = rope_dim // 2
    inv_freq = base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, half]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, h, rope_dim] by table [B, rope_dim] (pairs (i, i + half))."""
    half = x.shape[-1] // 2
    cos, sin = table[:, None, :half], table[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
