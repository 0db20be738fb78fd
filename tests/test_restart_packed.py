"""Saved graphs packed into flat arrays, and laid out as the driver's parameter structs.

The structs are read back through cuda-python's own classes (``cuda.bindings.driver``,
which know the driver's layout), not through graphflow's: a wrong offset in graphflow's
struct layout fails here. Adding the nodes to a real graph is for the GPU
(``tests/cuda/test_cuda_restart.py``).
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphflow.engine.restart import driver as restart_driver
from graphflow.engine.restart import saved
from graphflow.engine.restart.packed import lay_out, pack
from graphflow.engine.restart.saved import NodeKind

bindings = pytest.importorskip("cuda.bindings.driver")

REGIONS = {"model:w": 0x7F00_0000_0000, "buffer:x": 0x7F10_0000_0000, "pool:0.0": 0x7E00_0000_1000}
FUNCTIONS = {("lib-a", "gemm"): 0x5000, ("lib-a", "norm"): 0x5100, ("lib-b", "gemm"): 0x5200}

places = st.builds(saved.Place, st.sampled_from(sorted(REGIONS)), st.integers(0, 1 << 20))


@st.composite
def kernels(draw):
    words = draw(st.integers(0, 8))
    size = 8 * words + draw(st.integers(0, 7) if words else st.just(0))
    args = draw(st.binary(min_size=size, max_size=size))
    at = sorted(draw(st.sets(st.integers(0, words - 1), max_size=words))) if words else []
    pointers = tuple(saved.Pointer(8 * word, draw(places)) for word in at)
    offsets = tuple(sorted(draw(st.sets(st.integers(0, max(size - 1, 0)), max_size=6)))) if size else ()
    library, name = draw(st.sampled_from(sorted(FUNCTIONS)))
    cluster = draw(st.none() | st.tuples(st.integers(2, 4), st.just(1), st.just(1)))
    return saved.Kernel(name, draw(st.tuples(*[st.integers(1, 1 << 16)] * 3)),
                        draw(st.tuples(*[st.integers(1, 1024)] * 3)), draw(st.integers(0, 1 << 16)), args, offsets,
                        pointers, library, cluster, draw(st.sampled_from((0, 1 << 17))))


nodes = st.one_of(
    kernels(),
    st.builds(saved.Memset, places, st.integers(0, 4096), st.integers(0, 2**32 - 1), st.sampled_from((1, 2, 4)),
              st.integers(1, 4096), st.integers(1, 8)),
    st.builds(saved.Copy, places, places, st.integers(1, 4096), st.integers(1, 8), st.integers(0, 4096),
              st.integers(0, 4096)),
    st.just(saved.Empty()))


@st.composite
def graphs(draw):
    count = draw(st.integers(0, 12))
    listed = [draw(nodes) for _ in range(count)]
    after = tuple(tuple(sorted(draw(st.sets(st.integers(0, index - 1), max_size=3)))) if index else ()
                  for index in range(count))
    return saved.SavedGraph(tuple(listed), after)


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_a_packed_graph_unpacks_to_the_same_nodes(graph):
    assert pack(graph).unpack() == graph


def test_an_address_off_a_word_is_refused_when_packing():
    kernel = saved.Kernel("k", (1, 1, 1), (1, 1, 1), 0, bytes(16), (0,), (saved.Pointer(4, saved.Place("x", 0)),))
    with pytest.raises(ValueError, match="an address at byte 4, not at a word"):
        pack(saved.SavedGraph((kernel,), ((),)))


def _by_launch(library: str, name: str, block: tuple[int, int, int]) -> int:
    """A handle per (library, name, block): a JIT kernel's specializations may differ by
    their block alone."""
    return FUNCTIONS[library, name] + 0x10 * (block[0] + 3 * block[1] + 7 * block[2])


class _Launched(dict):
    def __missing__(self, key):
        return _by_launch(*key)


def _address(place: saved.Place) -> int:
    return REGIONS[place.region] + place.offset


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_each_node_is_laid_out_as_the_driver_reads_it(graph):
    """Every kernel's struct, read by the bindings, launches its function with its launch
    shape and parameters whose bytes are the saved ones with each address where its
    region lives; each memset writes where its region lives; each node waits for the
    handles of the nodes it was saved after."""
    laid = lay_out(pack(graph), REGIONS, _Launched())
    laid.handles[:] = 0x9000 + np.arange(len(graph.nodes), dtype=np.uint64)  # as the driver would write them
    for index, (node, after) in enumerate(zip(graph.nodes, graph.after)):
        kind, handle_at, waits, count, params, first, end = laid.rows[index]
        assert handle_at == laid.handles.ctypes.data + 8 * index
        if end:  # gathered before the node is added, once its dependencies exist
            laid.scratch[first:end] = laid.handles[laid.deps[first:end]]
        waited = np.frombuffer(ctypes.string_at(waits, 8 * count), dtype=np.uint64) if count else []
        assert [int(h) - 0x9000 for h in waited] == list(after)
        if isinstance(node, saved.Kernel):
            assert kind == NodeKind.KERNEL
            struct = bindings.CUDA_KERNEL_NODE_PARAMS(_ptr=params)
            assert int(struct.func) == _by_launch(node.library, node.name, node.block)
            assert (struct.gridDimX, struct.gridDimY, struct.gridDimZ) == node.grid
            assert (struct.blockDimX, struct.blockDimY, struct.blockDimZ) == node.block
            assert struct.sharedMemBytes == node.shared and int(struct.extra or 0) == 0
            expected = bytearray(node.args)
            for pointer in node.pointers:
                expected[pointer.at:pointer.at + 8] = _address(pointer.where).to_bytes(8, "little")
            listed = int(struct.kernelParams or 0)
            assert bool(listed) == bool(node.offsets)
            each = ctypes.cast(listed, ctypes.POINTER(ctypes.c_void_p)) if listed else None
            ends = [*node.offsets[1:], len(node.args)]
            for number, (offset, stop) in enumerate(zip(node.offsets, ends)):
                assert ctypes.string_at(each[number], stop - offset) == bytes(expected[offset:stop])
            assert (laid.clusters.get(index)) == node.cluster
        elif isinstance(node, saved.Memset):
            assert kind == NodeKind.MEMSET
            struct = bindings.CUDA_MEMSET_NODE_PARAMS(_ptr=params)
            assert (int(struct.dst), struct.pitch, struct.value, struct.elementSize, struct.width, struct.height) == (
                _address(node.dst), node.pitch, node.value, node.element, node.width, node.height)
        elif isinstance(node, saved.Copy):
            assert kind == NodeKind.COPY and laid.copies[index] == (_address(node.src), _address(node.dst), node)
        else:
            assert kind == NodeKind.EMPTY


class _Calls:
    """The driver's per-node calls, stood in for: each node added gets the next handle;
    the node ``refuse`` is refused with CUDA_ERROR_INVALID_VALUE (1)."""

    def __init__(self, refuse: int | None = None) -> None:
        self.calls, self.refuse = 0, refuse
        self.lock = threading.Lock()

    def _add(self, out, graph, waits, count, params, context=None) -> int:
        with self.lock:
            call, self.calls = self.calls, self.calls + 1
        if call == self.refuse:
            return 1
        ctypes.c_uint64.from_address(out).value = 0x9000 + call
        return 0

    add_kernel = add_memset = _add

    def add_empty(self, out, graph, waits, count) -> int:
        return self._add(out, graph, waits, count, 0)

    def instantiate(self, executable, graph, flags) -> int:
        ctypes.c_void_p.from_address(executable).value = 0xE000 + graph
        return 0


class _Driver:
    """The few bindings calls a build makes around its nodes."""

    CUresult = bindings.CUresult
    CUfunction_attribute = bindings.CUfunction_attribute

    def __init__(self) -> None:
        self.graphs, self.destroyed = 0, []

    def cuCtxGetCurrent(self):  # noqa: N802 - the driver's names
        return 0, 0

    def cuCtxSetCurrent(self, context):  # noqa: N802
        return (0,)

    def CUcontext(self, value):  # noqa: N802
        return value

    def CUgraph(self, value):  # noqa: N802
        return value

    def cuGraphCreate(self, flags):  # noqa: N802
        self.graphs += 1
        return 0, self.graphs

    def cuGraphDestroy(self, graph):  # noqa: N802
        self.destroyed.append(graph)
        return (0,)

    def CUfunction(self, value):  # noqa: N802
        return value

    def cuFuncGetAttribute(self, attribute, func):  # noqa: N802
        return 0, 49152

    def cuFuncGetParamInfo(self, func, index):  # noqa: N802 - a function of two 8-byte parameters
        return (0, 8 * index, 8) if index < 2 else (1, 0, 0)


class _Functions:
    def function(self, library, name, block=None):
        return FUNCTIONS[library, name]


def _kernel(name: str) -> saved.Kernel:
    return saved.Kernel(name, (1, 1, 1), (32, 1, 1), 0, bytes(8), (0,), (), "lib-a")


@pytest.mark.parametrize("workers", [1, 3])
def test_graphs_build_on_threads_and_a_refused_node_is_named_for_its_graph_alone(monkeypatch, workers):
    """Each graph is built and instantiated on its own, a few at once: the one whose node
    the driver refuses comes back as that node's error, naming it, and the others are
    built; every graph being built is destroyed once instantiated or refused."""
    stand_in = _Driver()
    calls = _Calls(refuse=5)  # the 6th node added, on one thread: the second graph's third node
    monkeypatch.setattr(restart_driver, "_driver", lambda: stand_in)
    monkeypatch.setattr(restart_driver, "_calls", lambda: calls)
    graph = pack(saved.SavedGraph((saved.Empty(), _kernel("norm"), _kernel("gemm")), ((), (0,), (0, 1))))
    spent: dict = {}
    built = restart_driver.build_all([graph, graph, graph], REGIONS, _Functions(), spent, workers=workers)
    refused = [result for result in built if isinstance(result, restart_driver.DriverError)]
    assert len(refused) == 1 and sum(isinstance(result, int) for result in built) == 2
    if workers == 1:
        assert built[1] is refused[0]
        assert str(refused[0]) == (
            "adding node 2 of 3 (kernel gemm, grid (1, 1, 1), block (32, 1, 1), shared 0; parameters at [0], the "
            "function found here takes them at [0, 8], dynamic shared memory allowed 49152; after 2 nodes): "
            "CUDA_ERROR_INVALID_VALUE")
    assert sorted(stand_in.destroyed) == [1, 2, 3]
    assert spent["threads"] == min(workers, 3) and spent["nodes"] == 6  # the two graphs built


def test_an_interrupted_build_destroys_every_graph_it_built(monkeypatch):
    stand_in, made, destroyed = _Driver(), [], []
    monkeypatch.setattr(restart_driver, "_driver", lambda: stand_in)
    monkeypatch.setattr(restart_driver, "_calls", lambda: _Calls())
    monkeypatch.setattr(restart_driver, "destroy", destroyed.append)
    real = restart_driver._build

    def build(driver, calls, context, packed, places, functions, took):
        if packed.node_count == 2:
            raise KeyboardInterrupt
        made.append(real(driver, calls, context, packed, places, functions, took))
        return made[-1]

    monkeypatch.setattr(restart_driver, "_build", build)
    one = pack(saved.SavedGraph((saved.Empty(),), ((),)))
    two = pack(saved.SavedGraph((saved.Empty(), saved.Empty()), ((), (0,))))
    with pytest.raises(KeyboardInterrupt):
        restart_driver.build_all([one, one, two, one, one], REGIONS, _Functions(), workers=2)
    assert len(made) >= 2 and sorted(destroyed) == sorted(made)


def test_a_kernel_the_driver_will_not_give_refuses_only_the_graphs_that_launch_it(monkeypatch):
    stand_in = _Driver()
    monkeypatch.setattr(restart_driver, "_driver", lambda: stand_in)
    monkeypatch.setattr(restart_driver, "_calls", lambda: _Calls())

    class Functions:
        def function(self, library, name, block=None):
            if name == "gemm":
                raise restart_driver.DriverError("cuKernelGetFunction: CUDA_ERROR_NOT_FOUND")
            return FUNCTIONS[library, name]

    with_gemm = pack(saved.SavedGraph((_kernel("norm"), _kernel("gemm")), ((), (0,))))
    without = pack(saved.SavedGraph((_kernel("norm"),), ((),)))
    refused, built = restart_driver.build_all([with_gemm, without], REGIONS, Functions(), workers=1)
    assert str(refused) == "kernel gemm: cuKernelGetFunction: CUDA_ERROR_NOT_FOUND"
    assert isinstance(built, int) and stand_in.destroyed == [1]  # only the graph built was made at all


def test_a_function_found_by_name_is_loaded_before_a_node_is_made_of_it(monkeypatch):
    """Under lazy module loading, a handle from enumerating a module (a JIT kernel) or from
    a library's kernel may be only partly loaded: the driver loads such a function when it
    is launched, and a graph node is no launch. Each function is loaded once, before use."""
    calls = []

    class Driver:
        CUfunctionLoadingState = bindings.CUfunctionLoadingState

        def CUfunction(self, value):  # noqa: N802 - the driver's names
            return value

        def CUkernel(self, value):  # noqa: N802
            return value

        def cuKernelGetFunction(self, kernel):  # noqa: N802
            return 0, kernel + 1

        def cuFuncIsLoaded(self, func):  # noqa: N802
            calls.append(("is_loaded", func))
            loaded = func != 0x5101
            return 0, self.CUfunctionLoadingState(int(loaded))

        def cuFuncLoad(self, func):  # noqa: N802
            calls.append(("load", func))
            return (0,)

    monkeypatch.setattr(restart_driver, "_driver", lambda: Driver())
    functions = restart_driver.Functions()
    functions._functions[("jit", "norm")] = 0x5000
    functions._kernels[("lib", "gemm")] = 0x5100
    for _ in range(2):
        assert functions.function("jit", "norm") == 0x5000 and functions.function("lib", "gemm") == 0x5101
    assert calls == [("is_loaded", 0x5000), ("is_loaded", 0x5101), ("load", 0x5101)]


def test_a_jit_kernel_is_found_by_the_block_this_process_launched_it_with(monkeypatch):
    """Two specializations of one Triton kernel, in modules that use the same resources
    (the same fingerprint), differ by the block each is compiled for: a node is given the
    function this process launched with that node's block. Found by name alone, the
    16-warp RMSNorm was given to a 4-warp node and the driver refused it."""

    class Params:
        def __init__(self, func, threads):
            self.kern, self.func = 0, func
            self.blockDimX, self.blockDimY, self.blockDimZ = threads, 1, 1

    launches = {1: Params(0x7000, 512), 2: Params(0x7100, 128), 3: Params(0x7000, 512)}
    modules = {0x7000: 0xA000, 0x7100: 0xA100}

    class Driver:
        CUgraphNodeType = bindings.CUgraphNodeType
        CUfunction_attribute = bindings.CUfunction_attribute
        CUfunctionLoadingState = bindings.CUfunctionLoadingState

        def CUgraph(self, value):  # noqa: N802 - the driver's names
            return value

        def CUfunction(self, value):  # noqa: N802
            return value

        def cuGraphGetNodes(self, graph, count):  # noqa: N802
            return (0, list(launches)[:count], len(launches)) if count else (0, None, len(launches))

        def cuGraphNodeGetType(self, node):  # noqa: N802
            return 0, bindings.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL

        def cuGraphKernelNodeGetParams(self, node):  # noqa: N802
            return 0, launches[node]

        def cuFuncGetModule(self, func):  # noqa: N802
            return 0, modules[int(func)]

        def cuModuleGetFunctionCount(self, module):  # noqa: N802
            return 0, 1

        def cuModuleEnumerateFunctions(self, count, module):  # noqa: N802
            return 0, [next(f for f, m in modules.items() if m == module)]

        def cuFuncGetName(self, func):  # noqa: N802
            return 0, b"_rms_norm_rows"

        def cuFuncGetAttribute(self, attribute, func):  # noqa: N802 - the same resources for both
            return 0, 32

        def cuFuncGetParamInfo(self, func, index):  # noqa: N802
            return (0, 8 * index, 8) if index < 3 else (1, 0, 0)

        def cuFuncIsLoaded(self, func):  # noqa: N802
            return 0, bindings.CUfunctionLoadingState.CU_FUNCTION_LOADING_STATE_LOADED

    monkeypatch.setattr(restart_driver, "_driver", lambda: Driver())
    monkeypatch.setattr(restart_driver, "_LIBRARIES", {})
    functions = restart_driver.Functions()
    functions.add_graph(1)
    (library, name), = {(lib, n) for lib, n, _ in functions.launched}
    assert restart_driver._LIBRARIES[0xA000][0] == restart_driver._LIBRARIES[0xA100][0], "one fingerprint"
    assert functions.function(library, name, (128, 1, 1)) == 0x7100
    assert functions.function(library, name, (512, 1, 1)) == 0x7000
