"""What this machine's driver and torch offer for rebuilding captured graphs in a new process.

    PYTHONPATH=. python3 bench/restart_probe.py --out DIR     # GPU; prints and saves restart_probe.json

A warm restart rebuilds every graph of a plan without running the model's Python. That
needs, from a graph captured by torch: its nodes and edges, each kernel node's function
and argument bytes, a way to find the same function in another process, and device
addresses that are the same in both processes. Each is asked of the driver here, on a
captured graph of the kinds of kernels a model launches (cuBLAS matmuls, torch's
elementwise and reduction kernels, SDPA, an index copy), and answered with what it found:

* which driver calls the installed ``cuda.bindings`` has, and the driver's version;
* the graph's node types, and for each kernel node its name, parameter count and bytes;
* whether each kernel's function is found again by name, through its host stub in the
  library that holds it (``dlsym`` then the runtime's ``cudaGetFuncBySymbol``), and
  through the library's full symbol table (``nm``: hidden stubs too, at the library's load
  address): what a new process can do without re-running the model;
* whether a graph rebuilt from those nodes alone (``cuGraphCreate``, one node per node,
  the same edges) replays to the same bytes as torch's replay, and how long a rebuild and
  an instantiation take per node;
* whether a virtual address range reserved at a chosen address gets that address, in this
  process and in a fresh one (the fixed layout that keeps pointers in argument bytes valid);
* whether a fresh process finds each kernel again by a reference capture of its own at
  another batch size (cuBLAS and SDPA pick kernels by shape): by name among that graph's
  kernels, and among every function of the modules those kernels are in
  (``cuFuncGetModule``, ``cuModuleEnumerateFunctions``): how few captures a restart
  would need to find every function it rebuilds graphs with.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import pathlib
import subprocess
import sys
import time

import torch

CALLS = ("cuGraphGetNodes", "cuGraphGetEdges", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams",
         "cuGraphMemsetNodeGetParams", "cuGraphMemcpyNodeGetParams", "cuFuncGetName", "cuFuncGetParamInfo",
         "cuFuncGetParamCount", "cuFuncGetModule", "cuFuncIsLoaded", "cuModuleGetLoadingMode",
         "cuModuleEnumerateFunctions", "cuLibraryEnumerateKernels", "cuLibraryLoadData", "cuLibraryGetKernel",
         "cuKernelGetFunction", "cuKernelGetName", "cuGraphCreate", "cuGraphAddKernelNode", "cuGraphAddMemsetNode",
         "cuGraphInstantiate", "cuGraphExecUpdate", "cuGraphLaunch", "cuMemAddressReserve", "cuMemCreate",
         "cuMemMap", "cuMemSetAccess")
#: An address a range is asked for at: high in the user half of the address space.
HINT = 0x7F0000000000
RESERVE = 1 << 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--reserve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reserve_child:
        torch.cuda.init()
        print(json.dumps(_reserve()))
        return 0
    if args.reference_child:
        print(json.dumps(_reference(args.reference_child)))
        return 0
    from cuda.bindings import driver

    found: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name()}
    found["cuda_bindings"] = _version()
    found["driver"] = _ok(driver.cuDriverGetVersion())
    found["calls_missing"] = [name for name in CALLS if not hasattr(driver, name)]
    found["torch_offers"] = {"CUDAGraph.raw_cuda_graph": hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph"),
                             "CUDAGraph(keep_graph=)": _keeps_graph(),
                             "CUDAPluggableAllocator": hasattr(torch.cuda.memory, "CUDAPluggableAllocator"),
                             "MemPool": hasattr(torch.cuda, "MemPool")}
    graph, run, out = _captured()
    handle = driver.CUgraph(graph.raw_cuda_graph())
    nodes, edges = _nodes(driver, handle)
    found["nodes"] = _census(driver, nodes)
    found["edges"] = len(edges)
    found["kernels"] = kernels = [_kernel(driver, node) for node in nodes if _type(driver, node) == "KERNEL"]
    found["found_by_name"] = sum(k.get("found_by_name") is True for k in kernels)
    found["found_by_symtab"] = sum(k.get("found_by_symtab") is True for k in kernels)
    found["kernel_count"] = len(kernels)
    found["rebuilt"] = _rebuild(driver, nodes, edges, graph, run, out)
    found["reserve_here"] = _reserve()
    child = subprocess.run([sys.executable, __file__, "--reserve-child"], check=False, capture_output=True, text=True, timeout=120)
    found["reserve_fresh_process"] = json.loads(child.stdout.strip().splitlines()[-1]) if child.returncode == 0 \
        else {"error": child.stderr[-500:]}
    found["reference_capture"] = _found_by_reference([k["name"] for k in kernels])
    text = json.dumps(found, indent=1, default=str)
    print(text)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "restart_probe.json").write_text(text)
    return 0


def _version() -> str:
    try:
        from cuda.bindings import _version as version
        return version.__version__
    except (ImportError, AttributeError):
        return "?"


def _keeps_graph() -> bool:
    try:
        torch.cuda.CUDAGraph(keep_graph=True)
        return True
    except TypeError:
        return False


def _ok(result):
    """A cuda.bindings call's value (every call returns (error, *values)); raises on an error."""
    error, *values = result if isinstance(result, tuple) else (result,)
    if int(error) != 0:
        raise RuntimeError(f"{error!r}")
    return values[0] if len(values) == 1 else tuple(values) if values else None


