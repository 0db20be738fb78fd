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

import concurrent.futures
import contextlib
import ctypes
import functools
import hashlib
import os
import threading
import time
from collections.abc import Mapping, Sequence

import networkx as nx
import numpy as np
import torch

from graphflow.engine.restart.packed import Laid, lay_out
from graphflow.engine.restart.regions import AddressBook
from graphflow.engine.restart.saved import (
    Copy,
    Empty,
    Kernel,
    Memset,
    NodeKind,
    PackedGraph,
    Place,
    Pointer,
    SavedGraph,
)

__all__ = ["DriverError", "Functions", "Unsupported", "allocation", "build_all", "check_available", "destroy",
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
    module the resources each function uses). Two specializations may still use the same
    resources: Triton's RMSNorm for rows of 8192 (16 warps) and of 1536 (4 warps) did, and
    the wider one, found for the narrower one's node, was refused by the driver
    (``CUDA_ERROR_INVALID_VALUE``: Triton fixes each specialization's thread count). A
    JIT function is then found by the block a graph of this process launched it with
    (``launched``).

    A kernel the runtime loaded as part of a library (``cudaLibrary``, how CUDA 12 and
    later load a program's kernels) is a ``CUkernel`` in its node, found again through
    that library (``cuKernelGetLibrary``, ``cuLibraryEnumerateKernels``); asking a module
    of it crashes the driver. Only a kernel loaded as a module function (a JIT kernel,
    ``cuModuleLoadData``) is asked its module (``cuFuncGetModule``)."""

    def __init__(self) -> None:
        # Handles as ints: a handle object the bindings return in a list may not outlive it.
        self._kernels: dict[tuple[str, str], int] = {}  # (library, name) -> CUkernel
        self._functions: dict[tuple[str, str], int] = {}  # (library, name) -> CUfunction
        self._seen: dict[int, tuple[str, str]] = {}  # handle -> (library, name)
        self._loaded: set[int] = set()
        #: JIT functions by (library, name, block) as this process's graphs launch them.
        self.launched: dict[tuple[str, str, tuple[int, int, int]], int] = {}

    def add_graph(self, handle: int) -> None:
        driver = _driver()
        for node in _graph_nodes(driver, driver.CUgraph(handle)):
            if _ok(driver.cuGraphNodeGetType(node)) == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                params = _ok(driver.cuGraphKernelNodeGetParams(node))
                jit = not int(params.kern or 0)
                handle_of = int(params.func) if jit else int(params.kern)
                if handle_of not in self._seen:
                    library, kernels = siblings(driver, params)
                    table = self._functions if jit else self._kernels
                    for name, sibling in kernels.items():
                        table.setdefault((library, name), sibling)
                    self._seen[handle_of] = (library, _ok(driver.cuFuncGetName(params.func)).decode() if jit else "")
                if jit:
                    block = (int(params.blockDimX), int(params.blockDimY), int(params.blockDimZ))
                    self.launched.setdefault((*self._seen[handle_of], block), handle_of)

    def function(self, library: str, name: str, block: tuple[int, int, int] | None = None):
        """The ``CUfunction`` to launch ``name`` of ``library`` with ``block`` in the current
        context (the one this process launched so, where it did), loaded: under lazy
        module loading (torch's default) a handle from enumerating a module or from a
        library's kernel may be only partly loaded, and the driver loads such a function
        when it is launched, which adding a graph node is not."""
        driver = _driver()
        func = self.launched.get((library, name, block)) or self._functions.get((library, name))
        if func is None:
            kernel = driver.CUkernel(self._kernels[library, name])
            func = self._functions[library, name] = int(_ok(driver.cuKernelGetFunction(kernel), "cuKernelGetFunction"))
        if func not in self._loaded:
            state = _ok(driver.cuFuncIsLoaded(driver.CUfunction(func)), "cuFuncIsLoaded")
            if state != driver.CUfunctionLoadingState.CU_FUNCTION_LOADING_STATE_LOADED:
                _ok(driver.cuFuncLoad(driver.CUfunction(func)), "cuFuncLoad")
            self._loaded.add(func)
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
        shapes = [f"{name}:{_resources(driver, f)}:{_layout(driver, f)}" for name, f in zip(names, functions)]
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


#: Threads that build graphs at once: adding a node and instantiating a graph are
#: driver calls that release the GIL, and most of a graph's time is spent in them.
WORKERS = min(16, os.cpu_count() or 1)


def build_all(graphs: Sequence[PackedGraph], places: Mapping[str, int], functions: Functions,
              spent: dict | None = None, workers: int | None = None) -> list[int | DriverError]:
    """Each graph built again from its packed form, its addresses where ``places`` says
    each region now lives, and instantiated, ``workers`` at a time (``WORKERS``): per graph, the
    executable graph's handle (``launcher``) or the ``DriverError`` saying what the
    driver refused. Should this fail or be interrupted, every graph it built is
    destroyed. ``spent`` adds up the nodes added and the seconds adding and instantiating
    took, over all threads (``add_s``, ``instantiate_s``), and the time it all took
    (``wall_s``)."""
    driver = _driver()
    calls = _calls()
    context = int(_ok(driver.cuCtxGetCurrent()))
    wanted = {(library, name, block): max_shared for graph in graphs
              for library, name, max_shared, block in graph.launches}
    handles, unusable = {}, {}
    for (library, name, block), max_shared in wanted.items():
        try:
            func = functions.function(library, name, block)
            if max_shared:  # a function found again by name has the default limit until it is raised
                shared = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
                _ok(driver.cuFuncSetAttribute(func, shared, max_shared),
                    f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, {max_shared})")
        except DriverError as error:  # only the graphs that launch it are refused
            unusable[library, name] = DriverError(f"kernel {name[:80]}: {error}")
            continue
        handles[library, name, block] = int(func)
    totals = spent if spent is not None else {}
    lock = threading.Lock()
    threads = max(1, min(workers or WORKERS, len(graphs)))

    def attempt(graph: PackedGraph) -> int | DriverError:
        refused = next((unusable[key] for key in sorted(graph.kernel_names) if key in unusable), None)
        if refused is not None:
            return refused
        took: dict = {}
        try:
            return _build(driver, calls, context, graph, places, handles, took)
        except DriverError as error:
            return error
        finally:
            with lock:
                for key, value in took.items():
                    totals[key] = totals.get(key, 0) + value

    began = time.perf_counter()
    results: list[int | DriverError] = []
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="graphflow-build",
                                               initializer=_current, initargs=(context,)) as pool:
        futures = [pool.submit(attempt, graph) for graph in graphs]
        try:
            results = [future.result() for future in futures]
        except BaseException:
            for future in futures:
                future.cancel()
            concurrent.futures.wait(futures)
            for future in futures:
                if not future.cancelled() and future.exception() is None and isinstance(future.result(), int):
                    with contextlib.suppress(DriverError):  # the others are destroyed all the same
                        destroy(future.result())
            raise
    totals["wall_s"] = totals.get("wall_s", 0.0) + time.perf_counter() - began
    totals["threads"] = threads
    return results


def _current(context: int) -> None:
    """A build thread works in the context of the thread that started it."""
    driver = _driver()
    _ok(driver.cuCtxSetCurrent(driver.CUcontext(context)), "cuCtxSetCurrent")


class _Calls:
    """The driver calls a build makes per node, as plain foreign functions (``ctypes``:
    a call costs well under a microsecond, and releases the GIL), found with
    ``cuGetProcAddress`` in the form CUDA 12.0 defined them."""

    def __init__(self) -> None:
        driver = _driver()
        pointer, size = ctypes.c_void_p, ctypes.c_size_t

        def procedure(name: str, *argtypes):
            flags = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
            found = _ok(driver.cuGetProcAddress(name.encode(), 12000, flags), f"cuGetProcAddress({name})")
            address = int(found[0] if isinstance(found, tuple) else found)
            if not address:
                raise DriverError(f"the driver has no {name} of CUDA 12.0")
            return ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(address)

        self.add_kernel = procedure("cuGraphAddKernelNode", pointer, pointer, pointer, size, pointer)
        self.add_memset = procedure("cuGraphAddMemsetNode", pointer, pointer, pointer, size, pointer, pointer)
        self.add_empty = procedure("cuGraphAddEmptyNode", pointer, pointer, pointer, size)
        self.instantiate = procedure("cuGraphInstantiate", pointer, pointer, ctypes.c_ulonglong)


@functools.cache
def _calls() -> _Calls:
    return _Calls()


def _build(driver, calls: _Calls, context: int, packed: PackedGraph, places: Mapping[str, int],
           functions: Mapping[tuple[str, str, tuple[int, int, int]], int], took: dict) -> int:
    began = time.perf_counter()
    graph = int(_ok(driver.cuGraphCreate(0), "cuGraphCreate"))
    built = None
    try:
        laid = lay_out(packed, places, functions)
        handles, scratch, deps = laid.handles, laid.scratch, laid.deps
        add_kernel, add_memset, add_empty = calls.add_kernel, calls.add_memset, calls.add_empty
        for index, (kind, out, waits, count, params, first, end) in enumerate(laid.rows):
            if end:
                scratch[first:end] = handles[deps[first:end]]
            if kind == NodeKind.KERNEL:
                error = add_kernel(out, graph, waits, count, params)
            elif kind == NodeKind.MEMSET:
                error = add_memset(out, graph, waits, count, params, context)
            elif kind == NodeKind.EMPTY:
                error = add_empty(out, graph, waits, count)
            else:
                error = _add_copy(driver, graph, context, laid, index, count)
            if error:
                raise DriverError(f"adding node {index} of {packed.node_count} "
                                  f"({_what(driver, packed, index, functions, laid)}): {_result(driver, error)}")
        for index, dims in laid.clusters.items():
            value = driver.CUkernelNodeAttrValue()
            value.clusterDim.x, value.clusterDim.y, value.clusterDim.z = dims
            cluster = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            _ok(driver.cuGraphKernelNodeSetAttribute(driver.CUgraphNode(int(handles[index])), cluster, value),
                f"cuGraphKernelNodeSetAttribute(CLUSTER_DIMENSION, {dims}) of node {index}")
        added = time.perf_counter()
        executable = ctypes.c_void_p()
        error = calls.instantiate(ctypes.addressof(executable), graph, 0)
        if error:
            raise DriverError(f"instantiating a graph of {packed.node_count} nodes: cuGraphInstantiate: "
                              f"{_result(driver, error)}")
        took["add_s"] = added - began
        took["instantiate_s"] = time.perf_counter() - added
        took["nodes"] = packed.node_count
        built = int(executable.value)
    finally:
        error = int(driver.cuGraphDestroy(driver.CUgraph(graph))[0])
        if error and built is not None:  # the graph is kept from leaking with the executable made from it
            destroy(built)
            raise DriverError(f"cuGraphDestroy: {_result(driver, error)}")
    return built


def _add_copy(driver, graph: int, context: int, laid: Laid, index: int, count: int) -> int:
    """A device-to-device copy node, added through the bindings (copies are few); its
    handle written where ``laid.rows`` says; the driver's result."""
    source, destination, copy = laid.copies[index]
    params = driver.CUDA_MEMCPY3D()
    params.srcMemoryType = params.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    params.srcDevice, params.dstDevice = source, destination
    params.srcPitch, params.dstPitch = copy.src_pitch, copy.dst_pitch
    params.WidthInBytes, params.Height, params.Depth = copy.width, copy.height, 1
    after = [driver.CUgraphNode(handle) for handle in _waited(laid, index)] or None
    error, node = driver.cuGraphAddMemcpyNode(driver.CUgraph(graph), after, count, params, driver.CUcontext(context))
    if int(error) == 0:
        laid.handles[index] = int(node)
    return int(error)


def _waited(laid: Laid, index: int) -> list[int]:
    """The handles of the nodes node ``index`` waits for, where ``laid.rows`` points."""
    _, _, waits, count, _, _, _ = laid.rows[index]
    return [int(h) for h in np.frombuffer(ctypes.string_at(waits, 8 * count), dtype=np.uint64)] if count else []


def _result(driver, error: int) -> str:
    try:
        return driver.CUresult(error).name
    except ValueError:
        return f"CUresult {error}"


def _what(driver, packed: PackedGraph, index: int, functions: Mapping[tuple[str, str, tuple[int, int, int]], int],
          laid: Laid) -> str:
    """A node the driver refused, as an error names it: a kernel with its launch, the
    parameters it was saved with against those the function found here takes, and the
    dynamic shared memory that function allows; the handles of the nodes it waits for."""
    kinds = packed.array("kinds")
    after = _waited(laid, index)
    waiting = f"after {len(after)} node{'s' if len(after) != 1 else ''}" + (" (one not added)" if 0 in after else "")
    if kinds[index] != NodeKind.KERNEL:
        return f"{NodeKind(kinds[index]).name.lower()}, {waiting}"
    kernel = int(np.count_nonzero(kinds[:index] == NodeKind.KERNEL))
    library, name, _ = packed.functions[packed.array("kernel_function")[kernel]]
    grid, block, shared = (tuple(int(n) for n in row) for row in np.split(packed.array("launch")[kernel], [3, 6]))
    start, end = packed.array("param_start")[kernel:kernel + 2]
    saved = [int(o) for o in packed.array("param_offsets")[start:end]]
    func = driver.CUfunction(functions[library, name, block])
    here = [offset for offset, _ in _layout(driver, func)]
    allowed = _ok(driver.cuFuncGetAttribute(
        driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, func))
    return (f"kernel {name[:80]}, grid {grid}, block {block}, shared {shared[0]}; parameters at {saved}"
            + ("" if here == saved else f", the function found here takes them at {here}")
            + f", dynamic shared memory allowed {allowed}; {waiting}")


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
