"""Decode-step time of the 61-layer dsv4 model: eager, graphflow PIECEWISE and FULL,
a hand-written CUDA graph, torch.compile(reduce-overhead), and the GPU busy time.

    PYTHONPATH=. python3 bench/dsv4_decode.py --out DIR [--layers 61] [--sizes 1,8,32]

Writes ``DIR/dsv4_decode.json`` and prints a table. Every graphflow row goes through
graphflow's own pipeline (``run_pipeline``) and runtime (``Runner``) on the bundled
61-layer plans (``plans/dsv4_61l_decode.yaml``, ``plans/dsv4_61l_full.yaml``), resized
with ``plan_variant`` to the benchmarked batch sizes. All rows share one model.

* eager: the PIECEWISE plan's step run eagerly (the model's natural eager path, with
  Python-int attention metadata);
* GPU busy: the sum of kernel (and memcpy/memset) times that ``torch.profiler`` records
  for one eager step; the floor any replay can reach. Measured for both steps: the
  PIECEWISE step's eager attention and the FULL step's static attention differ;
* hand-written FULL: ``torch.cuda.CUDAGraph`` over the same FULL step, inputs copied in
  before each replay, the same work the runner does;
* torch.compile: ``mode="reduce-overhead"`` on the FULL step, with every buffer passed
  in; its warm-up is the time of the first three calls, and whether inductor skipped
  CUDA graphs (and why) is recorded. It runs on an 8-layer model by default (with that
  model's graphflow FULL and eager times beside it): at 61 layers its warm-up did not
  finish within the 140 s a device run could give it;
* diagnostics, to say why a target is missed: "PW host" replays the PIECEWISE program
  with each eager attention given its lengths from the host (no per-layer read-back),
  with the host time spent inside attention; the heaviest kernels of each step, and how
  much the ones under 5 us add up to.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphflow.engine import run_pipeline  # noqa: E402
from graphflow.events import Phase  # noqa: E402
from graphflow.integrations.dsv4 import build_model  # noqa: E402
from graphflow.integrations.dsv4.attention import eager_attention  # noqa: E402
from graphflow.integrations.dsv4.plans import plan_variant  # noqa: E402
from graphflow.plan import Mode  # noqa: E402
from graphflow.runtime import Runner  # noqa: E402

POSITION = 200  # every sequence decodes its 201st token: 50 compressed entries + a 1-token tail


def _time(step, iters: int, warmup: int = 3) -> float:
    """Milliseconds per call, synchronized around the timed loop only."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


def _busy(step, iters: int = 3) -> tuple[float, float]:
    """GPU busy ms per step (sum of device self times) and kernels launched per step."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    busy_us = sum(e.self_device_time_total for e in events)
    kernels = sum(e.count for e in events if e.self_device_time_total > 0)
    return busy_us / 1e3 / iters, kernels / iters


def _top_kernels(step, top: int = 12) -> dict:
    """Where one step's GPU time goes: the heaviest kernels, and how much the tiny ones add up to."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages() if e.self_device_time_total > 0]
    kernels.sort(key=lambda k: -k[2])
    launches = sum(k[1] for k in kernels)
    tiny = [k for k in kernels if k[2] / k[1] < 5.0]
    return {
        "kernels": launches,
        "busy_ms": sum(k[2] for k in kernels) / 1e3,
        "under_5us": {"kernels": sum(k[1] for k in tiny), "ms": sum(k[2] for k in tiny) / 1e3},
        "top": [{"name": name[:90], "count": count, "ms": us / 1e3, "mean_us": us / count}
                for name, count, us in kernels[:top]],
    }


def _with_host_lengths(program, host_positions: list[int]):
    """The PIECEWISE program with each eager attention given its Python ints from the host.

    What an engine that keeps sequence lengths on the host (as serving engines do) would
    run: the same graphs and the same attention, minus the per-layer read-back. Returns
    the program and the host seconds each call to it spends inside attention.
    """
    spent = [0.0]

    def attention(layer, q, kv, positions, kv_cache, comp_cache, o):
        start = time.perf_counter()
        o.copy_(eager_attention(layer.layout, layer.compressor, q, kv, positions, host_positions, kv_cache, comp_cache))
        spent[0] += time.perf_counter() - start

    calls = []
    for call in program:
        if isinstance(call, functools.partial) and getattr(call.func, "__name__", "") == "attention":
            calls.append(functools.partial(attention, call.func.__self__, *call.args))
        else:
            calls.append(call)
    return calls, spent


def _run_all(calls) -> None:
    for call in calls:
        call()


def _hand_graph(engine, size: int, tokens, positions, iters: int) -> dict:
    """A bare torch.cuda.CUDAGraph over the FULL step on the engine's buffers."""
    views = engine.buffers.views(size)
    calls = engine.eager_calls(size)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            _run_all(calls)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()  # the pool's blocks stay reserved, not allocated, after capture
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph, stream=stream):
        _run_all(calls)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - start
    pool = torch.cuda.memory_reserved() - before

    def step():
        views["tokens"].copy_(tokens)
        views["positions"].copy_(positions)
        graph.replay()

    ms = _time(step, iters)
    graph.reset()
    return {"ms": ms, "capture_s": capture_s, "pool_reserved_bytes": pool}


