"""The Triton RMSNorm kernel (imported only where Triton is; see kernels.py for why)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["launch", "specialize"]


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + row * n + offsets, mask=mask, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    w = tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + offsets, (x * scale * w).to(y_ptr.dtype.element_ty), mask=mask)


def _config(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    # Enough warps that each thread holds at most 16 of the row's elements.
    return block, min(16, max(4, block // (32 * 16)))


def specialize(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> dict:
    """What Triton compiles this launch for: dtypes, the block and warps, 16-byte
    alignment of the pointers and divisibility of ``n`` by 16 (Triton's own keys)."""
    block, warps = _config(x.shape[-1])
    return {"dtype": str(x.dtype).removeprefix("torch."), "block": block, "warps": warps,
            "aligned16": all(t.data_ptr() % 16 == 0 for t in (x, weight, out)),
            "n16": x.shape[-1] % 16 == 0, "n1": x.shape[-1] == 1}


def launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> None:
    """x [..., n] (contiguous, on CUDA) normalized into ``out`` of x's shape and dtype."""
    n = x.shape[-1]
    block, warps = _config(n)
    _rms_norm_rows[(x.numel() // n,)](x, weight, out, n, eps, BLOCK=block, num_warps=warps)
