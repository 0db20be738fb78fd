"""What a warm restart asks of the CUDA driver (``cuda.bindings``): a captured graph
read into plain data (``read``), plain data built into a graph ready to launch
(``build``), and a process's kernels found by name (``Functions``).

The driver's graph API is complete enough for this: a kernel node gives its function
and its argument bytes (``cuGraphKernelNodeGetParams``, laid out by
``cuFuncGetParamInfo``), a function its name (``cuFuncGetName``) and the other kernels
of its library or module (``cuLibraryEnumerateKernels``, ``cuModuleEnumerateFunctions``),
and a graph is built node by node (``cuGraphAdd*Node``) and instantiated without any
stream capture.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from collections.abc import Mapping

import networkx as nx
import torch

from graphflow.engine.restart.regions import AddressBook
from graphflow.engine.restart.saved import Copy, Empty, Kernel, Memset, Place, Pointer, SavedGraph

__all__ = ["DriverError", "Functions", "Unsupported", "allocation", "build", "check_available", "destroy",
           "driver_version", "launcher", "read", "siblings"]

_LOWEST_ADDRESS = 1 << 16  # smaller words are counts and flags, never device addresses


class DriverError(RuntimeError):
    """A driver call failed."""


class Unsupported(Exception):
    """A graph holds something a new process cannot build again (says what)."""


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise DriverError(NEEDS) from exc
    return driver


NEEDS = ("saving and restoring graphs needs cuda-python's driver bindings (cuda.bindings): "
         "pip install 'graphflow[restart]' (torch's CUDA 13 wheels bring them)")


def driver_version() -> str:
    """The CUDA driver's version, as ``13.0``."""
    version = int(_ok(_driver().cuDriverGetVersion()))
    return f"{version // 1000}.{version % 1000 // 10}"


def check_available() -> None:
    """Raise ``DriverError`` (saying what to install) where the driver bindings are missing."""
    _driver()


def _ok(result, call: str | None = None):
    """The values of a driver call's result; ``DriverError`` (naming ``call``) if it failed."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise DriverError(f"{call}: {error!r}" if call else repr(error))
    return values[0] if len(values) == 1 else tuple(values) if values else None


def read(handle: int, book: AddressBook) -> SavedGraph:
    """The graph ``handle`` (a ``cudaGraph_t``, ``CUDAGraph.raw_cuda_graph()``) as plain
    data; its addresses as places in ``book``'s regions (found there or added)."""
    driver = _driver()
    graph = driver.CUgraph(handle)
    nodes = _graph_nodes(driver, graph)
    edge_count = _ok(driver.cuGraphGetEdges(graph, 0))[-1]
    got = _ok(driver.cuGraphGetEdges(graph, edge_count)) if edge_count else ([], [])
    position = {int(node): index for index, node in enumerate(nodes)}
    before: list[set[int]] = [set() for _ in nodes]
    for source, target in zip(got[0], got[1]):
        before[position[int(target)]].add(position[int(source)])
    order = _topological(before)
    new_index = {old: new for new, old in enumerate(order)}
    saved = tuple(_node(driver, nodes[old], book) for old in order)
    after = tuple(tuple(sorted(new_index[b] for b in before[old])) for old in order)
    return SavedGraph(saved, after)


def _graph_nodes(driver, graph) -> list:
    count = _ok(driver.cuGraphGetNodes(graph, 0))[1]
    return list(_ok(driver.cuGraphGetNodes(graph, count))[0]) if count else []


def _topological(before: list[set[int]]) -> list[int]:
    """Node indices with each after those it waits for, else in the driver's order."""
    order = nx.DiGraph()
    order.add_nodes_from(range(len(before)))
    order.add_edges_from((source, node) for node, sources in enumerate(before) for source in sources)
    return list(nx.lexicographical_topological_sort(order))