def _captured(rows: int = 64):
    """A graph of the kernels a decoder step of ``rows`` tokens launches, captured by torch
    and kept (not only instantiated) so its nodes can be read."""
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, 1024, device=device, dtype=torch.bfloat16, generator=generator)
    w = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16, generator=generator) / 32
    cache = torch.zeros(4096, 8, 128, device=device, dtype=torch.bfloat16)
    index = torch.arange(0, rows * 16, 16, device=device)
    norm = torch.nn.LayerNorm(1024, device=device, dtype=torch.bfloat16)
    out = torch.empty(rows, 1024, device=device, dtype=torch.bfloat16)

    def run() -> None:
        h = torch.nn.functional.gelu(norm(x) @ w)
        q = h.view(1, rows, 8, 128).transpose(1, 2)
        cache.index_copy_(0, index, q.transpose(1, 2)[0])
        kv = cache.index_select(0, index).transpose(0, 1).unsqueeze(0)
        a = torch.nn.functional.scaled_dot_product_attention(q, kv, kv)
        out.copy_(torch.softmax(a.transpose(1, 2).reshape(rows, 1024).float(), -1).to(out.dtype) + h)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream):
        run()
    graph.instantiate()
    return graph, run, out


def _nodes(driver, handle):
    count = _ok(driver.cuGraphGetNodes(handle, 0))[1]
    nodes = list(_ok(driver.cuGraphGetNodes(handle, count))[0])
    edge_count = _ok(driver.cuGraphGetEdges(handle, 0))[-1]
    got = _ok(driver.cuGraphGetEdges(handle, edge_count))
    edges = list(zip(got[0], got[1]))
    return nodes, edges


def _type(driver, node) -> str:
    kind = _ok(driver.cuGraphNodeGetType(node))
    return kind.name.removeprefix("CU_GRAPH_NODE_TYPE_")


def _census(driver, nodes) -> dict:
    counts: dict = {}
    for node in nodes:
        kind = _type(driver, node)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _kernel(driver, node) -> dict:
    params = _ok(driver.cuGraphKernelNodeGetParams(node))
    func = params.func
    entry: dict = {"grid": [params.gridDimX, params.gridDimY, params.gridDimZ],
                   "block": [params.blockDimX, params.blockDimY, params.blockDimZ],
                   "shared_bytes": params.sharedMemBytes}
    try:
        entry["name"] = _ok(driver.cuFuncGetName(func)).decode()
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        entry["name"] = f"? {exc}"
    sizes = []
    for index in range(256):
        try:
            _, size = _ok(driver.cuFuncGetParamInfo(func, index))
        except Exception:  # noqa: BLE001 - past the last parameter
            break
        sizes.append(int(size))
    entry["param_bytes"] = sum(sizes)
    entry["params"] = len(sizes)
    entry["args_given_as"] = "kernelParams" if int(params.kernelParams or 0) else "extra" if int(params.extra or 0) \
        else "none"
    entry["module_loading"] = _loading_mode(driver)
    entry["library"], entry["found_by_name"] = _by_name(entry["name"], int(func))
    entry["symtab_library"], entry["found_by_symtab"] = _by_symtab(entry["name"], int(func))
    return entry


