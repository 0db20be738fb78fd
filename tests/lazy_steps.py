"""The model's own step beside a lazy engine's served one, for tests that read served outputs."""

from __future__ import annotations

import torch

from graphflow.runtime import Runner


def own_step(model, runner: Runner, x: torch.Tensor, full: bool) -> torch.Tensor:
    """The toy model's own step (outside graphflow) on the rows the runner's last step
    ran: the batch padded with zero rows up to the descriptor that served it (a matmul of
    other rows may round differently), or alone when it was served eagerly."""
    batch = x.shape[0]
    descriptor = runner.descriptor_for(batch)  # the runner's last step decided it; only ``run`` changes it
    size = descriptor.size if descriptor is not None else batch
    padded = torch.zeros(size, x.shape[1], dtype=x.dtype, device=x.device)
    padded[:batch] = x
    out = torch.empty(size, 64, device=x.device)
    model.step(padded, out, full=full)
    return out[:batch]