def _node(driver, node, book: AddressBook):
    kind = _ok(driver.cuGraphNodeGetType(node))
    types = driver.CUgraphNodeType
    if kind == types.CU_GRAPH_NODE_TYPE_KERNEL:
        return _kernel(driver, node, book)
    if kind == types.CU_GRAPH_NODE_TYPE_MEMSET:
        params = _ok(driver.cuGraphMemsetNodeGetParams(node))
        return Memset(_where(book, int(params.dst), "a memset"), int(params.pitch), int(params.value),
                      int(params.elementSize), int(params.width), int(params.height))
    if kind == types.CU_GRAPH_NODE_TYPE_MEMCPY:
        return _copy(driver, _ok(driver.cuGraphMemcpyNodeGetParams(node)), book)
    if kind == types.CU_GRAPH_NODE_TYPE_EMPTY:
        return Empty()
    raise Unsupported(f"a {kind.name.removeprefix('CU_GRAPH_NODE_TYPE_').lower()} node")


def _where(book: AddressBook, address: int, what: str) -> Place:
    where = book.where(address)
    if where is None:
        raise Unsupported(f"{what} at {address:#x}, which is in no device allocation")
    return where


def _copy(driver, params, book: AddressBook) -> Copy:
    device = (driver.CUmemorytype.CU_MEMORYTYPE_DEVICE, driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED)
    if params.srcMemoryType not in device or params.dstMemoryType not in device or int(params.Depth) > 1:
        raise Unsupported("a copy from or to host memory, or of a 3-D extent")
    src = int(params.srcDevice) + int(params.srcXInBytes) + int(params.srcY) * int(params.srcPitch)
    dst = int(params.dstDevice) + int(params.dstXInBytes) + int(params.dstY) * int(params.dstPitch)
    return Copy(_where(book, src, "a copy's source"), _where(book, dst, "a copy's destination"),
                int(params.WidthInBytes), int(params.Height), int(params.srcPitch), int(params.dstPitch))


#: What the kernel nodes read need to know of each function (by handle): its name, its
#: library's fingerprint, its parameters' layout and its dynamic shared memory limit, read
#: from the driver once per function of the process (the 61-layer plan's graphs launch a
#: few hundred functions from a few hundred thousand nodes).
_FUNCTIONS: dict[int, tuple[str, str, list[tuple[int, int]], int]] = {}


def _function(driver, params) -> tuple[str, str, list[tuple[int, int]], int]:
    key = int(params.func)
    if key not in _FUNCTIONS:
        func = params.func
        max_shared = _ok(driver.cuFuncGetAttribute(
            driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, func))
        _FUNCTIONS[key] = (_ok(driver.cuFuncGetName(func)).decode(), siblings(driver, params)[0],
                           _layout(driver, func), int(max_shared))
    return _FUNCTIONS[key]


