"""The CuTe DSL RMSNorm kernel (imported only where nvidia-cutlass-dsl is; see kernels.py).

One CTA normalizes one row, holding the whole row in registers. A decode step's rows
are few (B of them) and short (2,048 to 8,192 elements), so the kernel is bound by the
latency of one load, one reduction and one store, not by bandwidth; everything below
serves that:

* Vectors. Each thread moves ``vec`` contiguous elements per access, 16 bytes when the
  row length and all three pointers allow (8 bf16 or 4 fp32: one ``ld.global.v4``);
  thread ``t`` owns vectors ``t, t + threads, t + 2 * threads, ...``, so a warp's
  accesses are contiguous and coalesced.
* Threads. At most 256 threads a row until a thread holds 32 elements, then up to
  1,024: 2,048 bf16 is 256 threads x 1 vector, 8,192 bf16 is 256 x 4, 8,192 fp32 is
  256 x 8. Every thread issues all its loads before it uses any of them.
* The reduction. Each thread sums the squares of its elements in float32, in order; a
  butterfly shuffle sums each warp (every lane ends with the warp's sum); lane 0 of
  each warp writes it to shared memory; after one barrier every thread adds the
  warps' sums in warp order. Every thread so computes the same total, bit for bit,
  with one barrier and no broadcast.
* The maths is the PyTorch reference's and the Triton kernel's: ``rsqrt(sum / n +
  eps)``, then ``(x * rstd) * w`` in float32 and one rounding to the output dtype.

The row length, dtype, vector width and thread count are compile-time constants; the
number of rows is a runtime argument, so one compiled kernel serves every batch size.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.memory
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.base_dsl import AddressSpace
from cutlass.cute.runtime import make_ptr

from graphflow.engine.jit import CuteKernel

__all__ = ["DTYPES", "CuteRMSNorm", "RMSNormConfig", "RMSNormHost"]

#: torch dtype name → CuTe numeric type, for the dtypes the kernel supports.
DTYPES = {"float32": cutlass.Float32, "bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}

#: Elements one thread holds before the kernel uses more threads rather than more registers.
_PER_THREAD = 32
_MAX_THREADS = 1024
_PREFERRED_THREADS = 256


class RMSNormConfig:
    """The compile-time shape of one specialization: dtype, row length, vector width.

    ``vec`` must divide ``n``; ``threads`` and ``per_thread`` (vectors a thread holds)
    follow from them (see the module docstring).
    """

    def __init__(self, dtype: str, n: int, vec: int):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: the kernel takes {', '.join(DTYPES)}")
        if n < 1 or vec < 1 or n % vec:
            raise ValueError(f"vector width {vec} must divide the row length {n}")
        self.dtype = dtype
        self.n = n
        self.vec = vec
        self.vectors = n // vec
        per_thread = 1
        while -(-self.vectors // per_thread) > _PREFERRED_THREADS and per_thread * vec < _PER_THREAD:
            per_thread *= 2
        threads = -(-self.vectors // per_thread)
        while threads > _MAX_THREADS:  # rows past the register budget at 1,024 threads
            per_thread *= 2
            threads = -(-self.vectors // per_thread)
        self.per_thread = per_thread
        self.threads = -(-threads // 32) * 32
        self.warps = self.threads // 32

    @staticmethod
    def fits(n: int, vec: int) -> bool:
        """Whether a row of ``n`` elements fits the register budget at 1,024 threads."""
        return -(-n // vec) <= _MAX_THREADS * max(1, _PER_THREAD // vec)

    def __repr__(self) -> str:
        return (f"RMSNormConfig({self.dtype}, n={self.n}, vec={self.vec}: {self.threads} threads x "
                f"{self.per_thread} vectors)")


class RMSNormHost:
    """The ``@cute.jit`` host function of one specialization: ``(x, w, y, rows, eps, stream)``.

    ``x`` and ``y`` point at ``rows`` contiguous rows of ``n`` elements, ``w`` at ``n``
    weights, all of the config's dtype and aligned to ``vec`` elements.
    """

    def __init__(self, config: RMSNormConfig):
        self.config = config

    @cute.jit
    def __call__(self, x_ptr: cute.Pointer, w_ptr: cute.Pointer, y_ptr: cute.Pointer, rows: Int32, eps: Float32,
                 stream: cuda.CUstream):
        c = self.config
        # (row, element in vector, vector): a (None, j) slice is one aligned, contiguous vector.
        rows_layout = cute.make_layout((rows, c.vec, c.vectors), stride=(c.n, 1, c.vec))
        mX = cute.make_tensor(x_ptr, rows_layout)
        mY = cute.make_tensor(y_ptr, rows_layout)
        mW = cute.make_tensor(w_ptr, cute.make_layout((c.vec, c.vectors), stride=(1, c.vec)))
        self.kernel(mX, mW, mY, eps).launch(grid=[rows, 1, 1], block=[c.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mW: cute.Tensor, mY: cute.Tensor, eps: Float32):
        c = self.config
        dtype = DTYPES[c.dtype]
        tidx, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        bits = c.vec * dtype.width
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
        ragged = c.vectors % c.threads != 0  # some threads own fewer vectors than others

        rX = cute.make_rmem_tensor((c.vec, c.per_thread), dtype)
        rW = cute.make_rmem_tensor((c.vec, c.per_thread), dtype)
        if cutlass.const_expr(ragged):
            rX.fill(0.0)
            rW.fill(0.0)
        for k in cutlass.range_constexpr(c.per_thread):
            j = tidx + k * c.threads
            if cutlass.const_expr(ragged):
                if j < c.vectors:
                    cute.copy(load, mX[row, None, j], rX[None, k])
                    cute.copy(load, mW[None, j], rW[None, k])
            else:
                cute.copy(load, mX[row, None, j], rX[None, k])
                cute.copy(load, mW[None, j], rW[None, k])

        x = rX.load().to(Float32)
        total = (x * x).reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        total = cute.arch.warp_reduction_sum(total)
        if cutlass.const_expr(c.warps > 1):
            smem = cutlass.memory.SmemAllocator()
            partial = smem.allocate_tensor(Float32, cute.make_layout((c.warps,)), byte_alignment=16)
            lane = cute.arch.lane_idx()
            warp = cute.arch.warp_idx()
            if lane == 0:
                partial[warp] = total
            cute.arch.sync_threads()
            total = partial[0]
            for w in cutlass.range_constexpr(1, c.warps):
                total = total + partial[w]

        rstd = cute.math.rsqrt(total / Float32(c.n) + eps)
        w = rW.load().to(Float32)
        rY = cute.make_rmem_tensor((c.vec, c.per_thread), dtype)
        rY.store(((x * rstd) * w).to(dtype))
        for k in cutlass.range_constexpr(c.per_thread):
            j = tidx + k * c.threads
            if cutlass.const_expr(ragged):
                if j < c.vectors:
                    cute.copy(store, rY[None, k], mY[row, None, j])
            else:
                cute.copy(store, rY[None, k], mY[row, None, j])


class CuteRMSNorm(CuteKernel):
    """The kernel as graphflow registers it: ``kernel(x, weight, out, eps)`` on contiguous
    rows of ``x`` (any leading shape), into ``out`` of the same shape and dtype.

    The specialization is (dtype, n, vec): the row length and the vector width, the
    widest of 16, 8, 4 or 2 bytes that ``n`` and all three addresses allow. The row
    count is a runtime argument: batch sizes share one compiled kernel.
    """

    per_size = False  # (dtype, n, vec): the row, never the batch size

    def __init__(self, name: str = "dsv4.rms_norm"):
        super().__init__(name)

    def specialize(self, x, weight, out, eps) -> dict:
        n = x.shape[-1]
        return {"dtype": str(x.dtype).removeprefix("torch."), "n": n,
                "vec": self._vec(n, x.element_size(), x, weight, out)}

    def host(self, spec) -> RMSNormHost:
        return RMSNormHost(RMSNormConfig(spec.get("dtype"), spec.get("n"), spec.get("vec")))

    def arguments(self, spec, x, weight, out, eps) -> tuple:
        dtype = DTYPES[spec.get("dtype")]
        align = spec.get("vec") * x.element_size()
        ptrs = (make_ptr(dtype, t.data_ptr(), AddressSpace.gmem, assumed_align=align) for t in (x, weight, out))
        return (*ptrs, Int32(x.numel() // spec.get("n")), Float32(eps))

    @staticmethod
    def _vec(n: int, itemsize: int, *tensors) -> int:
        vec = 16 // itemsize
        while vec > 1 and (n % vec or any(t.data_ptr() % (vec * itemsize) for t in tensors)):
            vec //= 2
        return vec
