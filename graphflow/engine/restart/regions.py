"""Where graphs point: named ranges of device memory, found again in a new process.

A captured kernel's arguments hold raw device addresses. A new process builds the same
model and buffers, but the allocator may put them elsewhere; so each address is saved
as a region and an offset (``AddressBook.where``) and written again from where that
region lives now (``places``). Regions are named for what they are, not where they
were: a model tensor by its attribute path, a static buffer by its name, the graph
pool's blocks by their order, other memory by the order it was met.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator

import attrs
import torch

from graphflow.engine.restart.saved import Place, Region

__all__ = ["AddressBook", "model_tensors", "pool_blocks"]

#: Memory that graphs point into outside the model, the buffers and the pool (a library's
#: workspace, a table the model keeps out of sight) is saved with its bytes up to this
#: size; above it the region is restored as scratch and the graphs that use it verified.
CONTENT_LIMIT = 64 << 20


class AddressBook:
    """Named ranges, and the range an address falls in.

    ``discover`` is asked about an address in no named range: it returns the allocation
    the address is in (start, size), or None for a value that is not a device address.
    It is asked once per value: a step's kernels pass the same constants (a norm's
    epsilon, a scale) at every layer, and a save reads every argument word of every
    node. Allocations do not change while a book is read, so a value that is no address
    stays none.
    """

    def __init__(self, discover: Callable[[int], tuple[int, int] | None] = lambda address: None) -> None:
        self._starts: list[int] = []
        self._ranges: list[tuple[int, int, str]] = []  # (start, end, name), sorted by start
        self.regions: dict[str, Region] = {}
        self.starts: dict[str, int] = {}
        self._discover = discover
        self._not_addresses: set[int] = set()
        self._met: set[str] = set()  # the regions ``where`` found an address in

    def add(self, name: str, kind: str, start: int, size: int) -> None:
        """A named range; one that overlaps a range already named is left out (a view
        of a tensor already listed, or a model tensor inside a static buffer)."""
        if size <= 0 or name in self.regions or self._at(start) is not None or self._at(start + size - 1) is not None:
            return
        index = bisect.bisect(self._starts, start)
        if index < len(self._ranges) and self._ranges[index][0] < start + size:
            return
        self._starts.insert(index, start)
        self._ranges.insert(index, (start, start + size, name))
        self.regions[name] = Region(name, kind, size)
        self.starts[name] = start

    def add_tensors(self, kind: str, named: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
        """Each tensor on ``device`` as the region ``kind:name``, its whole storage."""
        for name, tensor in named:
            if tensor.device == device:
                storage = tensor.untyped_storage()
                self.add(f"{kind}:{name}", kind, storage.data_ptr(), storage.nbytes())

    def add_pool_blocks(self, pools: Iterable[object]) -> None:
        """Each block of each graph pool as the region ``pool:N.B``, by pool and address."""
        for number, pool in enumerate(pools):
            for block, (start, size) in enumerate(pool_blocks(pool)):
                self.add(f"pool:{number}.{block}", "pool", start, size)

    def where(self, address: int) -> Place | None:
        """``address`` as a region and an offset; a new ``memory`` region for an
        allocation nothing named; None for a value that is no device address."""
        found = self._at(address)
        if found is None:
            if address in self._not_addresses:
                return None
            allocation = self._discover(address)
            if allocation is None:
                self._not_addresses.add(address)
                return None
            start, end = self._gap(address, *allocation)
            self.add(f"memory:{sum(r.kind == 'memory' for r in self.regions.values())}", "memory", start, end - start)
            found = self._at(address)
        start, _, name = found
        self._met.add(name)
        return Place(name, address - start)

    def pointed_into(self, read: Callable[[int, int], bytes]) -> dict[str, Region]:
        """Every region an address was found in (``where``), ``memory`` ones with their
        bytes (``read(start, size)``) where they are at most ``CONTENT_LIMIT``. Only
        those: a new process allocates each pool block and memory region saved, and the
        blocks that only graphs left unsaved used (a server's PIECEWISE keys) are
        memory no restored graph reads."""
        return {name: attrs.evolve(region, content=read(self.starts[name], region.size))
                if region.kind == "memory" and region.size <= CONTENT_LIMIT else region
                for name, region in self.regions.items() if name in self._met}

    def _gap(self, address: int, start: int, size: int) -> tuple[int, int]:
        """The part of the allocation ``[start, start + size)`` around ``address`` that no
        named range covers: an allocator puts a workspace and named tensors in one
        allocation, and the rest of it is its own region."""
        index = bisect.bisect(self._starts, address)
        end = start + size
        if index > 0:
            start = max(start, self._ranges[index - 1][1])
        if index < len(self._ranges):
            end = min(end, self._ranges[index][0])
        return start, end

    def _at(self, address: int) -> tuple[int, int, str] | None:
        index = bisect.bisect(self._starts, address) - 1
        if index >= 0:
            start, end, name = self._ranges[index]
            if start <= address < end:
                return self._ranges[index]
        return None


def model_tensors(model: object) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a model holds, by attribute path: parameters and buffers, and
    tensors kept as plain attributes (a rotary table, a lookup table), in lists, tuples
    and dicts too. The paths are the same in every process that builds the model the
    same way, which is what names a region."""
    seen: set[int] = set()

    def visit(path: str, value: object, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
        if isinstance(value, torch.Tensor):
            yield path, value
        elif depth > 0 and id(value) not in seen:
            seen.add(id(value))
            if isinstance(value, torch.nn.Module):
                plain = {key: item for key, item in vars(value).items() if not key.startswith("_")}
                items: Iterable = {**plain, **value._parameters, **value._buffers, **value._modules}.items()
            elif isinstance(value, dict):
                items = value.items()
            elif isinstance(value, (list, tuple)):
                items = enumerate(value)
            else:
                items = vars(value).items() if hasattr(value, "__dict__") and _ours(value) else ()
            for key, item in items:
                if isinstance(key, (str, int)) and not str(key).startswith("_"):
                    yield from visit(f"{path}.{key}" if path else str(key), item, depth - 1)

    yield from visit("", model, 12)


def _ours(value: object) -> bool:
    """An object of the model's own classes (not a library's), whose attributes are walked."""
    module = type(value).__module__ or ""
    return not module.startswith(("torch", "builtins", "typing", "collections", "functools", "threading"))


def pool_blocks(pool: object) -> list[tuple[int, int]]:
    """The graph pool's blocks as (start, size), by address."""
    return sorted((segment["address"], segment["total_size"]) for segment in torch.cuda.memory_snapshot()
                  if tuple(segment.get("segment_pool_id", ())) == tuple(pool))
