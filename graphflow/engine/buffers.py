"""Static buffers: allocated once at their largest size, then only ever viewed.

A captured graph bakes in the addresses it reads and writes, so a buffer must never be
reallocated after capture. Each buffer is allocated once, at ``Plan.allocated_shape``:
the size symbol at the largest descriptor, or at the buffer's ``capacity`` when that
is larger (a KV cache sized for 64 sequences), the same figure ``graphflow show`` and
the validator report. A descriptor of batch size ``b`` sees a view that narrows every
dimension using the size symbol to its value at ``b`` (``Plan.buffer_values``). Views
share storage, so a smaller descriptor's graph reads the leading rows of the same
memory. An alias views its target's storage; targets are allocated first, so a chain
of aliases ends in the one buffer that owns the memory (``Plan.storage``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from graphflow.plan import Buffer, Plan, dim_symbols, eval_dim

__all__ = ["Copies", "StaticBuffers", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


class StaticBuffers:
    """Every buffer of a plan, keyed by name, with cached per-size views."""

    def __init__(self, plan: Plan, max_size: int, device_of: Callable[[str], torch.device],
                 given: Mapping[str, torch.Tensor] | None = None):
        """``given`` maps buffers to tensors that already hold them (a model's tensor a
        buffer adopts, checked to have the allocated shape): those are not allocated."""
        given = given or {}
        self.plan = plan
        self.symbol = plan.capture.size_symbol
        self.tensors: dict[str, torch.Tensor] = {}
        self.alloc_values: dict[str, dict[str, int]] = {}
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        # descriptor -> its views, with the outputs its graphs return where they put them
        # (``graphflow.engine.model.returned``): the runtime and verify read those outputs there.
        self._placed: dict[object, dict[str, torch.Tensor]] = {}
        # name -> how each dimension using the size symbol narrows (``_sized_dims``): views
        # are made per descriptor and snapshot, hundreds of buffers each time.
        self._sized: dict[str, tuple[tuple[int, int, int], ...]] = {}
        # Roots first, then each alias after its target: sorted by the length of the chain.
        for buffer in sorted(plan.buffers, key=lambda b: len(plan.alias_chain(b.name))):
            self.alloc_values[buffer.name] = plan.allocation_values(buffer, max_size)
            self._sized[buffer.name] = _sized_dims(buffer, self.symbol, self.alloc_values[buffer.name])
            shape = plan.allocated_shape(buffer, max_size)
            dtype = torch_dtype(buffer.dtype)
            if buffer.name in given:
                self.tensors[buffer.name] = given[buffer.name]
            elif buffer.alias_of is None:
                # Zeros, not empty: warmup reads inputs before the runtime ever fills them.
                self.tensors[buffer.name] = torch.zeros(shape, dtype=dtype, device=device_of(buffer.device))
            elif buffer.alias_of in self.tensors:
                self.tensors[buffer.name] = _alias(self.tensors[buffer.alias_of], shape, dtype, buffer)
            else:
                chain = " -> ".join((*plan.alias_chain(buffer.name), buffer.alias_of))
                raise ValueError(f"buffer {buffer.name!r} aliases {buffer.alias_of!r}, which owns no storage "
                                 f"({chain}): point the chain at a buffer without alias_of (GF204, GF101)")

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def capacity(self, name: str) -> int:
        """The largest batch size this buffer's allocation holds."""
        return self.alloc_values[name][self.symbol]

    def uses_size(self, name: str) -> bool:
        return self.symbol in self.plan.buffer(name).symbols()

    def views(self, size: int) -> dict[str, torch.Tensor]:
        """Every buffer narrowed to batch ``size`` (cached: the same view objects each call)."""
        views = self._views.get(size)
        if views is None:
            views = {name: self.narrow(name, tensor, size) for name, tensor in self.tensors.items()}
            self._views[size] = views
        return views

    def views_of(self, descriptor) -> dict[str, torch.Tensor]:
        """``views(descriptor.size)``, with the outputs this descriptor's graphs return
        in place of their buffers' views (``place``)."""
        return self._placed.get(descriptor) or self.views(descriptor.size)

    def place(self, descriptor, outputs: Mapping[str, torch.Tensor]) -> None:
        """From now on, ``views_of(descriptor)`` gives these tensors for these buffers."""
        self._placed[descriptor] = {**self.views(descriptor.size), **outputs}

    def unplace(self, descriptor) -> None:
        self._placed.pop(descriptor, None)

    def view(self, name: str, size: int) -> torch.Tensor:
        """One buffer at ``size``; ``size`` may exceed other buffers' allocations."""
        views = self._views.get(size)
        return views[name] if views is not None else self.narrow(name, self.tensors[name], size)

    def fresh(self, name: str, size: int) -> torch.Tensor:
        """A new zeroed tensor shaped like ``name`` at ``size`` (eager fallback beyond capacity)."""
        buffer = self.plan.buffer(name)
        values = self.plan.buffer_values(buffer, size)
        tensor = self.tensors[name]
        return torch.zeros(tuple(eval_dim(d, values) for d in buffer.shape), dtype=tensor.dtype, device=tensor.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for n, t in self.tensors.items() if self.plan.buffer(n).alias_of is None)

    def clear(self) -> None:
        self._views.clear()
        self._placed.clear()
        self.tensors.clear()

    def narrow(self, name: str, tensor: torch.Tensor, size: int) -> torch.Tensor:
        """``tensor``, shaped like buffer ``name``'s allocation, narrowed as its view at ``size`` is."""
        for index, factor, power in self._sized[name]:
            tensor = tensor.narrow(index, 0, factor * size**power)
        return tensor


