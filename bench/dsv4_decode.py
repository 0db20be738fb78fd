"""Decode-step time of the 61-layer dsv4 model: eager, graphflow PIECEWISE and FULL,
a hand-written CUDA graph, torch.compile(reduce-overhead), and the GPU busy time.

    PYTHONPATH=. python3 bench/dsv4_decode.py --out DIR [--layers 61] [--sizes 1,8,32]
    PYTHONPATH=. python3 bench/dsv4_decode.py --out DIR --smoke     # CPU, tiny model: checks the script

Writes ``DIR/dsv4_decode.json`` (after every row, and with the error of any part that
failed) and prints a table. Every graphflow row goes through graphflow's own pipeline
(``run_pipeline``) and runtime (``Runner``) on the bundled 61-layer plans
(``plans/dsv4_61l_decode.yaml``, ``plans/dsv4_61l_full.yaml``), resized with
``plan_variant`` to the benchmarked batch sizes. All rows share one model and one set
of inputs: B sequences at positions 200, 201, 202, 203, 200, … (sequence b decodes
token 201 + b % 4, so at B >= 4 some sequences fold a compressed entry this step).
The positions are given twice, as a serving engine's scheduler gives them: on the
device for the graphs and on the host (``positions_host``) for the eager attention.

* eager: the PIECEWISE plan's step run eagerly (the model's natural eager path);
* GPU busy: the sum of kernel (and memcpy/memset) times that ``torch.profiler`` records
  for one eager step; the floor any replay can reach. Measured for both steps: the
  PIECEWISE step's eager attention and the FULL step's static attention differ;
* hand-written FULL: ``torch.cuda.CUDAGraph`` over the same FULL step, inputs copied in
  before each replay, the same work the runner does, all on one stream (what a
  hand-written capture loop does; graphflow runs the plan's side streams concurrently);
* timing: eager, PIECEWISE, FULL and hand-written FULL are timed side by side in
  ``--rounds`` rounds (each round times every mode in turn); the table shows each mode's
  median and the JSON every round's sample, so host drift hits every mode alike;
* FULL compiled: the FULL plan with ``capture.compile`` (inductor, default mode, one
  specialization per size) on every segment: inductor fuses each segment's kernels and
  graphflow captures them, on the plan's streams, in its own graph. Verified against
  the uncompiled eager step within ``--compiled-atol`` (bf16 fusion rounds differently;
  top-2 routing can then pick another expert for a near tie): when that verify fails,
  its error (with the max |diff| it measured) is recorded and the plan is captured
  again without verify, so the speed is still measured. Its compile seconds and FX/AOT
  cache hits are reported; ``TORCHINDUCTOR_CACHE_DIR`` makes a second run's compile a
  cache hit. ``--no-compiled`` skips it;
* max |diff| vs eager: one step of FULL and of FULL compiled, from the same state and
  inputs as the uncompiled FULL eager step, logits compared;
* torch.compile: ``mode="reduce-overhead"`` on the FULL step of an 8-layer copy of the
  model (at 61 layers its warm-up did not finish within 140 s; ``--compile-layers 61``
  runs it, about 210 s of warm-up), with that copy's graphflow FULL, FULL compiled and
  eager times beside it. It runs in a child process under what is
  left of the time budget (``--budget-s``), so a slow warm-up is cut off and recorded,
  not waited for; whether inductor skipped CUDA graphs (and why) is recorded;
* diagnostics: the host time the PIECEWISE step spends inside its eager attentions, the
  heaviest kernels of each step, and how much the ones under 5 us add up to.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import pathlib
import subprocess
import sys
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# torch's FX graph and AOT autograd caches for the compiled rows, in the checkout (git-ignored)
# unless set: a second run's compile is served from it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

import attrs  # noqa: E402

from graphflow.engine import RunOptions, run_pipeline  # noqa: E402
from graphflow.events import Phase  # noqa: E402
from graphflow.plan import BufferRole, Compile  # noqa: E402
from graphflow.integrations.dsv4 import build_model  # noqa: E402
from graphflow.integrations.dsv4.plans import plan_variant  # noqa: E402
from graphflow.runtime import Runner  # noqa: E402
from bench.timing import guard as _guard, sync as _sync, time_ms as _time, verified_or_not  # noqa: E402

STARTED = time.perf_counter()
POSITION = 200  # sequence b decodes token POSITION + 1 + b % compress_every: ~50 compressed entries + a short tail
PIECEWISE_PLAN = ROOT / "plans/dsv4_61l_decode.yaml"
FULL_PLAN = ROOT / "plans/dsv4_61l_full.yaml"
#: --smoke: the 61-layer plans' structure and dtype with the mini model's widths, on the CPU.
SMOKE_ARGS = {"vocab_size": 512, "hidden_size": 64, "n_heads": 4, "kv_dim": 32, "rope_dim": 16, "n_experts": 8,
              "moe_inter": 64, "shared_inter": 128}


def _rounds(steps: dict, rounds: int, iters: int) -> dict[str, list[float]]:
    """ms per step of every mode, measured side by side: each round times each mode in turn.

    The eager step is bound by the host's speed, which drifts on a shared machine by
    tens of percent within a minute; interleaving puts every mode under the same drift,
    and the medians (and the per-round ratios) are what the table reports. Eager steps
    are ~6x slower, so they take a quarter of the iterations.
    """
    samples: dict[str, list[float]] = {mode: [] for mode in steps}
    for _ in range(rounds):
        for mode, step in steps.items():
            samples[mode].append(_time(step, max(3, iters // 4) if mode == "eager" else iters))
    return samples


def _inputs(size: int, vocab: int, every: int, device: str) -> dict[str, torch.Tensor]:
    """One step's inputs by buffer name (the same for every mode and row of this size)."""
    generator = torch.Generator().manual_seed(size)
    host = torch.tensor([POSITION + b % every for b in range(size)], dtype=torch.int64)
    return {"tokens": torch.randint(0, vocab, (size,), generator=generator).to(device),
            "positions": host.to(device), "positions_host": host}


