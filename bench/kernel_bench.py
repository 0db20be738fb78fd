"""RMSNorm at the dsv4 model's shapes: the CuTe DSL kernel, the Triton kernel and PyTorch's.

Shapes: B rows of 2,048 (the 61-layer plan's hidden size: the attention, FFN and final
norms) and B rows of 8,192 (its hyper-connection norm over the 4 flattened streams),
B in {1, 8, 32, 128, 512}, float32 and bfloat16. For each shape the three backends run
side by side, round after round, in one process:

* ``graph_us``: device time per call as the captured model sees it: 100 calls captured
  in one CUDA graph, the graph replayed between CUDA events, divided by 100 (launch
  gaps inside a graph included, host overhead excluded); median over rounds.
* ``eager_us``: wall time per call issued eagerly (100 calls between events after a
  synchronize): what warmup, verify and eager breaks pay, host overhead included.
* ``max_abs_diff``: against PyTorch's result on the same input.

Then the prewarm of the 61-layer plans' specializations (bfloat16 rows of 2,048 and
8,192): the cold compile of each, its load from the registry's cache directory in a
fresh kernel object (what a second start pays), the first launch (the module load), and
``JitRegistry.prewarm`` after a warmup (what the pipeline's prewarm phase costs).

Run on a GPU from the repository root: ``python bench/kernel_bench.py --out DIR``
(with nvidia-cutlass-dsl importable for the CuTe column); writes
``DIR/kernel_bench.json`` and prints a table with the CuTe/Triton ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphflow.events import Phase  # noqa: E402
from graphflow.integrations.dsv4.kernels import jit_kernel  # noqa: E402
from graphflow.engine.jit import JitRegistry  # noqa: E402
from graphflow.engine.locus import Locus  # noqa: E402

BATCHES = (1, 8, 32, 128, 512)
ROWS = (2048, 8192)
DTYPES = (torch.float32, torch.bfloat16)
CALLS = 100
EPS = 1e-6


def backends() -> dict:
    """name → fn(x, w, out): the backends importable here, each writing ``out``."""
    found = {}
    cute, triton = jit_kernel("cute"), jit_kernel("triton")
    if cute is not None:
        found["cute"] = lambda x, w, out: cute(x, w, out, EPS)
    if triton is not None:
        found["triton"] = lambda x, w, out: triton(x, w, out, EPS)
    found["torch"] = lambda x, w, out: out.copy_(F.rms_norm(x, (x.shape[-1],), w, EPS))
    return found


def graph_us(fn, x, w, out, rounds: int) -> list[float]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x, w, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(CALLS):
            fn(x, w, out)
    graph.replay()
    times = []
    for _ in range(rounds):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1e3 / CALLS)
    del graph
    return times


def eager_us(fn, x, w, out, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            fn(x, w, out)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / CALLS)
    return times


def measure(rounds: int) -> list[dict]:
    found = backends()
    rows = []
    generator = torch.Generator(device="cuda").manual_seed(0)
    for dtype in DTYPES:
        for n in ROWS:
            for batch in BATCHES:
                x = torch.randn(batch, n, device="cuda", generator=generator).to(dtype)
                w = torch.randn(n, device="cuda", generator=generator).to(dtype)
                want = F.rms_norm(x, (n,), w, EPS)
                row = {"dtype": str(dtype).removeprefix("torch."), "n": n, "batch": batch}
                outs = {name: torch.empty_like(x) for name in found}
                samples = {name: {"graph": [], "eager": []} for name in found}
                for _ in range(rounds):  # side by side: each round runs every backend
                    for name, fn in found.items():
                        samples[name]["graph"] += graph_us(fn, x, w, outs[name], 3)
                        samples[name]["eager"] += eager_us(fn, x, w, outs[name], 1)
                for name in found:
                    row[f"{name}_graph_us"] = statistics.median(samples[name]["graph"])
                    row[f"{name}_eager_us"] = statistics.median(samples[name]["eager"])
                    row[f"{name}_max_abs_diff"] = float((outs[name].float() - want.float()).abs().max())
                if "cute" in found and "triton" in found:
                    row["cute_over_triton_graph"] = row["cute_graph_us"] / row["triton_graph_us"]
                rows.append(row)
    return rows


def prewarm_61l() -> dict | None:
    """The 61-layer plans' CuTe specializations: compile, cache load, first launch, prewarm."""
    from graphflow.integrations.dsv4.cute_rms import CuteRMSNorm

    result = {}
    with tempfile.TemporaryDirectory() as cache:
        registry = JitRegistry(cache_dir=cache)
        kernel = registry.register(CuteRMSNorm("bench.rms_norm"))
        calls = []
        for n in ROWS:
            x = torch.randn(512, n, device="cuda", dtype=torch.bfloat16)
            calls.append((x, torch.ones(n, device="cuda", dtype=torch.bfloat16), torch.empty_like(x), EPS))
        for args in calls:
            spec = registry.spec(kernel, args)
            start = time.perf_counter()
            kernel._ready(spec, args)
            compiled = time.perf_counter() - start
            fresh = JitRegistry(cache_dir=cache).register(CuteRMSNorm("bench.rms_norm"))
            start = time.perf_counter()
            how = fresh._ready(spec, args)
            loaded = time.perf_counter() - start
            torch.cuda.synchronize()
            start = time.perf_counter()
            kernel(*args)
            torch.cuda.synchronize()
            first = time.perf_counter() - start
            result[str(spec)] = {"compile_ms": compiled * 1e3, f"cache_{how}_ms": loaded * 1e3,
                                 "first_launch_ms": first * 1e3}
        # A pipeline's warmup as the registry follows it (run_pipeline attaches it to its
        # locus): each segment launches its specialization, then the prewarm phase.
        locus = Locus()
        registry.attach(locus)
        try:
            with locus.at(phase=Phase.WARMUP):
                for i, args in enumerate(calls):
                    with locus.segment(f"L{i}.pre"):
                        kernel(*args)
            with locus.at(phase=Phase.PREWARM):
                report = registry.prewarm({torch.device("cuda", torch.cuda.current_device()): torch.cuda.Stream()})
        finally:
            registry.detach(locus)
        result["prewarm"] = {"ms": report.seconds * 1e3, "summary": report.summary()}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out"))
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = measure(args.rounds)
    names = [n for n in ("cute", "triton", "torch") if f"{n}_graph_us" in rows[0]]
    header = f"{'dtype':>9} {'n':>5} {'B':>4} " + " ".join(f"{n + ' us':>10}" for n in names)
    header += "  cute/triton  " + " ".join(f"{n + ' eager':>11}" for n in names)
    print(header)
    for row in rows:
        line = f"{row['dtype']:>9} {row['n']:>5} {row['batch']:>4} "
        line += " ".join(f"{row[f'{n}_graph_us']:>10.2f}" for n in names)
        ratio = row.get("cute_over_triton_graph")
        line += f"  {ratio:>11.3f}  " if ratio is not None else f"  {'-':>11}  "
        line += " ".join(f"{row[f'{n}_eager_us']:>11.1f}" for n in names)
        print(line)
    try:
        prewarm = prewarm_61l() if "cute" in names else None
    except Exception as exc:  # noqa: BLE001 - the kernel rows above are kept either way
        prewarm = {"error": f"{type(exc).__name__}: {exc}"}
    if prewarm is not None:
        for spec, numbers in prewarm.items():
            if not isinstance(numbers, dict):  # the error that stopped it
                print(f"prewarm: {numbers}")
                continue
            print(f"{spec}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k}: {v}"
                                          for k, v in numbers.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
              "calls_per_graph": CALLS, "rounds": args.rounds, "rows": rows, "prewarm_61l": prewarm}
    (args.out / "kernel_bench.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'kernel_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
