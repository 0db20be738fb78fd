"""Warm restart on the CPU: the address book, the saved files, the key, and the run
refusing saved graphs in one line and capturing. Building graphs from saved nodes needs
the driver: ``tests/cuda/test_cuda_restart.py`` runs it on a GPU, in fresh processes."""

from __future__ import annotations

import ctypes
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.restart import driver as restart_driver
from graphflow.engine.restart import regions as restart_regions
from graphflow.engine.restart import saved, store
from graphflow.engine.restart.driver import _args, _topological
from graphflow.engine.restart.key import differs
from graphflow.engine.restart.packed import pack
from graphflow.engine.restart.regions import AddressBook, model_tensors
from graphflow.engine.restart.run import SavedGraphsNotUsed
from plans.toy_model import build_toy, toy_plan


@st.composite
def _ranges(draw):
    """Disjoint ranges, as (start, size), at device-like addresses."""
    sizes = draw(st.lists(st.integers(1, 4096), min_size=1, max_size=12))
    gaps = draw(st.lists(st.integers(0, 4096), min_size=len(sizes), max_size=len(sizes)))
    start, ranges = 0x7F0000000000, []
    for size, gap in zip(sizes, gaps):
        start += gap
        ranges.append((start, size))
        start += size
    return ranges


@settings(max_examples=200, deadline=None)
@given(_ranges(), st.data())
def test_an_address_in_a_named_range_is_that_range_and_its_offset(ranges, data):
    book = AddressBook()
    for number, (start, size) in enumerate(ranges):
        book.add(f"buffer:{number}", "buffer", start, size)
    number = data.draw(st.integers(0, len(ranges) - 1))
    start, size = ranges[number]
    offset = data.draw(st.integers(0, size - 1))
    assert book.where(start + offset) == saved.Place(f"buffer:{number}", offset)
    end = ranges[-1][0] + ranges[-1][1]
    assert book.where(end + data.draw(st.integers(0, 1 << 20))) is None  # nothing allocated there
    assert list(book.pointed_into(lambda start, size: b"")) == [f"buffer:{number}"]


def test_a_range_overlapping_a_named_one_is_left_out():
    book = AddressBook()
    book.add("buffer:x", "buffer", 1000, 100)
    book.add("model:view", "model", 1050, 10)  # a view of the buffer
    book.add("model:around", "model", 900, 300)  # the buffer inside it
    assert list(book.regions) == ["buffer:x"]
    assert book.where(1060) == saved.Place("buffer:x", 60)


def test_an_allocation_nothing_names_becomes_a_memory_region_with_its_bytes_when_small():
    allocations = {(5000, 64), (9000, 1 << 27)}

    def discover(address):
        return next(((start, size) for start, size in allocations if start <= address < start + size), None)

    book = AddressBook(discover)
    book.add("pool:0.0", "pool", 1000, 100)
    assert book.where(1010) == saved.Place("pool:0.0", 10)
    assert book.where(5010) == saved.Place("memory:0", 10)
    assert book.where(9000 + 8) == saved.Place("memory:1", 8)
    assert book.where(1 << 40) is None
    regions = book.pointed_into(lambda start, size: bytes(size))
    assert regions["memory:0"].content == bytes(64)
    assert regions["memory:1"].content is None  # too large to keep: restored as scratch
    assert regions["pool:0.0"].content is None


def test_memory_around_named_tensors_in_one_allocation_is_a_region_of_its_own():
    book = AddressBook(lambda address: (1000, 1000) if 1000 <= address < 2000 else None)
    book.add("buffer:a", "buffer", 1200, 100)
    book.add("buffer:b", "buffer", 1500, 100)
    assert book.where(1350) == saved.Place("memory:0", 50)  # the gap between a and b: 1300..1500
    assert book.regions["memory:0"].size == 200
    assert book.where(1250) == saved.Place("buffer:a", 50)
    assert book.where(1900) == saved.Place("memory:1", 300)  # after b: 1600..2000