def _ordered(runner: Runner, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(inputs[name] for name in runner.inputs)


def _fill(engine, size: int, inputs: dict[str, torch.Tensor]) -> None:
    views = engine.buffers.views(size)
    for name, value in inputs.items():
        if name in views:
            views[name].copy_(value)


def _attention_host_ms(program) -> float:
    """Host milliseconds one run of a PIECEWISE program spends inside its eager attentions."""
    spent = 0.0
    for call in program:
        if getattr(getattr(call, "func", None), "__name__", "") == "attention":
            start = time.perf_counter()
            call()
            spent += time.perf_counter() - start
        else:
            call()
    _sync()
    return spent * 1e3


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


def _run_all(calls) -> None:
    for call in calls:
        call()


def _hand_graph(engine, size: int, tokens, positions) -> dict:
    """A bare torch.cuda.CUDAGraph over the FULL step on the engine's buffers, on one stream.

    Returns its capture time, pool growth and ``step`` (inputs copied in, then replay: the
    work the runner does); the caller times ``step`` and resets ``graph``.
    """
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

    return {"capture_s": capture_s, "pool_reserved_bytes": pool, "step": step, "graph": graph}


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
        _sync()
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
        "warmup_s": report.phase(Phase.WARMUP).seconds,
        "capture_s": report.phase(Phase.CAPTURE).seconds,
        "verify_s": report.phase(Phase.VERIFY).seconds,
        "pool_bytes": report.pool_bytes,
        "bit_exact": all(v.bit_exact for v in report.verify) if report.verify else None,
        "verify_max_abs_diff": max((v.max_abs_diff for v in report.verify), default=None),
        **({} if report.compile is None else {"compile": {
            "summary": report.compile.summary(), "seconds": report.compile.seconds,
            "lines": report.compile.lines(), "fell_back": [c.segment for c in report.compile.fell_back],
            "cache_hits": sum(c.cache_hits for c in report.compile.segments),
            "cache_misses": sum(c.cache_misses for c in report.compile.segments)}}),
    }


def _compiled_variant(plan, atol: float):
    """The FULL plan with every graph segment compiled by inductor (one specialization per size)."""
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, compile=Compile(backend="inductor"), atol=atol,
                                                   rtol=atol))


