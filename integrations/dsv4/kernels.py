"""RMSNorm for the model: one Triton program per row on CUDA, PyTorch's kernel elsewhere.

At decode batch sizes an RMSNorm is a few rows of 2,048 to 8,192 elements, and the model
runs four a layer. PyTorch's fused kernel took 7 us a call on the H200 at B=1 (245 calls,
1.7 ms of the 61-layer step's 17.6 ms of kernel time); one program per row holding the
whole row in registers takes 1.9 us (same profile), and the 61-layer FULL replay ran
1.2 ms faster with it (docs/dsv4.md). The maths is PyTorch's: a float32 sum of squares,
one rounding of the result, so CPU and GPU runs of the model agree to the usual float
tolerance and each device's eager run and replay agree bit for bit.

Triton compiles the kernel on its first call for each row length and dtype. graphflow's
warmup runs every segment before capture, so no compilation happens inside a capture:
a compile during capture would launch work the graph never records.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["MAX_ROW", "rms_norm", "uses_triton"]

#: The longest row one program normalizes with the row in registers; longer rows use PyTorch's kernel.
MAX_ROW = 32768


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x over its last dimension, scaled by weight."""
    if uses_triton(x):
        return _triton_rms_norm()(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ``rms_norm(x, ...)`` runs the Triton kernel (a CUDA tensor, Triton installed)."""
    return x.is_cuda and x.is_contiguous() and x.shape[-1] <= MAX_ROW and _triton_rms_norm() is not None


@functools.cache
def _triton_rms_norm():
    """The Triton launcher, or None where Triton is not installed (CPU-only installs)."""
    try:
        from graphflow.integrations.dsv4.triton_rms import rms_norm as launch
    except ImportError:
        return None
    return launch
