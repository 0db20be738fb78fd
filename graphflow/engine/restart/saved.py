"""A captured graph as plain data: what a new process needs to build it again.

A graph is its nodes and, for each, the nodes it waits for. A kernel node keeps its
function by name (the same name finds the same function in another process,
``graphflow.engine.restart.driver.Functions``) and its argument bytes; every device address in
those bytes, and every memset's or copy's, is kept as a place in a named region (a
parameter of the model, a static buffer, a block of the graph pool, a block of memory
something else allocated) and an offset into it, so that it can be written again where
that region lives in the new process (``graphflow.engine.restart.regions``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from graphflow.engine.restart.packed import PackedGraph

__all__ = ["Copy", "Empty", "Kernel", "Memset", "Output", "Place", "Pointer", "Region", "SavedDescriptor",
           "SavedGraph", "SavedRun"]


@attrs.frozen
class Place:
    """A device address as a region and an offset into it."""

    region: str
    offset: int


@attrs.frozen
class Pointer:
    """A device address inside a kernel's argument bytes, ``at`` bytes in."""

    at: int
    where: Place


@attrs.frozen
class Kernel:
    """A kernel node. ``args`` is the packed argument buffer (each parameter at its
    offset, ``offsets``), as the driver lays it out; ``pointers`` the addresses in it.
    ``max_shared`` is the dynamic shared memory the function was allowed when it was
    captured (``cudaFuncSetAttribute``): a function found again by name in a new process
    has the default until it is set, and a launch above the default fails."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    args: bytes
    offsets: tuple[int, ...]
    pointers: tuple[Pointer, ...]
    #: The library the function was compiled in, as a fingerprint of its kernels' names.
    library: str = ""
    cluster: tuple[int, int, int] | None = None
    max_shared: int = 0


@attrs.frozen
class Memset:
    dst: Place
    pitch: int
    value: int
    element: int
    width: int
    height: int


@attrs.frozen
class Copy:
    """A device-to-device copy of ``height`` rows of ``width`` bytes."""

    src: Place
    dst: Place
    width: int
    height: int
    src_pitch: int
    dst_pitch: int


@attrs.frozen
class Empty:
    pass


Node = Kernel | Memset | Copy | Empty


@attrs.frozen
class SavedGraph:
    """A graph's nodes in an order where each comes after the nodes it waits for
    (``after``: their indices)."""

    nodes: tuple[Node, ...]
    after: tuple[tuple[int, ...], ...]


@attrs.frozen
class Region:
    """A range of device memory that graphs point into. ``kind``: ``model`` (a tensor of
    the model, by its attribute path), ``buffer`` (a static buffer), ``pool`` (a block of
    the graph pool: the graphs' own intermediates), ``memory`` (memory allocated outside
    all of these, a library's workspace or a tensor the model holds out of sight:
    ``content`` keeps its bytes when it is small enough to keep)."""

    name: str
    kind: str
    size: int
    content: bytes | None = None


@attrs.frozen
class Output:
    """An output a descriptor's graph returns where it wrote it (kept, not copied into
    its buffer: ``graphflow.engine.model.returned``), as a tensor over that place."""

    buffer: str
    where: Place
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@attrs.frozen
class SavedDescriptor:
    """One descriptor: its size and mode (as ``Descriptor``'s fields), its regions'
    graphs in the order its step replays them, and the outputs kept where they are."""

    size: int
    mode: str
    graphs: tuple[PackedGraph, ...]
    outputs: tuple[Output, ...] = ()


@attrs.frozen
class SavedRun:
    """Everything saved of a committed run: what must match (``key``), the regions the
    graphs point into, and each descriptor."""

    key: dict
    regions: dict
    descriptors: tuple[SavedDescriptor, ...]
    #: Descriptors not saved, and why (a graph holding what cannot be built again).
    left_out: tuple[tuple[int, str, str], ...] = ()