def test_a_value_that_is_no_address_is_asked_about_once():
    asked = []

    def discover(address):
        asked.append(address)
        return (5000, 64) if 5000 <= address < 5064 else None

    book = AddressBook(discover)
    for _ in range(3):
        assert book.where(0x3F800000_3F800000) is None  # two floats 1.0, in every layer's arguments
        assert book.where(5008) == saved.Place("memory:0", 8)
    assert asked == [0x3F800000_3F800000, 5008]


def test_the_model_s_tensors_are_found_by_path_plain_attributes_and_lists_too():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 3)
            self.register_buffer("scale", torch.ones(3))
            self.table = torch.zeros(4)  # kept out of parameters and buffers
            self.caches = [torch.zeros(2), torch.zeros(5)]

    found = dict(model_tensors(Block()))
    assert {"linear.weight", "linear.bias", "scale", "table", "caches.0", "caches.1"} <= set(found)
    assert found["caches.1"].shape == (5,)


def _run() -> saved.SavedRun:
    kernel = saved.Kernel("k", (1, 1, 1), (32, 1, 1), 0, bytes(16), (0, 8),
                          (saved.Pointer(0, saved.Place("pool:0.0", 16)),))
    graph = pack(saved.SavedGraph((kernel, saved.Empty()), ((), (0,))))
    return saved.SavedRun({"gpu": "a"}, {"pool:0.0": saved.Region("pool:0.0", "pool", 1024)},
                          (saved.SavedDescriptor(4, "full", (graph,)),))


def test_saved_graphs_read_back_as_written_and_a_manifest_says_what_they_are(tmp_path):
    store.write(_run(), tmp_path)
    assert store.load(tmp_path) == _run()
    assert '"nodes": 2' in (tmp_path / store.MANIFEST).read_text()


def test_a_graphs_file_that_would_make_anything_else_is_refused(tmp_path):
    (tmp_path / store.GRAPHS).write_bytes(pickle.dumps(subprocess.Popen))
    with pytest.raises(store.SavedGraphsError, match="subprocess.Popen is not part of saved graphs"):
        store.load(tmp_path)
    with pytest.raises(store.SavedGraphsError, match="holds no saved graphs"):
        store.load(tmp_path / "missing")


def test_the_key_says_which_parts_differ():
    current = {"gpu": "NVIDIA H100", "torch": "2.11.0", "plan": "aa", "model tensors": "bb"}
    assert differs(current, dict(current)) is None
    changed = {**current, "torch": "2.12.0", "plan": "cc"}
    assert differs(changed, current) == "plan; torch 2.12.0 when saved, 2.11.0"


def test_nodes_are_ordered_after_the_nodes_they_wait_for():
    before = [{2}, set(), {1}, {0, 2}]
    order = _topological(before)
    assert sorted(order) == [0, 1, 2, 3]
    assert all(order.index(b) < order.index(n) for n, bs in enumerate(before) for b in bs)


class _Params:
    def __init__(self, kernel_params=0, extra=0):
        self.kernelParams, self.extra = kernel_params, extra


def test_a_kernel_s_arguments_are_packed_at_their_offsets_from_either_form():
    first, second = ctypes.c_int32(7), ctypes.c_uint64(0x7F0000001234)
    listed = (ctypes.c_void_p * 2)(ctypes.addressof(first), ctypes.addressof(second))
    layout = [(0, 4), (8, 8)]
    want = (7).to_bytes(4, "little") + bytes(4) + (0x7F0000001234).to_bytes(8, "little")
    assert _args(_Params(kernel_params=ctypes.addressof(listed)), layout, "k") == want
    buffer = ctypes.create_string_buffer(want, len(want))
    size = ctypes.c_size_t(len(want))
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(size), 0)
    assert _args(_Params(extra=ctypes.addressof(extra)), layout, "k") == want


def test_saving_graphs_from_a_backend_that_records_none_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ValueError, match="records no graphs to save"):
        run_pipeline(toy_plan(layers=2), RunOptions(backend="cpu", save_graphs=tmp_path), model=build_toy())