def _sized_dims(buffer: Buffer, symbol: str, values: Mapping[str, int]) -> tuple[tuple[int, int, int], ...]:
    """``(index, factor, power)`` for each dimension of ``buffer`` that uses the size
    symbol: a dimension is a product of terms, so at batch ``b`` its length is ``factor *
    b**power``, the other symbols at their allocation values (``Plan.buffer_values``)."""
    sized = []
    for index, dim in enumerate(buffer.shape):
        power = dim_symbols(dim).count(symbol)
        if power:
            sized.append((index, eval_dim(dim, {**values, symbol: 1}), power))
    return tuple(sized)


class Copies:
    """Room for a copy of some buffers, allocated once at their full size and reused at
    every descriptor size.

    Verify's snapshots (the state a step starts from, what it wrote) are as large as the
    state itself: gigabytes for a KV cache. Cloned per descriptor, they are freed and
    allocated again each time, and whenever the allocator's cache is emptied before a
    descriptor's captures (``Backend.make_room``), that descriptor paid for fresh device
    allocations of that size. Copied into the same memory, they cost only the copy.
    """

    def __init__(self, buffers: StaticBuffers, names):
        self._buffers = buffers
        self.tensors = {n: torch.empty_like(buffers.tensors[n]) for n in dict.fromkeys(names)}
        self._rooms: dict[int, dict[str, torch.Tensor]] = {}  # size -> the copies' views at it

    def take(self, views: Mapping[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
        """Copy every buffer's view at ``size`` in; the copies, as views of the same size
        (the same view objects at each call of a size: the next call overwrites them)."""
        rooms = self._rooms.get(size)
        if rooms is None:
            rooms = self._rooms[size] = {n: self._buffers.narrow(n, t, size) for n, t in self.tensors.items()}
        for name, room in rooms.items():
            room.copy_(views[name])
        return dict(rooms)

    def clear(self) -> None:
        self.tensors.clear()
        self._rooms.clear()


def _alias(target: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, buffer: Buffer) -> torch.Tensor:
    flat = target.reshape(-1).view(torch.uint8)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes > flat.numel():
        raise ValueError(f"buffer {buffer.name!r} ({nbytes} bytes) does not fit in {buffer.alias_of!r} "
                         f"({flat.numel()} bytes) that it aliases — shrink it or grow the target")
    return flat[:nbytes].view(dtype).view(shape)
