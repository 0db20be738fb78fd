"""A captured graph as plain data: what a new process needs to build it again.

A graph is its nodes and, for each, the nodes it waits for. A kernel node keeps its
function by name (the same name finds the same function in another process,
``graphflow.engine.restart.driver.Functions``) and its argument bytes; every device address in
those bytes, and every memset's or copy's, is kept as a place in a named region (a
parameter of the model, a static buffer, a block of the graph pool, a block of memory
something else allocated) and an offset into it, so that it can be written again where
that region lives in the new process (``graphflow.engine.restart.regions``).

A graph is read as one object per node (``SavedGraph``) and stored packed into flat
arrays (``PackedGraph``, ``graphflow.engine.restart.packed``), the form a new process
builds it from quickly.
"""

from __future__ import annotations

import enum

import attrs
import numpy as np

__all__ = ["Copy", "Empty", "Kernel", "Matmul", "Memset", "NodeKind", "Output", "PackedGraph", "Place", "Pointer",
           "Region", "SavedDescriptor", "SavedGraph", "SavedRun", "TensorLayout"]


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


class NodeKind(enum.IntEnum):
    KERNEL = 0
    MEMSET = 1
    COPY = 2
    EMPTY = 3


#: Each array of a packed graph, by field: its dtype, and its columns where it is a table.
ARRAYS = {"kinds": ("u1", 0), "dep_start": ("<i8", 0), "deps": ("<i8", 0), "kernel_function": ("<i4", 0),
           "launch": ("<u4", 7), "args_start": ("<i8", 0), "arg_size": ("<i8", 0), "param_start": ("<i8", 0),
           "param_offsets": ("<u4", 0), "args": ("<u8", 0), "pointer_word": ("<i8", 0),
           "pointer_region": ("<i4", 0), "pointer_offset": ("<i8", 0), "memsets": ("<u8", 5),
           "memset_region": ("<i4", 0), "memset_offset": ("<i8", 0)}


