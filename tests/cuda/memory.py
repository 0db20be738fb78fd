"""Device memory as the CUDA rollback and close tests count it."""

from __future__ import annotations

import gc

import torch


def allocated() -> int:
    """Allocated bytes now, after collecting garbage and without cuBLAS's per-stream
    workspaces: they are cuBLAS's cache, which the engine leaves because other live graphs
    replay into theirs (torch's own leak checks leave them out the same way)."""
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()