def _compiled_pipeline(plan, args, model) -> tuple[object, dict]:
    """Run the compiled FULL plan; if its verify fails, record why and capture it again unverified."""
    return verified_or_not(lambda verify: run_pipeline(plan, RunOptions(backend=args.backend, verify=verify),
                                                       model=model))


def _logits_diff(reference, engine, size: int, inputs: dict) -> float:
    """Max |logits| of one replayed step of ``engine`` minus the uncompiled FULL eager step,
    both from the reference engine's state and the same inputs."""
    state = [b.name for b in reference.plan.buffers if b.role is BufferRole.STATE]
    saved = {n: reference.buffers.tensors[n].clone() for n in state}
    _fill(reference, size, inputs)
    _run_all(reference.eager_calls(size))
    want = reference.buffers.views(size)["logits"].float().clone()
    for name in state:
        reference.buffers.tensors[name].copy_(saved[name])
        engine.buffers.tensors[name].copy_(saved[name])
    runner = Runner(engine)
    (got,) = runner.run(*_ordered(runner, inputs))
    return float((got.float() - want).abs().max())


def _variant(path: pathlib.Path, args, sizes, layers: int):
    overrides = {"n_layers": layers, "max_batch": max(sizes), **(SMOKE_ARGS if args.smoke else {})}
    return plan_variant(path, sizes=sizes, **overrides)


def _compile_child(args) -> int:
    """The torch.compile rows, in their own process (see the module docstring); writes args.compile_child."""
    sizes = tuple(int(s) for s in args.compile_sizes.split(","))
    engine = run_pipeline(_variant(FULL_PLAN, args, sizes, args.compile_layers), RunOptions(backend=args.backend, verify=False))
    device = engine.buffers.views(sizes[0])["tokens"].device
    config = engine.model.config
    rows = {}
    for size in sizes:
        inputs = _inputs(size, config.vocab_size, config.compress_every, device)
        row = {"layers": args.compile_layers}
        _guard(row, "compiled", lambda: _compiled(engine, size, inputs["tokens"], inputs["positions"], args.iters))
        row.update(row.pop("compiled", {}))
        runner = Runner(engine)
        _fill(engine, size, inputs)
        calls = engine.eager_calls(size)
        _guard(row, "same_layers_full_ms", lambda: _time(lambda: runner.run(*_ordered(runner, inputs)), args.iters))
        _guard(row, "same_layers_eager_ms", lambda: _time(lambda: _run_all(calls), args.iters))
        rows[size] = row
    if not args.no_compiled:
        plan = _compiled_variant(_variant(FULL_PLAN, args, sizes, args.compile_layers), args.compiled_atol)
        done: dict = {}
        _guard(done, "compiled", lambda: _compiled_pipeline(plan, args, engine.model))
        for size in sizes:
            if "compiled" not in done:
                rows[size].setdefault("errors", {})["same_layers_full_compiled"] = done["errors"]["compiled"]
                continue
            compiled, info = done["compiled"]
            inputs = _inputs(size, config.vocab_size, config.compress_every, device)
            runner = Runner(compiled)
            _guard(rows[size], "same_layers_full_compiled_ms",
                   lambda: _time(lambda: runner.run(*_ordered(runner, inputs)), args.iters))
            rows[size]["same_layers_full_compiled_pipeline_s"] = info["pipeline_s"]
            rows[size]["same_layers_full_compiled_compile_s"] = (compiled.report.compile.seconds
                                                                  if compiled.report.compile else None)
    pathlib.Path(args.compile_child).write_text(json.dumps(rows))
    return 0


