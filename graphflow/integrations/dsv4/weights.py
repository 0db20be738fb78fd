"""Seeded random weights: the model is built, never downloaded.

Weights are drawn on the target device from one seeded generator, in construction
order, so a model is the same on every run of one device (an 8 GB model is drawn in a
second on a GPU, not minutes on a CPU). Every parameter is frozen: inference only, and
no autograd graph is ever recorded during capture.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["WeightSource"]


class WeightSource:
    """Draws frozen parameters for one model from a seeded generator."""

    def __init__(self, seed: int, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def normal(self, *shape: int, fan_in: int | None = None, std: float | None = None) -> nn.Parameter:
        """N(0, std²), std defaulting to 1/sqrt(fan_in) so activations stay of order one."""
        scale = std if std is not None else 1.0 / math.sqrt(fan_in if fan_in is not None else shape[0])
        data = torch.randn(shape, generator=self.generator, device=self.device, dtype=torch.float32)
        return nn.Parameter((data * scale).to(self.dtype), requires_grad=False)

    def ones(self, *shape: int) -> nn.Parameter:
        return nn.Parameter(torch.ones(shape, device=self.device, dtype=self.dtype), requires_grad=False)
