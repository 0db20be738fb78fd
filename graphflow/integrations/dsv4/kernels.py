"""RMSNorm for the model, by backend: CuTe DSL, Triton or PyTorch, chosen per plan.

At decode batch sizes an RMSNorm is a few rows of 2,048 to 8,192 elements, and the model
runs four a layer. PyTorch's fused kernel took 7 us a call on the H200 at B=1 (245 calls,
1.7 ms of the 61-layer step's 17.6 ms of kernel time); one program per row holding the
whole row in registers takes 1.9 us (same profile), and the 61-layer FULL replay ran
1.2 ms faster with it (docs/dsv4.md). The maths is PyTorch's: a float32 sum of squares,
one rounding of the result, so CPU and GPU runs of the model agree to the usual float
tolerance and each device's eager run and replay agree bit for bit.

A plan picks the backend with ``model_args: {rms_kernel: cute | triton | torch}``
(``DSV4Config.rms_kernel``, Triton by default):

* ``cute``: ``cute_rms.CuteRMSNorm`` (nvidia-cutlass-dsl, the ``cutedsl`` extra);
* ``triton``: ``triton_rms`` (Triton ships with CUDA builds of torch);
* ``torch``: ``F.rms_norm``.

Off CUDA, for non-contiguous inputs, for rows past ``MAX_ROW`` and inside a segment the
plan compiles (``torch.compile``) every backend is PyTorch's. Both JIT kernels are registered in ``graphflow.engine.jit.registry`` as
``dsv4.rms_norm`` (CuTe) and ``dsv4.rms_norm_triton``: the registry records which
segment launched which specialization during warmup, the prewarm phase launches each
on every capture stream, and a cold one inside capture is a named CaptureError
(docs/jit.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["BACKENDS", "KERNEL_NAMES", "MAX_ROW", "cute_available", "jit_kernel", "rms_norm", "uses_jit", "uses_triton"]

#: The longest row one program normalizes with the row in registers; longer rows use PyTorch's kernel.
MAX_ROW = 32768
#: What ``rms_kernel`` may name.
BACKENDS = ("cute", "triton", "torch")
#: The registry names of the JIT backends' kernels.
KERNEL_NAMES = {"cute": "dsv4.rms_norm", "triton": "dsv4.rms_norm_triton"}

_JIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "triton") -> torch.Tensor:
    """RMSNorm of x over its last dimension, scaled by weight, on ``backend`` where it applies."""
    if uses_jit(x, weight, backend):
        out = torch.empty_like(x)
        jit_kernel(backend)(x, weight, out, eps)
        return out
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def uses_jit(x: torch.Tensor, weight: torch.Tensor, backend: str) -> bool:
    """Whether ``rms_norm(x, weight, ..., backend)`` runs a JIT kernel rather than PyTorch's.

    Never under ``torch.compile``: a registered JIT kernel is opaque to inductor, while
    PyTorch's RMSNorm is fused with the work around it (a plan's compiled segments).
    """
    if backend == "torch" or torch.compiler.is_compiling():
        return False
    if not (x.is_cuda and x.is_contiguous() and weight.is_contiguous()):
        return False
    if x.shape[-1] > MAX_ROW or x.numel() == 0 or x.dtype not in _JIT_DTYPES or weight.dtype != x.dtype:
        return False
    return jit_kernel(backend) is not None


def uses_triton(x: torch.Tensor) -> bool:
    """Whether ``rms_norm(x, ...)`` with the default backend runs the Triton kernel."""
    return uses_jit(x, torch.empty(x.shape[-1:], dtype=x.dtype, device=x.device), "triton")


def cute_available() -> bool:
    """Whether nvidia-cutlass-dsl is importable here (the ``cutedsl`` extra)."""
    return jit_kernel("cute") is not None


@functools.cache
def jit_kernel(backend: str):
    """The registered kernel of a JIT backend, or None where its package is not installed."""
    if backend not in KERNEL_NAMES:
        raise ValueError(f"unknown RMSNorm backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    from graphflow.engine.jit import TritonKernel, registry

    try:
        if backend == "cute":
            from graphflow.integrations.dsv4.cute_rms import CuteRMSNorm

            return registry.register(CuteRMSNorm(KERNEL_NAMES["cute"]))
        from graphflow.integrations.dsv4.triton_rms import launch, specialize
    except ImportError:
        return None
    # Its specialization is the row's (dtype, block, alignment, n % 16): batch sizes share it.
    return registry.register(TritonKernel(KERNEL_NAMES["triton"], launch, specialize, per_size=False))