def _compile_rows(args, result: dict, deadline: float) -> None:
    """Run the compile rows in a child process with what is left of the budget; record what came back."""
    left = deadline - time.perf_counter()
    if left < 20:
        result["compile"] = {"skipped": f"{left:.0f} s of the {args.budget_s:.0f} s budget left"}
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "compile.json"
        command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--compile-child", str(path),
                   "--compile-sizes", args.compile_sizes, "--compile-layers", str(args.compile_layers),
                   "--iters", str(args.iters), "--backend", args.backend, "--compiled-atol", str(args.compiled_atol),
                   *(["--smoke"] if args.smoke else []), *(["--no-compiled"] if args.no_compiled else [])]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
        start = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=left - 5)
        except subprocess.TimeoutExpired:
            result["compile"] = {"error": f"did not finish within {left - 5:.0f} s (the rest of the budget)"}
            return
        result["compile"] = {"wall_s": time.perf_counter() - start, "rc": done.returncode}
        if done.returncode != 0 or not path.exists():
            result["compile"]["error"] = (done.stderr or done.stdout)[-1500:]
            return
        for size, row in json.loads(path.read_text()).items():
            result["compile"][size] = row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="folder for dsv4_decode.json")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--sizes", default="1,8,32", help="batch sizes, comma separated")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of side-by-side timing per batch size")
    parser.add_argument("--compile-sizes", default="1", help="batch sizes to run torch.compile at ('' for none)")
    parser.add_argument("--compile-layers", type=int, default=8,
                        help="layers of the model torch.compile runs on; its warm-up grows with depth, and at "
                             "61 layers it did not finish within a 140 s device budget")
    parser.add_argument("--budget-s", type=float, default=220.0,
                        help="wall-clock budget of the run after imports; what is left of it bounds torch.compile "
                             "(the device check allows it about 4 minutes)")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-compiled", action="store_true",
                        help="skip graphflow FULL with compiled segments (inductor); its compile takes most of a "
                             "cold run (a warm TORCHINDUCTOR_CACHE_DIR makes it fast)")
    parser.add_argument("--compiled-atol", type=float, default=0.1,
                        help="verify tolerance (atol = rtol) of the compiled FULL plan against the uncompiled step")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script on a CPU: the mini model's widths, 2 layers, B=1,2, 2 iterations")
    parser.add_argument("--compile-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.backend, args.layers, args.sizes, args.iters, args.rounds = "cpu", 2, "1,2", 2, 2
        args.compile_layers = min(args.compile_layers, 2)
    if args.compile_child:
        return _compile_child(args)
    if args.backend == "cuda" and not torch.cuda.is_available():
        print("dsv4_decode: needs a CUDA GPU (or --smoke / --backend cpu)", file=sys.stderr)
        return 2
    cuda = args.backend == "cuda"
    device = "cuda:0" if cuda else "cpu"
    deadline = STARTED + args.budget_s
    sizes = tuple(int(s) for s in args.sizes.split(","))
    piecewise_plan = _variant(PIECEWISE_PLAN, args, sizes, args.layers)
    full_plan = _variant(FULL_PLAN, args, sizes, args.layers)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "layers": args.layers,
        "smoke": args.smoke,
        "model_args": dict(piecewise_plan.model_args),
        "position": POSITION,
        "modes": {},
        "rows": [],
    }

    def save() -> None:  # after every part, so a run cut short still leaves its numbers
        result["elapsed_s"] = time.perf_counter() - STARTED
        (out / "dsv4_decode.json").write_text(json.dumps(result, indent=2))

    start = time.perf_counter()
    model = build_model(**piecewise_plan.model_args, device=device, plan=piecewise_plan)
    _sync()
    result["build_s"] = time.perf_counter() - start
    result["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    engines = {}
    for mode, plan in (("PIECEWISE", piecewise_plan), ("FULL", full_plan)):
        start = time.perf_counter()
        _guard(engines, mode, lambda: run_pipeline(plan, RunOptions(backend=args.backend), model=model))
        if mode in engines:
            result["modes"][mode] = {**_mode_summary(engines[mode]), "pipeline_s": time.perf_counter() - start}
        else:
            result["modes"][mode] = {"error": engines["errors"][mode]}
        save()
    if not args.no_compiled:
        done: dict = {}
        _guard(done, "FULL compiled", lambda: _compiled_pipeline(_compiled_variant(full_plan, args.compiled_atol), args,
                                                                  model))
        if "FULL compiled" in done:
            engines["FULL compiled"], info = done["FULL compiled"]
            result["modes"]["FULL compiled"] = {**_mode_summary(engines["FULL compiled"]), **info}
        else:
            result["modes"]["FULL compiled"] = {"error": done["errors"]["FULL compiled"]}
        save()
    piecewise, full = engines.get("PIECEWISE"), engines.get("FULL")
    full_compiled = engines.get("FULL compiled")
    config = model.config
    for size in sizes:
        row = {"batch": size}
        result["rows"].append(row)
        if time.perf_counter() > deadline - 15:
            row["skipped"] = "time budget spent"
            save()
            continue
        inputs = _inputs(size, config.vocab_size, config.compress_every, device)
        row["positions"] = inputs["positions_host"].tolist()
        for engine in filter(None, (piecewise, full, full_compiled)):
            _fill(engine, size, inputs)
        timed: dict[str, object] = {}  # mode -> a step, timed side by side in every round
        if piecewise is not None:
            eager_calls = piecewise.eager_calls(size)
            runner_pw = Runner(piecewise)
            pw_inputs = _ordered(runner_pw, inputs)
            timed["eager"] = lambda: _run_all(eager_calls)
            timed["piecewise"] = lambda: runner_pw.run(*pw_inputs)
            program = piecewise.programs[runner_pw.descriptor_for(size)]
            _guard(row, "attention_host_ms", lambda: _attention_host_ms(program))
            if cuda:
                _guard(row, "busy_piecewise", lambda: _busy(lambda: _run_all(eager_calls)))
                if size == min(sizes):
                    _guard(row, "piecewise_kernels", lambda: _top_kernels(lambda: _run_all(eager_calls)))
        if full is not None:
            full_calls = full.eager_calls(size)
            runner_full = Runner(full)
            full_inputs = _ordered(runner_full, inputs)
            timed["full"] = lambda: runner_full.run(*full_inputs)
            if cuda:
                _guard(row, "busy_full", lambda: _busy(lambda: _run_all(full_calls)))
                if size == min(sizes):
                    _guard(row, "full_kernels", lambda: _top_kernels(lambda: _run_all(full_calls)))
                _guard(row, "hand_full", lambda: _hand_graph(full, size, inputs["tokens"], inputs["positions"]))
                if "hand_full" in row:
                    timed["hand_full"] = row["hand_full"].pop("step")
        if full_compiled is not None:
            runner_compiled = Runner(full_compiled)
            compiled_inputs = _ordered(runner_compiled, inputs)
            timed["full_compiled"] = lambda: runner_compiled.run(*compiled_inputs)
            if full is not None:
                _guard(row, "max_abs_diff_full_compiled", lambda: _logits_diff(full, full_compiled, size, inputs))
        if full is not None:
            _guard(row, "max_abs_diff_full", lambda: _logits_diff(full, full, size, inputs))
        _guard(row, "rounds", lambda: _rounds(timed, args.rounds, args.iters))
        for mode, samples in row.get("rounds", {}).items():
            row[f"{mode}_ms"] = statistics.median(samples)
        if "eager" in row.get("rounds", {}) and "full" in row["rounds"]:
            row["eager_over_full_by_round"] = [e / f for e, f in zip(row["rounds"]["eager"], row["rounds"]["full"])]
        if "hand_full" in row:
            row["hand_full"].pop("graph").reset()
        for key in ("busy_piecewise", "busy_full"):
            if key in row:
                row[f"{key}_ms"], row[f"kernels_{key.removeprefix('busy_')}"] = row.pop(key)
        save()
        print(f"B={size}: " + ", ".join(f"{k} {row[k]:.2f}" for k in ("eager_ms", "piecewise_ms", "full_ms",
                                                                     "full_compiled_ms", "busy_full_ms") if k in row),
              flush=True)
    if args.compile_sizes:
        _compile_rows(args, result, deadline)
    save()
    _print_table(result)
    return 0


def _ratio(row: dict, a: str, b: str):
    return row[a] / row[b] if a in row and b in row and row[b] else None


def _print_table(result: dict) -> None:
    print(f"dsv4 decode step, {result['layers']} layers, {result['device']}, torch {result['torch']} (ms/step), "
          f"{result['weight_bytes'] / 1e9:.2f} GB of weights, {result['elapsed_s']:.0f} s in all")
    head = ("B", "eager", "PIECEWISE", "FULL", "FULL comp", "hand FULL", "busy PW", "busy FULL", "FULL/busy",
            "PW/busy", "eager/FULL", "FULL/comp", "diff FULL", "diff comp", "attn host")
    print("  ".join(f"{h:>10}" for h in head))
    for row in result["rows"]:
        cells = (row["batch"], row.get("eager_ms"), row.get("piecewise_ms"), row.get("full_ms"),
                 row.get("full_compiled_ms"), row.get("hand_full_ms"), row.get("busy_piecewise_ms"),
                 row.get("busy_full_ms"), _ratio(row, "full_ms", "busy_full_ms"),
                 _ratio(row, "piecewise_ms", "busy_piecewise_ms"), _ratio(row, "eager_ms", "full_ms"),
                 _ratio(row, "full_ms", "full_compiled_ms"), row.get("max_abs_diff_full"),
                 row.get("max_abs_diff_full_compiled"), row.get("attention_host_ms"))
        print("  ".join(f"{c:>10.3g}" if isinstance(c, float) and 0 < abs(c) < 0.01 else
                        f"{c:>10.2f}" if isinstance(c, float) else f"{'-' if c is None else c:>10}" for c in cells))
        by_round = row.get("eager_over_full_by_round")
        if by_round:
            print(f"  B={row['batch']} eager/FULL by round: " + ", ".join(f"{r:.2f}" for r in by_round))
        for key, error in row.get("errors", {}).items():
            print(f"  B={row['batch']} {key} failed: {error.splitlines()[0] if error else ''}")
        if "skipped" in row:
            print(f"  B={row['batch']} skipped: {row['skipped']}")
    print(f"attn host: host ms a PIECEWISE step spends inside its {result['layers']} eager attentions "
          "(their counts read from positions_host, no device sync)")
    for mode, m in result["modes"].items():
        if "error" in m:
            print(f"{mode}: pipeline failed: {m['error'].splitlines()[0]}")
            continue
        print(f"{mode}: {m['graphs']} graphs for {m['descriptors']} descriptors, warmup {m['warmup_s']:.2f} s, "
              f"capture {m['capture_s']:.2f} s, verify {m['verify_s']:.2f} s, "
              f"pool {(m['pool_bytes'] or 0) / 2**20:.0f} MiB, bit-exact {m['bit_exact']}, verify max |diff| "
              f"{m['verify_max_abs_diff']}" + (f", pipeline {m['pipeline_s']:.2f} s" if "pipeline_s" in m else ""))
        if "compile" in m:
            print(f"  {m['compile']['summary']}")
            for line in m["compile"]["lines"][:12]:
                print(f"    {line}")
        if "verify_error" in m:
            print(f"  verify within --compiled-atol failed, so it was captured again unverified: "
                  f"{m['verify_error'].splitlines()[0]}")
    for row in result["rows"]:
        for key in ("full_kernels", "piecewise_kernels"):
            if key in row:
                k = row[key]
                print(f"{key} B={row['batch']}: {k['kernels']:.0f} kernels, {k['busy_ms']:.2f} ms busy; "
                      f"{k['under_5us']['kernels']} under 5 us take {k['under_5us']['ms']:.2f} ms; top: "
                      + "; ".join(f"{t['name'][:40]} x{t['count']} {t['ms']:.2f} ms" for t in k["top"][:5]))
    compiled = result.get("compile", {})
    for size, c in compiled.items():
        if isinstance(c, dict):
            print(f"torch.compile B={size} ({c.get('layers')} layers): {c.get('ms')} ms/step, warm-up "
                  f"{c.get('warmup_s')} s, cudagraph skips {c.get('cudagraph_skips')}: "
                  f"{(c.get('skip_messages') or [None])[0] or c.get('error') or c.get('errors') or 'none'}; same model "
                  f"graphflow FULL {c.get('same_layers_full_ms')}, FULL compiled {c.get('same_layers_full_compiled_ms')} "
                  f"(pipeline {c.get('same_layers_full_compiled_pipeline_s')} s), eager {c.get('same_layers_eager_ms')}")
    for key in ("skipped", "error"):
        if key in compiled:
            print(f"torch.compile {key}: {compiled[key]}")


if __name__ == "__main__":
    sys.exit(main())