@attrs.frozen
class PackedGraph:
    """One graph, packed. Every array is kept as bytes (``array`` reads it as numpy) so
    that a saved run unpickles as plain values. Kernels, memsets and the other nodes
    are numbered in node order within their kind.

    ``kinds``: each node's ``NodeKind``; ``dep_start``/``deps``: the nodes each node waits
    for (node ``i``'s are ``deps[dep_start[i]:dep_start[i + 1]]``). Per kernel:
    ``kernel_function`` (an index into ``functions``: library, name, dynamic shared
    memory allowed), ``launch`` (grid, block, shared bytes), its argument bytes at
    ``args_start`` in ``args`` (8-byte words, each kernel's from a word boundary;
    ``arg_size`` of them its own), its parameters' offsets at ``param_start`` in
    ``param_offsets``. Each address in the arguments: the word ``pointer_word`` of
    ``args`` (ascending) is ``pointer_offset`` bytes into ``regions[pointer_region]``.
    Per memset: ``memsets`` (pitch, value, element size, width, height) and its
    destination the same way. ``copies``: each copy node by node index
    (device-to-device copies are few)."""

    node_count: int
    functions: tuple[tuple[str, str, int], ...]
    regions: tuple[str, ...]
    clusters: tuple[tuple[int, tuple[int, int, int]], ...]
    copies: tuple[tuple[int, Copy], ...]
    kinds: bytes
    dep_start: bytes
    deps: bytes
    kernel_function: bytes
    launch: bytes
    args_start: bytes
    arg_size: bytes
    param_start: bytes
    param_offsets: bytes
    args: bytes
    pointer_word: bytes
    pointer_region: bytes
    pointer_offset: bytes
    memsets: bytes
    memset_region: bytes
    memset_offset: bytes

    def array(self, name: str) -> np.ndarray:
        dtype, columns = ARRAYS[name]
        values = np.frombuffer(getattr(self, name), dtype=dtype)
        return values.reshape(-1, columns) if columns else values

    @property
    def kernel_names(self) -> frozenset[tuple[str, str]]:
        """Each kernel's (library, name)."""
        return frozenset((library, name) for library, name, _ in self.functions)

    @property
    def launches(self) -> frozenset[tuple[str, str, int, tuple[int, int, int]]]:
        """Each kernel's (library, name, dynamic shared memory allowed) with each block it
        is launched with: a JIT compiler fixes the block into each specialization of a
        kernel (Triton's required thread count), which only the block then tells apart."""
        combos, _ = self.function_blocks()
        return frozenset((*self.functions[f], (int(x), int(y), int(z))) for f, x, y, z in combos)

    def function_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """Each distinct (index into ``functions``, block x, y, z) the kernels launch, and
        each kernel's row among them."""
        if not len(self.array("kernel_function")):
            return np.zeros((0, 4), dtype=np.int64), np.zeros(0, dtype=np.int64)
        combos, each = np.unique(np.column_stack([self.array("kernel_function").astype(np.int64),
                                                  self.array("launch")[:, 3:6].astype(np.int64)]),
                                 axis=0, return_inverse=True)
        return combos, each.reshape(-1)

    def unpack(self) -> SavedGraph:
        """The graph as one object per node."""
        kinds, dep_start, deps = self.array("kinds"), self.array("dep_start"), self.array("deps")
        args = self.array("args").tobytes()
        args_start, param_start = self.array("args_start"), self.array("param_start")
        offsets, launch, function = self.array("param_offsets"), self.array("launch"), self.array("kernel_function")
        word, region, offset = self.array("pointer_word"), self.array("pointer_region"), self.array("pointer_offset")
        sizes, clusters, copies = self.array("arg_size"), dict(self.clusters), dict(self.copies)
        memsets, memset_region, memset_offset = (self.array(name) for name in ("memsets", "memset_region",
                                                                               "memset_offset"))
        nodes: list[Node] = []
        kernel = memset = 0
        for index, kind in enumerate(kinds):
            if kind == NodeKind.KERNEL:
                start, end = args_start[kernel], args_start[kernel + 1]
                owned = slice(*np.searchsorted(word, [start // 8, end // 8]))
                pointers = tuple(Pointer(int(w) * 8 - int(start), Place(self.regions[r], int(o)))
                                 for w, r, o in zip(word[owned], region[owned], offset[owned]))
                library, name, max_shared = self.functions[function[kernel]]
                grid, block, shared = launch[kernel, 0:3], launch[kernel, 3:6], launch[kernel, 6]
                own_offsets = offsets[param_start[kernel]:param_start[kernel + 1]]
                size = int(sizes[kernel])
                nodes.append(Kernel(name, tuple(int(n) for n in grid), tuple(int(n) for n in block), int(shared),
                                    args[start:start + size], tuple(int(o) for o in own_offsets), pointers, library,
                                    clusters.get(kernel), max_shared))
                kernel += 1
            elif kind == NodeKind.MEMSET:
                pitch, value, element, width, height = (int(n) for n in memsets[memset])
                where = Place(self.regions[memset_region[memset]], int(memset_offset[memset]))
                nodes.append(Memset(where, pitch, value, element, width, height))
                memset += 1
            elif kind == NodeKind.COPY:
                nodes.append(copies[index])
            else:
                nodes.append(Empty())
        after = tuple(tuple(int(d) for d in deps[dep_start[i]:dep_start[i + 1]]) for i in range(self.node_count))
        return SavedGraph(tuple(nodes), after)



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
class TensorLayout:
    """A tensor as a matrix library sees it: shape, strides, dtype (as torch names it),
    and how its address is aligned (``graphflow.engine.restart.matmuls.alignment``)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    alignment: int


@attrs.frozen
class Matmul:
    """One call of a multiplication operator (``mm.default``), its arguments with each
    tensor as its ``TensorLayout`` (``graphflow.engine.restart.matmuls``)."""

    operator: str
    args: tuple
    kwargs: tuple[tuple[str, object], ...] = ()


@attrs.frozen
class SavedDescriptor:
    """One descriptor: its size and mode (as ``Descriptor``'s fields), its regions'
    graphs in the order its step replays them, the outputs kept where they are, and the
    distinct multiplications its step makes (run again to load their libraries). A
    server's key is saved as one too: its query tokens as ``size``, and ``key`` the key
    as its plan names it."""

    size: int
    mode: str
    graphs: tuple[PackedGraph, ...]
    outputs: tuple[Output, ...] = ()
    matmuls: tuple[Matmul, ...] = ()
    key: str = ""


@attrs.frozen
class SavedRun:
    """Everything saved of a committed run: what must match (``key``), the regions the
    graphs point into, and each descriptor."""

    key: dict
    regions: dict
    descriptors: tuple[SavedDescriptor, ...]
    #: Descriptors not saved, and why (a graph holding what cannot be built again).
    left_out: tuple[tuple[int, str, str], ...] = ()
