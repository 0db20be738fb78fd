"""The matrix multiplications a step launches: recorded when a run saves its graphs,
run again when a new process restores them, so that their libraries are loaded.

cuBLAS picks its kernel by the shapes, strides, dtypes and alignment of a
multiplication, and keeps most of its kernels in libraries of their own that CUDA loads
when one is first launched. A new process that has captured one descriptor has loaded
that descriptor's kernels only: the 61-layer plan's other batch sizes launch other
kernels, in libraries no graph of this process shows yet, so they cannot be found by
name (``graphflow.engine.restart.driver.Functions``). Capturing each such descriptor
would find them at the price of its whole step; running its distinct multiplications
alone, on scratch tensors of the same layout, once eagerly (which loads the libraries)
and once in a throwaway graph (which shows their kernels), finds them in a fraction of
that.

What is recorded is each call of a multiplication operator (``OPERATORS``) with its
tensors' layouts: shape, strides, dtype and alignment (``alignment``: torch tells cuBLAS
how its pointers are aligned, up to ``ALIGNMENT`` bytes, and cuBLAS picks by it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphflow.engine.restart.saved import Matmul, TensorLayout

__all__ = ["OPERATORS", "Recorder", "run"]

#: The operators whose kernels a matrix library picks per call.
OPERATORS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "_int_mm",
                       "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm"})

#: The largest alignment torch tells cuBLAS of a pointer.
ALIGNMENT = 256


class Recorder:
    """Records the multiplications of what runs under ``recording()``, in order, once
    each (``taken`` gives them back and starts afresh)."""

    def __init__(self) -> None:
        self._seen: dict[Matmul, None] = {}

    def recording(self, body: Callable[[], object]) -> Callable[[], object]:
        """``body``, its multiplications recorded as it runs (the shape of ``Hooks.record``)."""

        def recorded() -> object:
            with _Mode(self._seen):
                return body()

        return recorded

    def taken(self) -> tuple[Matmul, ...]:
        found, self._seen = tuple(self._seen), {}
        return found


class _Mode(TorchDispatchMode):
    def __init__(self, seen: dict[Matmul, None]) -> None:
        super().__init__()
        self._seen = seen

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Recording leaves ``torch.compile`` as it is: a mode it does not know of makes it
        skip a frame, and keep skipping it after the mode is gone."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._schema.name.removeprefix("aten::") in OPERATORS and func.namespace == "aten":
            self._seen.setdefault(Matmul(f"{func._schema.name.removeprefix('aten::')}.{func._overloadname}",
                                         tuple(_layout(a) for a in args),
                                         tuple((k, _layout(v)) for k, v in sorted(kwargs.items()))), None)
        return func(*args, **kwargs)


def _layout(value):
    if isinstance(value, torch.Tensor):
        return TensorLayout(tuple(value.shape), tuple(value.stride()), str(value.dtype).removeprefix("torch."),
                            alignment(value.data_ptr()))
    if isinstance(value, (list, tuple)):
        return tuple(_layout(item) for item in value)
    if isinstance(value, torch.dtype):
        return str(value)
    return value


def alignment(address: int) -> int:
    """The largest power of two up to ``ALIGNMENT`` that divides ``address`` (as torch
    works it out for cuBLAS)."""
    return min(ALIGNMENT, address & -address) if address else ALIGNMENT


def run(matmuls: Iterable[Matmul], device: torch.device, stream, graph: torch.cuda.CUDAGraph | None = None) -> None:
    """Each multiplication once on zeroed scratch tensors of its layout, on ``stream``;
    recorded into ``graph`` when one is given (it must keep its graph:
    ``CUDAGraph(keep_graph=True)``). Zeros, not whatever memory held: a grouped
    multiplication reads its groups' offsets from a tensor, and garbage there would read
    out of bounds."""
    calls = [(_operator(m.operator), m) for m in matmuls]
    with torch.no_grad(), torch.cuda.stream(stream) if device.type == "cuda" else contextlib.nullcontext():
        inputs = [(op, tuple(_value(a, device) for a in m.args), {k: _value(v, device) for k, v in m.kwargs})
                  for op, m in calls]
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local") if graph is not None \
                else contextlib.nullcontext():
            for op, args, kwargs in inputs:
                op(*args, **kwargs)


def _operator(name: str):
    operator, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, operator), overload)


def _value(layout, device: torch.device):
    if isinstance(layout, TensorLayout):
        return _scratch(layout, device)
    if isinstance(layout, tuple):
        return tuple(_value(item, device) for item in layout)
    if isinstance(layout, str) and layout.startswith("torch."):
        return getattr(torch, layout.removeprefix("torch."))
    return layout


def _scratch(layout: TensorLayout, device: torch.device) -> torch.Tensor:
    """A tensor of ``layout``'s shape, strides and dtype, aligned as the recorded one."""
    dtype = getattr(torch, layout.dtype)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    extent = 1 + sum((n - 1) * s for n, s in zip(layout.shape, layout.stride)) if all(layout.shape) else 0
    base = torch.zeros(extent * itemsize + 2 * ALIGNMENT, dtype=torch.uint8, device=device)
    skip = -base.data_ptr() % ALIGNMENT + (layout.alignment if layout.alignment < ALIGNMENT else 0)
    storage = base[skip:skip + extent * itemsize]
    return storage.view(dtype).as_strided(layout.shape, layout.stride)