class _SkipLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        message = record.getMessage()
        if "cudagraph" in message.lower():
            self.messages.append(message)


def _compiled(engine, size: int, tokens, positions, iters: int) -> dict:
    """torch.compile(mode="reduce-overhead") on the FULL step, every buffer an input."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._logging.set_logs(perf_hints=True)
    log = _SkipLog()
    # The skip reason goes to an artifact logger that does not propagate to "torch".
    loggers = [logging.getLogger(n) for n in ("torch", "torch._inductor.cudagraph_utils.__cudagraphs")]
    for logger in loggers:
        logger.addHandler(log)
    views = dict(engine.buffers.views(size))
    segments = [(tuple(s.reads) + tuple(w for w in s.writes if w not in s.reads), fn) for s, fn in engine.segments]

    def step(bufs):
        for names, fn in segments:
            fn(*[bufs[n] for n in names])

    compiled = torch.compile(step, mode="reduce-overhead")
    views["tokens"].copy_(tokens)
    views["positions"].copy_(positions)
    try:
        start = time.perf_counter()
        for _ in range(3):
            compiled(views)
        torch.cuda.synchronize()
        warmup_s = time.perf_counter() - start
        ms = _time(lambda: compiled(views), iters)
        error = None
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result to report, not a crash
        warmup_s, ms, error = None, None, f"{type(exc).__name__}: {exc}"[:500]
    finally:
        for logger in loggers:
            logger.removeHandler(log)
        torch._logging.set_logs()
    skips = int(counters["inductor"].get("cudagraph_skips", 0))
    torch._dynamo.reset()
    return {"ms": ms, "warmup_s": warmup_s, "cudagraph_skips": skips, "skip_messages": log.messages[:3],
            "error": error}


def _mode_summary(engine) -> dict:
    report = engine.report
    return {
        "graphs": report.graphs,
        "descriptors": len(report.descriptors),
        "warmup_s": report.phase(Phase.WARMUP).duration,
        "capture_s": report.phase(Phase.CAPTURE).duration,
        "verify_s": report.phase(Phase.VERIFY).duration,
        "pool_bytes": report.pool_bytes,
        "bit_exact": all(v.bit_exact for v in report.verify),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="folder for dsv4_decode.json")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--sizes", default="1,8,32", help="batch sizes, comma separated")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per row")
    parser.add_argument("--compile-sizes", default="1", help="batch sizes to run torch.compile at ('' for none)")
    parser.add_argument("--compile-layers", type=int, default=8,
                        help="layers of the model torch.compile runs on; its warm-up grows with depth, and at "
                             "61 layers it did not finish within a 140 s device budget")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("dsv4_decode: needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = tuple(int(s) for s in args.sizes.split(","))
    compile_sizes = {int(s) for s in args.compile_sizes.split(",") if s}
    overrides = {"n_layers": args.layers, "max_batch": max(sizes)}
    piecewise_plan = plan_variant(ROOT / "plans/dsv4_61l_decode.yaml", sizes=sizes, **overrides)
    full_plan = plan_variant(ROOT / "plans/dsv4_61l_full.yaml", sizes=sizes, **overrides)

    start = time.perf_counter()
    model = build_model(**piecewise_plan.model_args, device="cuda:0", plan=piecewise_plan)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - start
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    modes = {}
    start = time.perf_counter()
    piecewise = run_pipeline(piecewise_plan, backend="cuda", model=model)
    modes["PIECEWISE"] = {**_mode_summary(piecewise), "pipeline_s": time.perf_counter() - start}
    start = time.perf_counter()
    full = run_pipeline(full_plan, backend="cuda", model=model)
    modes["FULL"] = {**_mode_summary(full), "pipeline_s": time.perf_counter() - start}

    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "layers": args.layers,
        "model_args": dict(piecewise_plan.model_args),
        "weight_bytes": weight_bytes,
        "build_s": build_s,
        "position": POSITION,
        "modes": modes,
        "rows": [],
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every row, so a run cut short still leaves its numbers
        (out / "dsv4_decode.json").write_text(json.dumps(result, indent=2))

    generator = torch.Generator(device="cuda").manual_seed(0)
    inputs = {}
    for size in sizes:
        tokens = torch.randint(0, model.config.vocab_size, (size,), device="cuda", generator=generator)
        positions = torch.full((size,), POSITION, device="cuda", dtype=torch.int64)
        inputs[size] = tokens, positions
        for engine in (piecewise, full):
            views = engine.buffers.views(size)
            views["tokens"].copy_(tokens)
            views["positions"].copy_(positions)
        eager_calls = piecewise.eager_calls(size)
        full_calls = full.eager_calls(size)
        row = {"batch": size}
        row["eager_ms"] = _time(lambda: _run_all(eager_calls), max(3, args.iters // 4))
        row["busy_piecewise_ms"], row["kernels_piecewise"] = _busy(lambda: _run_all(eager_calls))
        row["busy_full_ms"], row["kernels_full"] = _busy(lambda: _run_all(full_calls))
        runner_pw, runner_full = Runner(piecewise), Runner(full)
        row["piecewise_ms"] = _time(lambda: runner_pw.run(tokens, positions), args.iters)
        row["full_ms"] = _time(lambda: runner_full.run(tokens, positions), args.iters)
        program = piecewise.programs[next(d for d in piecewise.programs if d.size == size and d.mode is Mode.PIECEWISE)]
        host_calls, spent = _with_host_lengths(program, [POSITION] * size)
        row["piecewise_host_lengths_ms"] = _time(lambda: _run_all(host_calls), args.iters)
        spent[0] = 0.0
        _run_all(host_calls)
        torch.cuda.synchronize()
        row["attention_host_ms"] = spent[0] * 1e3
        if size == min(sizes):
            row["full_kernels"] = _top_kernels(lambda: _run_all(full_calls))
            row["piecewise_kernels"] = _top_kernels(lambda: _run_all(eager_calls))
        row["hand_full"] = _hand_graph(full, size, tokens, positions, args.iters)
        row["hand_full_ms"] = row["hand_full"]["ms"]
        result["rows"].append(row)
        save()
        print(f"B={size}: eager {row['eager_ms']:.2f} ms, PIECEWISE {row['piecewise_ms']:.2f}, "
              f"FULL {row['full_ms']:.2f}, busy {row['busy_full_ms']:.2f}", flush=True)
    if compile_sizes:
        compile_layers = min(args.compile_layers, args.layers)
        compile_engine = full
        if compile_layers != args.layers:
            small = plan_variant(ROOT / "plans/dsv4_61l_full.yaml", sizes=sizes, n_layers=compile_layers,
                                 max_batch=max(sizes))
            compile_engine = run_pipeline(small, backend="cuda", verify=False)
        for row in result["rows"]:
            if row["batch"] in compile_sizes:
                row["compile"] = {"layers": compile_layers,
                                  **_compiled(compile_engine, row["batch"], *inputs[row["batch"]], args.iters)}
                if compile_layers != args.layers:
                    runner = Runner(compile_engine)
                    calls = compile_engine.eager_calls(row["batch"])
                    batch_inputs = inputs[row["batch"]]
                    row["compile"]["same_layers_full_ms"] = _time(lambda: runner.run(*batch_inputs), args.iters)
                    row["compile"]["same_layers_eager_ms"] = _time(lambda: _run_all(calls), args.iters)
                save()
    _print_table(result)
    return 0


def _print_table(result: dict) -> None:
    print(f"dsv4 decode step, {result['layers']} layers, {result['device']}, torch {result['torch']} (ms/step)")
    head = ("B", "eager", "PIECEWISE", "PW host", "FULL", "hand FULL", "busy PW", "busy FULL",
            "FULL/busy", "PW/busy", "PWh/busy", "eager/FULL")
    print("  ".join(f"{h:>9}" for h in head))
    for row in result["rows"]:
        cells = (row["batch"], row["eager_ms"], row["piecewise_ms"], row["piecewise_host_lengths_ms"], row["full_ms"],
                 row["hand_full_ms"], row["busy_piecewise_ms"], row["busy_full_ms"],
                 row["full_ms"] / row["busy_full_ms"], row["piecewise_ms"] / row["busy_piecewise_ms"],
                 row["piecewise_host_lengths_ms"] / row["busy_piecewise_ms"], row["eager_ms"] / row["full_ms"])
        print("  ".join(f"{c:>9.2f}" if isinstance(c, float) else f"{c:>9}" for c in cells))
    print("PW host: the PIECEWISE program with attention given host-side lengths (no per-layer read-back)")
    for mode, m in result["modes"].items():
        print(f"{mode}: {m['graphs']} graphs for {m['descriptors']} descriptors, warmup {m['warmup_s']:.2f} s, "
              f"capture {m['capture_s']:.2f} s, verify {m['verify_s']:.2f} s, "
              f"pool {(m['pool_bytes'] or 0) / 2**20:.0f} MiB, bit-exact {m['bit_exact']}")
    for row in result["rows"]:
        for key in ("full_kernels", "piecewise_kernels"):
            if key in row:
                k = row[key]
                print(f"{key} B={row['batch']}: {k['kernels']:.0f} kernels, {k['busy_ms']:.2f} ms busy; "
                      f"{k['under_5us']['kernels']} under 5 us take {k['under_5us']['ms']:.2f} ms; top: "
                      + "; ".join(f"{t['name'][:40]} x{t['count']} {t['ms']:.2f} ms" for t in k["top"][:5]))
        if "compile" in row:
            c = row["compile"]
            print(f"torch.compile B={row['batch']} ({c['layers']} layers): {c['ms']} ms/step, warm-up {c['warmup_s']} s, "
                  f"cudagraph skips {c['cudagraph_skips']}: {c['skip_messages'][:1] or c['error'] or 'none'}; "
                  f"same model graphflow FULL {c.get('same_layers_full_ms')}, eager {c.get('same_layers_eager_ms')}")


if __name__ == "__main__":
    sys.exit(main())
