"""Saved graphs packed into flat arrays (``pack``), and laid out as the driver's
parameter structs in a new process (``lay_out``): a graph built at a few microseconds
a node.

The 61-layer plan's 67 graphs hold over half a million nodes. Kept as one object per
node (``SavedGraph``), unpickling them and filling the driver's structs field by field
costs some ten microseconds a node in Python: seconds, about what capturing them again
costs. So a graph is stored packed (``PackedGraph``): every kernel's argument bytes in
one buffer, its launch in a row of a table, the nodes each node waits for as index
arrays, and every device address as a (word, region, offset) triple. A new process
writes all addresses with one numpy operation and lays out the driver's parameter
structs for every kernel at once (``lay_out``); adding a node is then one foreign call
with pointers worked out beforehand (``graphflow.engine.restart.driver.build_all``).

``pack`` and ``PackedGraph.unpack`` convert between the two forms: the object form is
what is read from the driver and what two saves are compared in.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import numpy as np

from graphflow.engine.restart.saved import ARRAYS, Copy, Kernel, Memset, NodeKind, PackedGraph, SavedGraph

__all__ = ["KERNEL_PARAMS", "MEMSET_PARAMS", "Laid", "lay_out", "pack"]


#: ``CUDA_KERNEL_NODE_PARAMS`` (the ``_v2`` struct of CUDA 12 and 13), field by field.
KERNEL_PARAMS = np.dtype({
    "names": ["func", "grid", "block", "shared", "params", "extra", "kern", "ctx"],
    "formats": ["<u8", ("<u4", 3), ("<u4", 3), "<u4", "<u8", "<u8", "<u8", "<u8"],
    "offsets": [0, 8, 20, 32, 40, 48, 56, 64], "itemsize": 72})

#: ``CUDA_MEMSET_NODE_PARAMS``.
MEMSET_PARAMS = np.dtype({
    "names": ["dst", "pitch", "value", "element", "width", "height"],
    "formats": ["<u8", "<u8", "<u4", "<u4", "<u8", "<u8"],
    "offsets": [0, 8, 16, 20, 24, 32], "itemsize": 40})


def pack(graph: SavedGraph) -> PackedGraph:
    """``graph`` packed; an address that is not at a word of its kernel's arguments is
    refused (``ValueError``: the driver lays every pointer parameter on one)."""
    functions: dict[tuple[str, str, int], int] = {}
    regions: dict[str, int] = {}
    arrays: dict[str, list] = {name: [] for name in ARRAYS if name != "args"}
    arrays["dep_start"].append(0)
    arrays["args_start"].append(0)
    arrays["param_start"].append(0)
    args = bytearray()
    clusters, copies = [], []
    for index, (node, after) in enumerate(zip(graph.nodes, graph.after)):
        arrays["deps"].extend(after)
        arrays["dep_start"].append(len(arrays["deps"]))
        if isinstance(node, Kernel):
            arrays["kinds"].append(NodeKind.KERNEL)
            if node.cluster is not None:
                clusters.append((len(arrays["kernel_function"]), node.cluster))
            arrays["kernel_function"].append(functions.setdefault((node.library, node.name, node.max_shared),
                                                                  len(functions)))
            arrays["launch"].append((*node.grid, *node.block, node.shared))
            for pointer in sorted(node.pointers, key=lambda p: p.at):  # ascending: unpack searches them
                if pointer.at % 8 or not 0 <= pointer.at <= len(node.args) - 8:
                    raise ValueError(f"kernel {node.name}: an address at byte {pointer.at}, not at a word")
                arrays["pointer_word"].append((len(args) + pointer.at) // 8)
                arrays["pointer_region"].append(regions.setdefault(pointer.where.region, len(regions)))
                arrays["pointer_offset"].append(pointer.where.offset)
            args += node.args + bytes(-len(node.args) % 8)
            arrays["args_start"].append(len(args))
            arrays["arg_size"].append(len(node.args))
            arrays["param_offsets"].extend(node.offsets)
            arrays["param_start"].append(len(arrays["param_offsets"]))
        elif isinstance(node, Memset):
            arrays["kinds"].append(NodeKind.MEMSET)
            arrays["memsets"].append((node.pitch, node.value, node.element, node.width, node.height))
            arrays["memset_region"].append(regions.setdefault(node.dst.region, len(regions)))
            arrays["memset_offset"].append(node.dst.offset)
        elif isinstance(node, Copy):
            arrays["kinds"].append(NodeKind.COPY)
            copies.append((index, node))
        else:
            arrays["kinds"].append(NodeKind.EMPTY)
    packed = {name: np.asarray(values, dtype=ARRAYS[name][0]).tobytes() for name, values in arrays.items()}
    return PackedGraph(len(graph.nodes), tuple(functions), tuple(regions), tuple(clusters), tuple(copies),
                       args=bytes(args), **packed)


@attrs.frozen(eq=False)
class Laid:
    """A packed graph laid out for the driver in this process, its addresses written
    where each region lives now. The arrays must stay alive until every node is added
    (the driver copies a node's parameters when it is added).

    ``rows``: per node, its kind, the address its handle is written to, the address and
    count of the handles of the nodes it waits for, the address of its parameters, and
    for a node that waits for several, the range of ``deps`` to gather into ``scratch``
    just before it is added (its dependencies' handles exist only then)."""

    rows: list[tuple[int, int, int, int, int, int, int]]
    handles: np.ndarray
    deps: np.ndarray
    scratch: np.ndarray
    kernels: np.ndarray
    memsets: np.ndarray
    words: np.ndarray
    pointers: np.ndarray
    #: Copies by node index: (source address, destination address, the copy).
    copies: dict[int, tuple[int, int, Copy]]
    #: Kernel nodes launched as clusters, by node index.
    clusters: dict[int, tuple[int, int, int]]


def lay_out(graph: PackedGraph, places: Mapping[str, int],
            functions: Mapping[tuple[str, str, tuple[int, int, int]], int]) -> Laid:
    """``graph``'s driver structs, its addresses where ``places`` says each region lives
    and its kernels as ``functions`` (by library, name and block: a ``CUfunction`` handle;
    see ``PackedGraph.launches``)."""
    # Addresses are computed as int64 (user-space addresses fit): numpy turns a mix of
    # unsigned and signed 64-bit integers into floats.
    kinds, dep_start = graph.array("kinds"), graph.array("dep_start")
    deps = graph.array("deps")
    bases = np.array([places[name] for name in graph.regions], dtype=np.int64)
    words = graph.array("args").copy()
    words.view(np.int64)[graph.array("pointer_word")] = (bases[graph.array("pointer_region")]
                                                         + graph.array("pointer_offset"))
    args_start, param_start = graph.array("args_start"), graph.array("param_start")
    per_kernel = np.diff(param_start)
    owner = np.repeat(np.arange(len(per_kernel)), per_kernel)
    pointers = words.ctypes.data + args_start[:-1][owner] + graph.array("param_offsets").astype(np.int64)
    kernels = np.zeros(len(per_kernel), dtype=KERNEL_PARAMS)
    launch = graph.array("launch")
    if len(kernels):
        combos, each = graph.function_blocks()
        handle = np.array([functions[(*graph.functions[f][:2], (int(x), int(y), int(z)))] for f, x, y, z in combos],
                          dtype=np.int64)
        kernels["func"] = handle[each]
    kernels["grid"], kernels["block"], kernels["shared"] = launch[:, 0:3], launch[:, 3:6], launch[:, 6]
    kernels["params"] = np.where(per_kernel > 0, pointers.ctypes.data + 8 * param_start[:-1], 0)
    table = graph.array("memsets")
    memsets = np.zeros(len(table), dtype=MEMSET_PARAMS)
    memsets["dst"] = bases[graph.array("memset_region")] + graph.array("memset_offset")
    for column, field in enumerate(("pitch", "value", "element", "width", "height")):
        memsets[field] = table[:, column]

    count = np.diff(dep_start)
    first = dep_start[:-1]
    handles = np.zeros(graph.node_count, dtype=np.uint64)
    scratch = np.zeros(max(len(deps), 1), dtype=np.uint64)
    one, several = count == 1, count > 1
    waits = np.zeros(graph.node_count, dtype=np.int64)
    waits[one] = handles.ctypes.data + 8 * deps[first[one]]
    waits[several] = scratch.ctypes.data + 8 * first[several]
    params = np.zeros(graph.node_count, dtype=np.int64)
    is_kernel, is_memset = kinds == NodeKind.KERNEL, kinds == NodeKind.MEMSET
    params[is_kernel] = kernels.ctypes.data + KERNEL_PARAMS.itemsize * np.arange(len(kernels))
    params[is_memset] = memsets.ctypes.data + MEMSET_PARAMS.itemsize * np.arange(len(memsets))
    rows = list(zip(kinds.tolist(), (handles.ctypes.data + 8 * np.arange(graph.node_count)).tolist(), waits.tolist(),
                    count.tolist(), params.tolist(), np.where(several, first, 0).tolist(),
                    np.where(several, dep_start[1:], 0).tolist()))
    kernel_nodes = np.flatnonzero(is_kernel)
    copies = {index: (places[copy.src.region] + copy.src.offset, places[copy.dst.region] + copy.dst.offset, copy)
              for index, copy in graph.copies}
    return Laid(rows, handles, deps, scratch, kernels, memsets, words, pointers, copies,
                {int(kernel_nodes[ordinal]): dims for ordinal, dims in graph.clusters})
