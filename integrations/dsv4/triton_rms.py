"""The Triton RMSNorm kernel (imported only where Triton is; see kernels.py for why)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm"]


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + row * n + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + offsets, (x * scale * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] (contiguous, on CUDA) → a new tensor of x's shape and dtype."""
    n = x.shape[-1]
    y = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    # Enough warps that each thread holds at most 16 of the row's elements.
    warps = min(16, max(4, block // (32 * 16)))
    _rms_norm_rows[(x.numel() // n,)](x, weight, y, n, eps, BLOCK=block, num_warps=warps)
    return y