@functools.cache
def _loading_mode(driver) -> str:
    """The process's module loading mode (one answer per process)."""
    try:
        return str(_ok(driver.cuModuleGetLoadingMode()))
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        return f"? {exc}"


@functools.cache
def _loaded_libraries() -> dict[str, int]:
    """Each shared library the process has mapped, and where it is loaded (the start of
    its mapping at file offset 0), from one read of ``/proc/self/maps``: the kernels
    asked about are already loaded, so the list does not change while the probe runs."""
    bases: dict[str, int] = {}
    for line in pathlib.Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        path = parts[-1] if len(parts) >= 6 else ""
        if (path.endswith(".so") or ".so." in path) and int(parts[2], 16) == 0:
            bases.setdefault(path, int(parts[0].split("-")[0], 16))
    return bases


@functools.cache
def _library(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def _cudart():
    for path in _loaded_libraries():
        if "libcudart.so" in path:
            return _library(path)
    return None


def _by_name(name: str, func: int) -> tuple[str | None, bool | str]:
    """The library whose exported host stub has the kernel's name, and whether the
    runtime gives that stub's function back as the same function."""
    cudart = _cudart()
    if cudart is None:
        return None, "no libcudart loaded"
    for path in _loaded_libraries():
        try:
            library = _library(path)
            stub = ctypes.cast(getattr(library, name), ctypes.c_void_p).value
        except (OSError, AttributeError):
            continue
        got = ctypes.c_void_p()
        status = cudart.cudaGetFuncBySymbol(ctypes.byref(got), ctypes.c_void_p(stub))
        return pathlib.Path(path).name, status == 0 and (got.value or 0) == func
    return None, False


@functools.cache
def _symbols(path: str) -> dict[str, int]:
    """A library's defined symbols and their addresses, from its full symbol table (``nm``),
    local ones included: a host stub hidden from ``dlsym`` is still there unless stripped."""
    try:
        done = subprocess.run(["nm", "--defined-only", "-P", path], check=False, capture_output=True, text=True,
                              timeout=120)
    except (OSError, subprocess.TimeoutExpired):  # no nm here, or a library too large to list in time
        return {}
    table = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            table[parts[0]] = int(parts[2], 16)
    return table


def _by_symtab(name: str, func: int) -> tuple[str | None, bool | str]:
    """The library whose symbol table (not only its exports) holds the kernel's host stub,
    and whether the runtime gives the stub's function back as the same function: what a
    new process could do with the library's load address and the stub's offset."""
    cudart = _cudart()
    if cudart is None:
        return None, "no libcudart loaded"
    for path, base in _loaded_libraries().items():
        offset = _symbols(path).get(name)
        if offset is None:
            continue
        got = ctypes.c_void_p()
        status = cudart.cudaGetFuncBySymbol(ctypes.byref(got), ctypes.c_void_p(base + offset))
        return pathlib.Path(path).name, status == 0 and (got.value or 0) == func
    return None, False


def _rebuild(driver, nodes, edges, graph, run, out) -> dict:
    """Every node added again to a new graph from the parameters read back, the same edges,
    instantiated and launched: the same bytes as torch's replay?"""
    try:
        graph.replay()
        torch.cuda.synchronize()
        expected = out.clone()
        out.zero_()
        began = time.perf_counter()
        new = _ok(driver.cuGraphCreate(0))
        made = {}
        for node in nodes:
            kind = _type(driver, node)
            if kind == "KERNEL":
                params = _ok(driver.cuGraphKernelNodeGetParams(node))
                made[int(node)] = _ok(driver.cuGraphAddKernelNode(new, None, 0, params))
            elif kind == "MEMSET":
                params = _ok(driver.cuGraphMemsetNodeGetParams(node))
                context = _ok(driver.cuCtxGetCurrent())
                made[int(node)] = _ok(driver.cuGraphAddMemsetNode(new, None, 0, params, context))
            elif kind == "MEMCPY":
                params = _ok(driver.cuGraphMemcpyNodeGetParams(node))
                context = _ok(driver.cuCtxGetCurrent())
                made[int(node)] = _ok(driver.cuGraphAddMemcpyNode(new, None, 0, params, context))
            elif kind == "EMPTY":
                made[int(node)] = _ok(driver.cuGraphAddEmptyNode(new, None, 0))
            else:
                return {"rebuilt": False, "why": f"a {kind} node is not rebuilt by this probe"}
        for source, target in edges:
            _ok(driver.cuGraphAddDependencies(new, [made[int(source)]], [made[int(target)]], 1))
        built_s = time.perf_counter() - began
        began = time.perf_counter()
        executable = _ok(driver.cuGraphInstantiate(new, 0))
        instantiated_s = time.perf_counter() - began
        stream = torch.cuda.current_stream()
        _ok(driver.cuGraphLaunch(executable, driver.CUstream(stream.cuda_stream)))
        torch.cuda.synchronize()
        return {"rebuilt": True, "same_bytes": bool(torch.equal(out, expected)), "nodes": len(nodes),
                "build_us_per_node": built_s / len(nodes) * 1e6,
                "instantiate_us_per_node": instantiated_s / len(nodes) * 1e6}
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        return {"rebuilt": False, "why": f"{type(exc).__name__}: {exc}"}


def _reference(rows: int) -> dict:
    """In a fresh process: the kernel names of a capture at ``rows`` tokens, and the names
    of every function of the modules those kernels are in."""
    from cuda.bindings import driver

    graph, _, _ = _captured(rows)
    nodes, _ = _nodes(driver, driver.CUgraph(graph.raw_cuda_graph()))
    kernels = [_ok(driver.cuGraphKernelNodeGetParams(node)).func for node in nodes if _type(driver, node) == "KERNEL"]
    names = [_ok(driver.cuFuncGetName(func)).decode() for func in kernels]
    in_modules, errors = set(), set()
    for func in kernels:
        try:
            module = _ok(driver.cuFuncGetModule(func))
            count = _ok(driver.cuModuleGetFunctionCount(module))
            for sibling in _ok(driver.cuModuleEnumerateFunctions(count, module)):
                in_modules.add(_ok(driver.cuFuncGetName(sibling)).decode())
        except Exception as exc:  # noqa: BLE001 - a probe reports what failed
            errors.add(f"{type(exc).__name__}: {exc}"[:200])
    return {"rows": rows, "kernels": names, "module_functions": sorted(in_modules), "errors": sorted(errors)}


def _found_by_reference(names: list[str]) -> dict:
    """Of this graph's kernels (64 rows), how many a fresh process finds by a capture at
    another size (48 rows), by name in that graph and among its kernels' modules."""
    child = subprocess.run([sys.executable, __file__, "--reference-child", "48"], check=False, capture_output=True,
                           text=True, timeout=300)
    if child.returncode != 0:
        return {"error": child.stderr[-500:]}
    got = json.loads(child.stdout.strip().splitlines()[-1])
    in_graph, in_modules = set(got["kernels"]), set(got["module_functions"])
    return {"rows": got["rows"], "kernels": len(names), "in_its_graph": sum(n in in_graph for n in names),
            "in_its_modules": sum(n in in_modules or n in in_graph for n in names),
            "module_functions": len(in_modules), "missing": [n for n in names if n not in in_graph | in_modules],
            "errors": got["errors"]}


def _reserve() -> dict:
    """A virtual address range asked for at ``HINT``: the address the driver gave."""
    from cuda.bindings import driver

    try:
        _ok(driver.cuInit(0))
        granted = _ok(driver.cuMemAddressReserve(RESERVE, 0, HINT, 0))
        result = {"asked": hex(HINT), "got": hex(int(granted)), "same": int(granted) == HINT}
        _ok(driver.cuMemAddressFree(granted, RESERVE))
        return result
    except Exception as exc:  # noqa: BLE001 - a probe reports what failed
        return {"error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    sys.exit(main())
