"""A toy model right at every batch size but one: at ``wrong`` rows its head adds a
Python float that advances at each call. A graph captures the value once and replays
it; the model as written reads the new one each step. Verify's sample before ready does
not hold that size, so only a check at that size's first batch can see it."""

from __future__ import annotations

import torch

from plans.toy_model import build_toy


def drifting_toy(layers: int, wrong: int, device: str = "cpu"):
    model = build_toy(layers, device=device)
    head = model.head
    drift = [0.0]

    def head_drifting(x: torch.Tensor, logits: torch.Tensor) -> None:
        head(x, logits)
        if x.shape[0] == wrong:
            drift[0] += 1.0
            logits.add_(drift[0])

    model.head = head_drifting
    return model, drift
