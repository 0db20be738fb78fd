"""Small CuTe DSL kernels the JIT tests share (the DSL reads a kernel's source, so they
live in a file): a 32-element increment whose host function passes its stream to the
launch, and one that forgets to."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack, make_fake_compact_tensor

from graphflow.engine.jit import CuteKernel

__all__ = ["Bump", "_bump_on_default_stream", "_bump_on_stream"]


@cute.kernel
def _bump(a: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    a[tidx] = a[tidx] + 1.0


@cute.jit
def _bump_on_stream(a: cute.Tensor, stream: cuda.CUstream):
    _bump(a).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)


@cute.jit
def _bump_on_default_stream(a: cute.Tensor, stream: cuda.CUstream):
    _bump(a).launch(grid=[1, 1, 1], block=[32, 1, 1])


class Bump(CuteKernel):
    """A 32-element increment, with or without ``stream=`` in its host function."""

    def __init__(self, name, host):
        super().__init__(name)
        self._host = host

    def specialize(self, x):
        return {"dtype": "float32"}

    def host(self, spec):
        return self._host

    def arguments(self, spec, x):
        """The tensor itself on a GPU; a fake one where there is none to hand a pointer to."""
        if x.is_cuda:
            return (from_dlpack(x, assumed_align=16),)
        return (make_fake_compact_tensor(cutlass.Float32, (32,)),)