def test_saved_graphs_are_refused_for_a_lazy_engine(tmp_path):
    with pytest.raises(ValueError, match="captured in the foreground"):
        run_pipeline(toy_plan(layers=2), RunOptions(backend="cpu", lazy=True, graphs_from=tmp_path), model=build_toy())


@pytest.mark.parametrize("written", [False, True])
def test_saved_graphs_that_cannot_be_used_are_refused_in_one_line_and_the_run_captures(tmp_path, written):
    if written:
        store.write(_run(), tmp_path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine = run_pipeline(toy_plan(layers=2), RunOptions(backend="cpu", graphs_from=tmp_path), model=build_toy())
    try:
        refused = [w for w in said if issubclass(w.category, SavedGraphsNotUsed)]
        assert len(refused) == 1 and "\n" not in str(refused[0].message)
        why = "the cpu backend replays no graphs" if written else "holds no saved graphs"
        assert why in str(refused[0].message) and engine.report.restart.refused == str(refused[0].message)
        assert set(engine.programs) == set(toy_plan(layers=2).descriptors())  # captured as without saved graphs
        assert all(r.bit_exact for r in engine.report.verify)
    finally:
        engine.close()


def test_graphflow_run_says_why_saved_graphs_were_not_used_and_runs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "graphflow", "run", "plans/toy_full.yaml", "--backend", "cpu",
                           "--graphs-from", str(tmp_path), "--quiet"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"graphflow: saved graphs in {tmp_path} not used ({tmp_path} holds no saved graphs" in done.stderr
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr
    saving = subprocess.run([sys.executable, "-m", "graphflow", "run", "plans/toy_full.yaml", "--backend", "cpu",
                             "--save-graphs", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert saving.returncode == 2 and "records no graphs to save" in saving.stderr


class _FakeDriver:
    """What ``siblings`` asks of the driver, answered from tables: modules of JIT
    functions (by handle), and libraries of kernels."""

    class CUfunction_attribute:  # noqa: N801 - the driver's name
        def __getattr__(self, name):
            return name

    CUfunction_attribute = CUfunction_attribute()

    def __init__(self, modules, libraries):
        # handle -> [(name, regs, parameters)], handle -> [names]
        self.modules, self.libraries = modules, libraries

    def CUkernel(self, value):  # noqa: N802 - the driver's name
        return value

    def cuFuncGetModule(self, func):  # noqa: N802
        return 0, func // 100

    def cuModuleGetFunctionCount(self, module):  # noqa: N802
        return 0, len(self.modules[module])

    def cuModuleEnumerateFunctions(self, count, module):  # noqa: N802
        return 0, [module * 100 + index for index in range(count)]

    def cuFuncGetName(self, func):  # noqa: N802
        return 0, self.modules[func // 100][func % 100][0].encode()

    def cuFuncGetAttribute(self, attribute, func):  # noqa: N802
        return 0, self.modules[func // 100][func % 100][1] if attribute.endswith("NUM_REGS") else 0

    def cuFuncGetParamInfo(self, func, index):  # noqa: N802 - 8-byte parameters, one after another
        return (0, 8 * index, 8) if index < self.modules[func // 100][func % 100][2] else (1, 0, 0)

    def cuKernelGetLibrary(self, kernel):  # noqa: N802
        return 0, kernel // 100

    def cuLibraryGetKernelCount(self, library):  # noqa: N802
        return 0, len(self.libraries[library])

    def cuLibraryEnumerateKernels(self, count, library):  # noqa: N802
        return 0, [library * 100 + index for index in range(count)]

    def cuKernelGetName(self, kernel):  # noqa: N802
        return 0, self.libraries[kernel // 100][kernel % 100].encode()


class _Node:
    def __init__(self, kern=0, func=0):
        self.kern, self.func = kern, func


def test_kernels_of_one_name_are_told_apart_by_their_library_or_jit_specialization(monkeypatch):
    monkeypatch.setattr(restart_driver, "_LIBRARIES", {})
    fake = _FakeDriver(modules={1: [("rms", 32, 5)], 2: [("rms", 40, 5)], 3: [("rms", 32, 5)], 7: [("rms", 32, 4)]},
                       libraries={4: ["cos", "sin"], 5: ["cos", "exp"], 6: ["sin", "cos"]})
    jit = [restart_driver.siblings(fake, _Node(func=module * 100))[0] for module in (1, 2, 3, 7)]
    assert jit[0] != jit[1] and jit[0] == jit[2]  # two specializations of "rms"; the same one in another module
    assert jit[0] != jit[3]  # one with a parameter fewer (an argument the compiler made a constant)
    library, found = restart_driver.siblings(fake, _Node(kern=400))
    assert found == {"cos": 400, "sin": 401}
    assert library != restart_driver.siblings(fake, _Node(kern=500))[0]  # "cos" of another library
    assert library == restart_driver.siblings(fake, _Node(kern=600))[0]  # the same kernels, in any order


def test_two_saved_runs_are_compared_node_by_node_addresses_as_their_regions():
    from bench.restart_bench import saved_runs_differ

    def run(args: bytes, pool_block: str, library: str = "lib") -> saved.SavedRun:
        kernel = saved.Kernel("k", (1, 1, 1), (32, 1, 1), 0, args, (0, 8),
                              (saved.Pointer(0, saved.Place(pool_block, 16)),), library)
        graph = pack(saved.SavedGraph((saved.Empty(), kernel), ((), (0,))))
        return saved.SavedRun({}, {}, (saved.SavedDescriptor(4, "full", (graph,)),))

    same = bytes(8) + (5).to_bytes(8, "little")
    assert saved_runs_differ(run(same, "pool:0.1"), run(bytes(range(8)) + same[8:], "pool:0.7")) == {}
    other = bytes(8) + (6).to_bytes(8, "little")
    differs = saved_runs_differ(run(same, "pool:0.1"), run(other, "pool:0.1"))
    assert list(differs) == ["full B=4"] and "at 8: 0500000000000000 against 0600000000000000" in differs["full B=4"][0]
    assert "library lib against elsewhere" in saved_runs_differ(run(same, "pool:0.1"),
                                                                 run(same, "pool:0.1", "elsewhere"))["full B=4"][0]


def test_a_descriptor_the_driver_refuses_is_captured_and_the_others_are_restored(tmp_path, monkeypatch):
    """A restore keeps the largest part that works: a descriptor whose graph the driver
    refuses is captured instead (the graphs already built for it destroyed), every other
    one is built from its saved graphs, and the report says which was captured and why.
    What is tested is the restore's bookkeeping, with the driver and a graph-recording
    backend stood in for (``tests/cuda/test_cuda_restart.py`` builds real graphs)."""
    import attrs

    from graphflow.cli.capture_report import restart_line
    from graphflow.engine.backend import CpuBackend
    from graphflow.engine.restart import run as restart_run
    from graphflow.runtime import Runner

    class Recording(CpuBackend):
        captures_graphs = True

    class Functions:
        def add_graph(self, handle):
            pass

        def missing(self, kernels):
            return []

    refused = saved.Memset(saved.Place("pool:0.0", 0), 0, 0, 1, 13, 1)  # the node the stand-in driver refuses
    built, destroyed = [], []

    def build_all(graphs, places, functions, spent=None):
        results = []
        for graph in graphs:
            if refused in graph.unpack().nodes:
                results.append(restart_driver.DriverError("adding node 0 of 1 (memset): CUDA_ERROR_INVALID_VALUE"))
            else:
                built.append(len(built))
                results.append(built[-1])
        return results

    monkeypatch.setattr(restart_driver, "Functions", Functions)
    monkeypatch.setattr(restart_driver, "build_all", build_all)
    monkeypatch.setattr(restart_driver, "launcher", lambda executable: lambda: None)
    monkeypatch.setattr(restart_driver, "destroy", destroyed.append)
    monkeypatch.setattr(restart_run, "_handle", lambda graph: 0)
    monkeypatch.setattr(restart_regions, "pool_blocks", lambda pool: [])
    monkeypatch.setattr(restart_run, "restart_key", lambda plan, model, device: {"gpu": "stand-in"})
    plan = toy_plan(layers=2, sizes=(1, 2, 4))
    good = pack(saved.SavedGraph((saved.Empty(),), ((),)))
    bad = pack(saved.SavedGraph((refused,), ((),)))
    store.write(saved.SavedRun({"gpu": "stand-in"}, {"pool:0.0": saved.Region("pool:0.0", "pool", 64)}, (
        saved.SavedDescriptor(4, "PIECEWISE", (good, good, good)),
        saved.SavedDescriptor(2, "PIECEWISE", (good, bad, good)))), tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SavedGraphsNotUsed)
        engine = run_pipeline(plan, RunOptions(backend="cpu", graphs_from=tmp_path, verify="off"),
                              model=build_toy(layers=2), backend=Recording())
    try:
        restart = engine.report.restart
        assert (restart.restored, restart.captured, restart.refused) == (1, 2, None), restart.recaptured
        (line,) = restart.recaptured
        assert line.startswith("PIECEWISE(B=2): graph ") and line.endswith("CUDA_ERROR_INVALID_VALUE"), line
        # All built at once: B=4's three, and B=2's other two, destroyed at once for its refused one.
        assert built == [0, 1, 2, 3, 4] and sorted(destroyed) == [3, 4]
        assert f"1 descriptors restored from {tmp_path}, 2 captured" in restart_line(attrs.asdict(restart))
        assert "; captured PIECEWISE(B=2): graph " in restart_line(attrs.asdict(restart))
        runner = Runner(engine)
        x = torch.randn(2, 32)
        (captured_logits,) = runner.run(x.clone())[:1]
        expected = torch.empty(2, 64)
        build_toy(layers=2).step(x.clone(), expected)
        assert torch.equal(captured_logits, expected)  # B=2 was captured: it computes the model's step
    finally:
        engine.close()
    assert sorted(destroyed) == [0, 1, 2, 3, 4]  # closing the engine destroyed B=4's restored graphs


def test_the_restart_bench_runs_its_three_processes_on_the_cpu(tmp_path):
    """``bench/restart_bench.py --smoke``: the CPU records no graphs, so nothing is saved and
    the restoring process says so in one line and captures; every process's logits equal
    the plan's eager step, and the table and JSON say what each did."""
    import json
    import os

    done = subprocess.run([sys.executable, "bench/restart_bench.py", "--smoke", "--out", str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": "."}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "restart.json").read_text())
    assert result["device"] == "cpu"
    for role in ("capture", "restore", "changed"):
        assert all(result[role]["logits"]["eager_equal"].values()), role
    assert result["capture"]["restart"] is None
    refused = result["restore"]["restart"]["refused"]
    assert "holds no saved graphs" in refused and "\n" not in refused
    assert "restore " in done.stdout and "refused: saved graphs" in done.stdout


def test_a_descriptor_whose_kernels_are_not_here_says_which():
    from graphflow.engine.restart.run import fewest_captures

    class Functions:
        def __init__(self, absent):
            self.absent = absent

        def missing(self, kernels):
            return sorted(k for k in kernels if k[1] in self.absent)

    kernels = tuple(saved.Kernel(name, (1, 1, 1), (32, 1, 1), 0, b"", (), (), "lib") for name in "abcde")
    pending = {0: (None, saved.SavedDescriptor(4, "FULL", (pack(saved.SavedGraph(kernels, ((),) * 5)),)))}
    assert list(fewest_captures(Functions(set()), pending)) == []
    assert next(fewest_captures(Functions({"b"}), pending)) == (0, "1 kernel not found here (b)")
    assert next(fewest_captures(Functions(set("abcde")), pending)) == (0, "5 kernels not found here (a, b, c, ...)")


def test_the_fewest_descriptors_are_captured_to_find_every_kernel_library():
    """A kernel of a library the process has not used yet is found only through a graph
    that launches it; capturing a descriptor teaches every kernel of its libraries. The
    descriptor whose missing libraries the most others lack goes first, and once every
    library is known no more are captured."""
    from graphflow.engine.restart.run import fewest_captures
    from graphflow.plan import Descriptor, Mode

    class Functions:
        known = {"torch"}

        def missing(self, kernels):
            return sorted(k for k in kernels if k[0] not in self.known)

    def entry(size, *libraries):
        kernels = tuple(saved.Kernel(f"k-{lib}", (1, 1, 1), (32, 1, 1), 0, b"", (), (), lib)
                        for lib in ("torch", *libraries))
        return Descriptor(Mode.FULL, size), saved.SavedDescriptor(size, "FULL", (pack(saved.SavedGraph(
            kernels, ((),) * len(kernels))),))

    functions = Functions()
    pending = {1: entry(64, "gemm-wide"), 2: entry(32, "gemm-wide", "gemm-tall"), 3: entry(16, "gemm-tall"),
               4: entry(8), 5: entry(4, "gemm-small"), 6: entry(2, "gemm-small")}
    chosen = []
    for index, why in fewest_captures(functions, pending):
        chosen.append((index, why))
        descriptor, captured = pending.pop(index)
        functions.known |= {lib for lib, _ in captured.graphs[0].kernel_names}
    assert chosen == [(2, "2 kernels not found here (k-gemm-tall, k-gemm-wide)"),
                      (6, "1 kernel not found here (k-gemm-small)")]
    assert sorted(pending) == [1, 3, 4, 5]


def test_a_publish_that_fails_leaves_no_restored_graph_behind(monkeypatch):
    """Every graph built is on the rollback stack before any descriptor is published:
    a publish that raises part way, unwound, destroys the later descriptors' graphs too."""
    import types

    from graphflow.engine.restart import run as restart_run
    from graphflow.engine.rollback import UndoStack

    destroyed = []
    monkeypatch.setattr(restart_driver, "build_all", lambda graphs, *a, **k: list(range(100, 100 + len(graphs))))
    monkeypatch.setattr(restart_driver, "launcher", lambda executable: lambda: None)
    monkeypatch.setattr(restart_driver, "destroy", destroyed.append)
    monkeypatch.setattr(restart_run, "run_phase", lambda ctx, phases, phase, body: body())

    def publish(ctx, alloc, captured, descriptor, index, entry, graphs, places):
        if descriptor == "second":
            raise RuntimeError("publishing failed")

    monkeypatch.setattr(restart_run, "_publish", publish)
    ctx, entry = types.SimpleNamespace(stack=UndoStack()), types.SimpleNamespace(graphs=(1, 2))
    pending = {1: ("first", entry), 2: ("second", entry), 3: ("third", entry)}
    with pytest.raises(RuntimeError, match="publishing failed"):
        restart_run._build(ctx, None, None, pending, {}, None, {}, types.SimpleNamespace(times=[], phases=[]))
    assert ctx.stack.unwind() is None and sorted(destroyed) == list(range(100, 106))


def test_only_the_regions_saved_graphs_point_into_are_saved():
    """A restart allocates every saved pool block afresh: the blocks only graphs that were
    not saved used (a server's PIECEWISE keys, a descriptor left out) must not be among them."""
    book = AddressBook(lambda address: (9000, 64) if 9000 <= address < 9064 else None)
    book.add("model:w", "model", 100, 50)
    book.add("buffer:unread", "buffer", 200, 50)
    for block, start in enumerate((1000, 2000, 3000)):
        book.add(f"pool:0.{block}", "pool", start, 1000)
    for address in (120, 2500, 2600, 9010):
        assert book.where(address) is not None
    assert book.where(1 << 40) is None
    regions = book.pointed_into(lambda start, size: bytes(size))
    assert sorted(regions) == ["memory:0", "model:w", "pool:0.1"]