def _kernel(driver, node, book: AddressBook) -> Kernel:
    params = _ok(driver.cuGraphKernelNodeGetParams(node))
    name, library, layout, max_shared = _function(driver, params)
    args = _args(params, layout, name)
    pointers = []
    for offset, size in layout:
        for at in range((offset + 7) // 8 * 8, offset + size - 7, 8):
            word = int.from_bytes(args[at:at + 8], "little")
            if word >= _LOWEST_ADDRESS:
                where = book.where(word)
                if where is not None:
                    pointers.append(Pointer(at, where))
    cluster = None
    try:
        value = _ok(driver.cuGraphKernelNodeGetAttribute(
            node, driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION))
        dims = (int(value.clusterDim.x), int(value.clusterDim.y), int(value.clusterDim.z))
        cluster = dims if dims != (0, 0, 0) and dims != (1, 1, 1) else None
    except DriverError:
        pass
    return Kernel(name, (int(params.gridDimX), int(params.gridDimY), int(params.gridDimZ)),
                  (int(params.blockDimX), int(params.blockDimY), int(params.blockDimZ)), int(params.sharedMemBytes),
                  args, tuple(offset for offset, _ in layout), tuple(pointers), library, cluster, max_shared)


def _layout(driver, func) -> list[tuple[int, int]]:
    """Each parameter's (offset, size) in the packed argument buffer."""
    layout = []
    for index in range(4096):  # until the first index past the last (no count call in the 13.0 driver)
        try:
            offset, size = _ok(driver.cuFuncGetParamInfo(func, index))
        except DriverError:
            break
        layout.append((int(offset), int(size)))
    return layout


_BUFFER_POINTER, _BUFFER_SIZE = 1, 2


def _args(params, layout: list[tuple[int, int]], name: str) -> bytes:
    """The packed argument buffer, from either form a node keeps its arguments in."""
    total = max((offset + size for offset, size in layout), default=0)
    listed = int(params.kernelParams or 0)
    if listed:
        packed = bytearray(total)
        each = ctypes.cast(listed, ctypes.POINTER(ctypes.c_void_p))
        for index, (offset, size) in enumerate(layout):
            packed[offset:offset + size] = ctypes.string_at(each[index], size)
        return bytes(packed)
    extra = int(params.extra or 0)
    if extra:
        words = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
        buffer = length = None
        for index in range(0, 16, 2):
            key = words[index] or 0
            if key == 0:
                break
            if key == _BUFFER_POINTER:
                buffer = words[index + 1]
            elif key == _BUFFER_SIZE:
                length = ctypes.cast(words[index + 1], ctypes.POINTER(ctypes.c_size_t))[0]
        if buffer and length is not None:
            return ctypes.string_at(buffer, length)
    if total == 0:
        return b""
    raise Unsupported(f"kernel {name} keeps its arguments in a form not read here")


class Functions:
    """This process's kernels, by the library they were compiled in and their name: those
    of the graphs given (``add_graph``), and every other kernel of the same libraries (a
    library is one compiled unit: the kernels of one source file, for every shape it was
    built for).

    A name alone is not enough: the same template instance is compiled into several of
    torch's libraries, with code that may round differently, and a JIT compiler names
    every specialization of a kernel alike; so a kernel is found in the library whose
    kernels are the ones it was saved with (``siblings``: their names, and for a JIT
    module the resources each function uses).

    A kernel the runtime loaded as part of a library (``cudaLibrary``, how CUDA 12 and
    later load a program's kernels) is a ``CUkernel`` in its node, found again through
    that library (``cuKernelGetLibrary``, ``cuLibraryEnumerateKernels``); asking a module
    of it crashes the driver. Only a kernel loaded as a module function (a JIT kernel,
    ``cuModuleLoadData``) is asked its module (``cuFuncGetModule``)."""

    def __init__(self) -> None:
        # Handles as ints: a handle object the bindings return in a list may not outlive it.
        self._kernels: dict[tuple[str, str], int] = {}  # (library, name) -> CUkernel
        self._functions: dict[tuple[str, str], int] = {}  # (library, name) -> CUfunction
        self._seen: set[int] = set()

    def add_graph(self, handle: int) -> None:
        driver = _driver()
        for node in _graph_nodes(driver, driver.CUgraph(handle)):
            if _ok(driver.cuGraphNodeGetType(node)) == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                params = _ok(driver.cuGraphKernelNodeGetParams(node))
                handle_of = int(params.kern or 0) or int(params.func)
                if handle_of in self._seen:
                    continue
                self._seen.add(handle_of)
                library, kernels = siblings(driver, params)
                table = self._kernels if int(params.kern or 0) else self._functions
                for name, sibling in kernels.items():
                    table.setdefault((library, name), sibling)

    def function(self, library: str, name: str):
        """The ``CUfunction`` to launch ``name`` of ``library`` with in the current context."""
        driver = _driver()
        func = self._functions.get((library, name))
        if func is None:
            kernel = driver.CUkernel(self._kernels[library, name])
            func = self._functions[library, name] = int(_ok(driver.cuKernelGetFunction(kernel), "cuKernelGetFunction"))
        return driver.CUfunction(func)

    def missing(self, kernels) -> list[tuple[str, str]]:
        return sorted(key for key in kernels if key not in self._functions and key not in self._kernels)


_LIBRARIES: dict[int, tuple[str, dict[str, int]]] = {}


def siblings(driver, params) -> tuple[str, dict[str, int]]:
    """The kernel's library as a fingerprint of its kernels' names, and each of them by
    name (handles as ints); read once per library or module of the process."""
    kernel = int(params.kern or 0)
    if kernel:
        library = _ok(driver.cuKernelGetLibrary(driver.CUkernel(kernel)))
        key = int(library)
        if key not in _LIBRARIES:
            count = _ok(driver.cuLibraryGetKernelCount(library))
            found = {_ok(driver.cuKernelGetName(k)).decode(): int(k)
                     for k in (_ok(driver.cuLibraryEnumerateKernels(count, library)) if count else ())}
            _LIBRARIES[key] = (_fingerprint(found), found)
        return _LIBRARIES[key]
    module = _ok(driver.cuFuncGetModule(params.func))
    key = int(module)
    if key not in _LIBRARIES:
        count = _ok(driver.cuModuleGetFunctionCount(module))
        functions = _ok(driver.cuModuleEnumerateFunctions(count, module)) if count else ()
        names = [_ok(driver.cuFuncGetName(f)).decode() for f in functions]
        found = {name: int(f) for name, f in zip(names, functions)}
        shapes = [f"{name}:{_resources(driver, f)}" for name, f in zip(names, functions)]
        _LIBRARIES[key] = (_fingerprint(shapes), found)
    return _LIBRARIES[key]


#: What a compiled function uses, read back from the driver: a JIT compiler (Triton, the
#: CuTe DSL) names every specialization of one kernel alike, and these tell most apart.
_RESOURCES = ("NUM_REGS", "SHARED_SIZE_BYTES", "CONST_SIZE_BYTES", "LOCAL_SIZE_BYTES", "MAX_THREADS_PER_BLOCK",
              "PTX_VERSION", "BINARY_VERSION")


def _resources(driver, func) -> str:
    attribute = driver.CUfunction_attribute
    return ",".join(str(_ok(driver.cuFuncGetAttribute(getattr(attribute, f"CU_FUNC_ATTRIBUTE_{name}"), func)))
                    for name in _RESOURCES)


def _fingerprint(entries) -> str:
    """One library or module, as the hash of what each of its functions is (its name;
    for a JIT module, with the resources it uses)."""
    return hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()[:16]


def build(saved: SavedGraph, places: Mapping[str, int], functions: Functions, spent: dict | None = None) -> int:
    """The graph built again from ``saved``, its addresses where ``places`` says each
    region now lives, instantiated: the executable graph's handle (``launcher``).
    ``spent`` adds up the seconds of adding nodes and of instantiating (``add_s``,
    ``instantiate_s``), and the nodes added."""
    driver = _driver()
    began = time.perf_counter()
    context = _ok(driver.cuCtxGetCurrent())
    graph = _ok(driver.cuGraphCreate(0))
    try:
        made: list = []
        allowed: dict = {}
        for index, (node, after) in enumerate(zip(saved.nodes, saved.after)):
            try:
                made.append(_add(driver, graph, context, [made[i] for i in after], node, places, functions, allowed))
            except DriverError as error:
                raise DriverError(f"adding node {index} of {len(saved.nodes)} ({_what(node)}): {error}") from None
        added = time.perf_counter()
        try:
            executable = int(_ok(driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate"))
        except DriverError as error:
            raise DriverError(f"instantiating a graph of {len(saved.nodes)} nodes: {error}") from None
        if spent is not None:
            spent["add_s"] = spent.get("add_s", 0.0) + added - began
            spent["instantiate_s"] = spent.get("instantiate_s", 0.0) + time.perf_counter() - added
            spent["nodes"] = spent.get("nodes", 0) + len(saved.nodes)
        return executable
    finally:
        _ok(driver.cuGraphDestroy(graph))


def _what(node) -> str:
    """A node as an error names it."""
    if isinstance(node, Kernel):
        return f"kernel {node.name[:80]}, grid {node.grid}, block {node.block}, shared {node.shared}"
    return type(node).__name__.lower()


def _add(driver, graph, context, deps: list, node, places: Mapping[str, int], functions: Functions,
         allowed: dict[tuple[str, str], int]):
    """One saved node added to ``graph`` after ``deps``: its handle."""
    if isinstance(node, Kernel):
        return _add_kernel(driver, graph, deps, node, places, functions, allowed)
    if isinstance(node, Memset):
        params = driver.CUDA_MEMSET_NODE_PARAMS()
        params.dst = places[node.dst.region] + node.dst.offset
        params.pitch, params.value, params.elementSize = node.pitch, node.value, node.element
        params.width, params.height = node.width, node.height
        return _ok(driver.cuGraphAddMemsetNode(graph, deps, len(deps), params, context), "cuGraphAddMemsetNode")
    if isinstance(node, Copy):
        params = driver.CUDA_MEMCPY3D()
        params.srcMemoryType = params.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
        params.srcDevice = places[node.src.region] + node.src.offset
        params.dstDevice = places[node.dst.region] + node.dst.offset
        params.srcPitch, params.dstPitch = node.src_pitch, node.dst_pitch
        params.WidthInBytes, params.Height, params.Depth = node.width, node.height, 1
        return _ok(driver.cuGraphAddMemcpyNode(graph, deps, len(deps), params, context), "cuGraphAddMemcpyNode")
    return _ok(driver.cuGraphAddEmptyNode(graph, deps, len(deps)), "cuGraphAddEmptyNode")


def _add_kernel(driver, graph, deps, node: Kernel, places: Mapping[str, int], functions: Functions,
                allowed: dict[tuple[str, str], int]):
    """The kernel node added; its argument buffers are locals, alive until the driver has
    copied them (``cuGraphAddKernelNode`` does)."""
    func = functions.function(node.library, node.name)
    if node.max_shared > allowed.get((node.library, node.name), 0):
        shared = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _ok(driver.cuFuncSetAttribute(func, shared, node.max_shared),
            f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {node.max_shared})")
        allowed[node.library, node.name] = node.max_shared
    args = bytearray(node.args)
    for pointer in node.pointers:
        args[pointer.at:pointer.at + 8] = (places[pointer.where.region] + pointer.where.offset).to_bytes(8, "little")
    buffer = (ctypes.c_char * max(len(args), 1)).from_buffer(args) if args else None
    base = ctypes.addressof(buffer) if buffer is not None else 0
    each = (ctypes.c_void_p * max(len(node.offsets), 1))(*(base + offset for offset in node.offsets))
    params = driver.CUDA_KERNEL_NODE_PARAMS()
    params.func = func
    params.gridDimX, params.gridDimY, params.gridDimZ = node.grid
    params.blockDimX, params.blockDimY, params.blockDimZ = node.block
    params.sharedMemBytes = node.shared
    params.kernelParams = ctypes.addressof(each) if node.offsets else 0
    added = _ok(driver.cuGraphAddKernelNode(graph, deps, len(deps), params),
                f"cuGraphAddKernelNode ({len(node.offsets)} parameters, {len(node.args)} bytes)")
    if node.cluster is not None:
        value = driver.CUkernelNodeAttrValue()
        value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = node.cluster
        _ok(driver.cuGraphKernelNodeSetAttribute(
            added, driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, value),
            f"cuGraphKernelNodeSetAttribute(CLUSTER_DIMENSION, {node.cluster})")
    return added


def launcher(executable: int):
    """A call that launches the graph on torch's current stream (as ``CUDAGraph.replay``)."""
    driver = _driver()
    graph, launch, stream_of = driver.CUgraphExec(executable), driver.cuGraphLaunch, driver.CUstream
    current = torch.cuda.current_stream

    def replay() -> None:
        error = launch(graph, stream_of(current().cuda_stream))[0]
        if int(error) != 0:
            raise DriverError(f"launching a restored graph: {error!r}")

    return replay


def destroy(executable: int) -> None:
    driver = _driver()
    _ok(driver.cuGraphExecDestroy(driver.CUgraphExec(executable)))


def allocation(address: int) -> tuple[int, int] | None:
    """The device allocation ``address`` is in, as (start, size); None for a value that
    is no device address (the driver knows every allocation of the process)."""
    driver = _driver()
    error, start, size = driver.cuMemGetAddressRange(address)
    if int(error) != 0:
        return None
    return int(start), int(size)
