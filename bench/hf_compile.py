"""HF decode step with compiled segments: HF eager, graphflow FULL, graphflow FULL with
its segment compiled by inductor, and torch.compile(mode="reduce-overhead"), side by side.

    PYTHONPATH=. python3 bench/hf_compile.py --out DIR [--models llama,deepseek_v3] [--sizes 1,2,4,8]
    PYTHONPATH=. python3 bench/hf_compile.py --out DIR --smoke     # CPU, fp32, 2 tiny layers: checks the script

Writes ``DIR/hf_compile.json`` (after every part, with the error of any part that
failed) and prints a table per model. Self-contained: the graphflow plan and the model
wrapper are built here.

* Models: ``LlamaForCausalLM`` and ``DeepseekV3ForCausalLM`` from tiny random configs (4
  layers, hidden 256; DeepSeek-V3 with MLA, 8 routed experts top-2 through transformers'
  ``batched_mm`` experts, which have no data-dependent shapes), bf16 on the GPU. One
  ``transformers.StaticCache`` per batch size, built with the model; every mode below uses
  the same weights and the same caches.
* The step: B sequences decode one token at one position. HF's static cache keeps a
  device counter of how many tokens it holds (``cumulative_length``) and writes the new
  one there; the step sets that counter to the position first, so a step is a function
  of (tokens, position, cache) and can be repeated at one position (timing, verify).
* Modes: ``eager`` (HF's forward, uncompiled); ``FULL`` (graphflow's pipeline on a one-
  segment FULL plan, replayed by its ``Runner``); ``FULL compiled`` (the same plan with
  ``capture.compile: inductor``, default mode, ``dynamic: false``: inductor's kernels in
  graphflow's graph, verified against the uncompiled step within ``--atol``);
  ``reduce-overhead`` (``torch.compile(mode="reduce-overhead", fullgraph=True)`` of the
  same step, inductor's own CUDA graphs, the way transformers documents it).
* Timing: ``--rounds`` rounds, each timing every mode in turn, medians reported.
* Warm-up: each graphflow pipeline's wall time (compile included, and the compile
  seconds alone), and reduce-overhead's warm-up (three calls per size: compile, warm,
  record). ``--restarts`` (default on) runs the compiled pipeline in two fresh
  processes sharing one new ``TORCHINDUCTOR_CACHE_DIR``: a cold start and a second
  start served by torch's FX graph and AOT autograd caches.
* max |diff| vs eager: each mode decodes the same ``--decode-steps`` tokens from an empty
  cache; the largest logit difference from HF eager over those steps.

On the H200, DeepSeek-V3 at four sizes in one process faulted: reduce-overhead recorded
its graphs again after graphflow captured (graphflow's WorkspaceClearedWarning, then an
illegal memory access in graphflow's next replay; docs/compile.md, Limits). One process
per size (``--sizes 2``, ...) measures each; ``bench/results/hf_compile_deepseek.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# torch's FX graph and AOT autograd caches, in the checkout (git-ignored) unless set; the
# restarts measure a fresh one of their own.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

from graphflow.engine import RunOptions, run_pipeline  # noqa: E402
from graphflow.events import Phase  # noqa: E402
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Compile, Mode, Plan, Segment, SegmentKind, Stream  # noqa: E402
from graphflow.runtime import Runner  # noqa: E402
from bench.timing import guard as _guard, sync as _sync, time_ms as _time, verified_or_not  # noqa: E402

STARTED = time.perf_counter()
#: The benchmarked models (the sizes the compiled-segments issue measured: 4 layers, hidden 256).
CONFIGS = {
    "llama": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "deepseek_v3": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, moe_intermediate_size=128,
                        num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                        v_head_dim=32, max_position_embeddings=512, experts_implementation="batched_mm"),
}
SMOKE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
MAX_LEN = 256
POSITION = 100  # the position timed steps decode at


class Decode(nn.Module):
    """An HF causal LM and one static cache per batch size; ``step`` is graphflow's segment.

    The caches' tensors are registered as (non-persistent) buffers, so graphflow's
    detectors count them as the model's own tensors.
    """

    def __init__(self, family: str, config: dict, sizes: tuple[int, ...], device: str, dtype: torch.dtype):
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

        torch.manual_seed(0)
        hf_config = AutoConfig.for_model(family, **config)
        self.lm = AutoModelForCausalLM.from_config(hf_config, dtype=dtype).to(device).eval().requires_grad_(False)
        self.caches = {}
        with torch.no_grad():
            for size in sizes:
                cache = StaticCache(config=hf_config, max_cache_len=MAX_LEN)
                # HF allocates a layer's cache at its first update; do it now, outside any capture.
                self.lm(input_ids=torch.zeros(size, 1, dtype=torch.long, device=device), past_key_values=cache,
                        use_cache=True)
                self.caches[size] = cache
                for i, layer in enumerate(cache.layers):
                    for name in ("keys", "values", "cumulative_length"):
                        self.register_buffer(f"cache{size}_{i}_{name}", getattr(layer, name), persistent=False)
        self.reset()

    def reset(self) -> None:
        """Empty every cache."""
        for cache in self.caches.values():
            for layer in cache.layers:
                layer.keys.zero_()
                layer.values.zero_()
                layer.cumulative_length.zero_()

    def logits(self, tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """tokens [B] at position [1] -> next-token logits [B, vocab] (float32); writes the cache."""
        cache = self.caches[tokens.shape[0]]
        for layer in cache.layers:
            layer.cumulative_length.copy_(position.squeeze(0))
        out = self.lm(input_ids=tokens[:, None], position_ids=position.expand(tokens.shape[0])[:, None],
                      past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    def step(self, tokens: torch.Tensor, position: torch.Tensor, logits: torch.Tensor) -> None:
        """graphflow's calling convention: reads tokens and position, writes logits in place."""
        logits.copy_(self.logits(tokens, position))


def decode_plan(vocab: int, sizes: tuple[int, ...], device: str = "cuda:0", *, compile: Compile | str | None = None,
                atol: float = 0.0) -> Plan:
    """One FULL graph segment: the whole decode step (the cache is the model's own state).
    The CPU backend maps ``cuda:0`` to the CPU."""
    buffers = [Buffer("tokens", ("B",), "int64", device, role=BufferRole.INPUT, values=(0, vocab)),
               Buffer("position", (1,), "int64", device, role=BufferRole.INPUT, values=(0, MAX_LEN)),
               Buffer("logits", ("B", vocab), "float32", device, role=BufferRole.OUTPUT)]
    segment = Segment("step", SegmentKind.GRAPH, "step", reads=["tokens", "position"], writes=["logits"], stream="s0")
    return Plan("hf-decode" + ("-compiled" if compile else ""), buffers=buffers, streams=[Stream("s0", device)],
                segments=[segment],
                capture=CaptureSettings(modes=(Mode.FULL,), sizes=tuple(sorted(sizes)), warmup_iters=2,
                                        atol=atol, rtol=atol, compile=compile))


def _pipeline(plan: Plan, decode: Decode, args) -> tuple[object, dict]:
    """One pipeline and its figures; a compiled plan whose verify refuses it beyond the
    tolerance is captured again unverified, and says so (``verify_error``)."""
    def run(verify: bool):
        engine = run_pipeline(plan, RunOptions(backend=args.backend, detectors=args.detectors, verify=verify),
                              model=decode)
        _sync()
        return engine

    engine, notes = verified_or_not(run)
    report = engine.report
    info = {**notes, "graphs": report.graphs,
            "warmup_s": report.phase(Phase.WARMUP).seconds, "capture_s": report.phase(Phase.CAPTURE).seconds,
            "verify_s": report.phase(Phase.VERIFY).seconds,
            "verify_max_abs_diff": max((r.max_abs_diff for r in report.verify), default=None),
            "verify_against": list(report.verify[0].against) if report.verify else None}
    if report.compile is not None:
        info["compile"] = {"summary": report.compile.summary(), "seconds": report.compile.seconds,
                           "cache_hits": sum(s.cache_hits for s in report.compile.segments),
                           "cache_misses": sum(s.cache_misses for s in report.compile.segments),
                           "fell_back": [s.segment for s in report.compile.fell_back],
                           "graph_breaks": [b for s in report.compile.segments for b in s.graph_breaks]}
    return engine, info


def _reduce_overhead(decode: Decode, sizes, device: str) -> tuple[object, dict]:
    """torch.compile(reduce-overhead) of the step; warm-up: three calls per size."""
    import torch._dynamo

    torch._dynamo.reset()
    logits = torch.compile(decode.logits, mode="reduce-overhead", fullgraph=True)

    def compiled(tokens: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        # Each call a step of its own (the caller copies what it keeps), so that a call at
        # another size starts from the root of inductor's tree of graphs instead of a new
        # path below the last call's; it did not keep inductor from recording again (see above).
        torch.compiler.cudagraph_mark_step_begin()
        return logits(tokens, position)

    position = torch.tensor([POSITION], device=device)
    start = time.perf_counter()
    with torch.no_grad():
        for size in sorted(sizes):
            tokens = torch.zeros(size, dtype=torch.long, device=device)
            for _ in range(3):
                compiled(tokens, position)
    _sync()
    from torch._dynamo.utils import counters

    return compiled, {"warmup_s": time.perf_counter() - start,
                      "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}


def _decoded(step, decode: Decode, tokens: torch.Tensor, device: str) -> torch.Tensor:
    """Logits [steps, B, vocab] of decoding tokens [B, steps] from an empty cache with ``step``."""
    decode.reset()
    out = []
    with torch.no_grad():
        for t in range(tokens.shape[1]):
            out.append(step(tokens[:, t].contiguous(), torch.tensor([t], device=device)).clone())
    return torch.stack(out)


def run_model(family: str, args, result: dict, save) -> None:
    cuda = args.backend == "cuda"
    device = "cuda:0" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    config = {**CONFIGS[family], **(SMOKE if args.smoke else {})}
    sizes = tuple(int(s) for s in args.sizes.split(","))
    record: dict = {"config": config, "dtype": str(dtype).removeprefix("torch."), "sizes": list(sizes), "rows": []}
    result["models"][family] = record
    start = time.perf_counter()
    decode = Decode(family, config, sizes, device, dtype)
    _sync()
    record["build_s"] = time.perf_counter() - start
    vocab = config["vocab_size"]
    # reduce-overhead first: recording its graphs clears cuBLAS's workspaces for every
    # stream, which graphs captured before it replay their matmuls into (docs/compile.md).
    compiled = None
    if not args.no_reduce_overhead:
        done = {}
        _guard(done, "ro", lambda: _reduce_overhead(decode, sizes, device))
        if "ro" in done:
            compiled, record["reduce-overhead"] = done["ro"]
        else:
            record["reduce-overhead"] = {"error": done["errors"]["ro"]}
        save()
    engines: dict[str, object] = {}
    setting = Compile(backend=args.compile_backend, mode=args.compile_mode, dynamic=args.dynamic)
    for mode, plan in (("FULL", decode_plan(vocab, sizes)),
                       ("FULL compiled", decode_plan(vocab, sizes, compile=setting, atol=args.atol))):
        done: dict = {}
        _guard(done, mode, lambda: _pipeline(plan, decode, args))
        if mode in done:
            engines[mode], record[mode] = done[mode]
        else:
            record[mode] = {"error": done["errors"][mode]}
        save()
    runners = {mode: Runner(engine) for mode, engine in engines.items()}
    position = torch.tensor([POSITION], device=device)
    generator = torch.Generator().manual_seed(1)
    for size in sizes:
        row: dict = {"batch": size}
        record["rows"].append(row)
        tokens = torch.randint(0, vocab, (size,), generator=generator).to(device)
        logits = torch.empty(size, vocab, device=device)
        steps = {"eager": lambda: decode.step(tokens, position, logits)}
        for mode, runner in runners.items():
            steps[mode] = (lambda r: lambda: r.run(tokens, position))(runner)
        if compiled is not None:
            steps["reduce-overhead"] = lambda: compiled(tokens, position)
        samples: dict[str, list[float]] = {mode: [] for mode in steps}
        with torch.no_grad():
            for _ in range(args.rounds):
                for mode, step in steps.items():
                    _guard(row, f"time {mode}", lambda: samples[mode].append(_time(step, args.iters)))
        row["rounds"] = {mode: values for mode, values in samples.items() if values}
        row.update({f"{mode}_ms": statistics.median(values) for mode, values in row["rounds"].items()})
        for mode in steps:
            row.pop(f"time {mode}", None)
        decode_tokens = torch.randint(0, vocab, (size, args.decode_steps), generator=generator).to(device)
        reference = _decoded(decode.logits, decode, decode_tokens, device)
        diffs = {}
        for mode, runner in runners.items():
            _guard(diffs, mode, lambda: float((_decoded(lambda t, p: runner.run(t, p)[0], decode, decode_tokens,
                                                        device) - reference).abs().max()))
        if compiled is not None:
            _guard(diffs, "reduce-overhead", lambda: float((_decoded(compiled, decode, decode_tokens, device)
                                                           - reference).abs().max()))
        row["max_abs_diff_vs_eager"] = {k: v for k, v in diffs.items() if k != "errors"}
        row.setdefault("errors", {}).update({f"diff {k}": v for k, v in diffs.get("errors", {}).items()})
        if not row["errors"]:
            del row["errors"]
        save()
        print(f"{family} B={size}: " + ", ".join(f"{k} {row[k]:.3f}" for k in row if k.endswith("_ms")), flush=True)
    for engine in engines.values():
        engine.close()
    del compiled, runners, engines, decode
    if args.restarts:
        _guard(record, "restarts", lambda: _restarts(family, args))
        save()


def _restarts(family: str, args) -> dict:
    """The compiled pipeline in two fresh processes sharing one new inductor cache directory."""
    starts = []
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(2):
            with tempfile.TemporaryDirectory() as tmp:
                out = pathlib.Path(tmp) / "start.json"
                command = [sys.executable, str(pathlib.Path(__file__).resolve()), "--start-child", str(out),
                           "--models", family, "--sizes", args.sizes, "--backend", args.backend,
                           "--compile-backend", args.compile_backend, "--compile-mode", args.compile_mode,
                           "--atol", str(args.atol), "--detectors", args.detectors,
                           *(["--dynamic"] if args.dynamic else []),
                           *(["--smoke"] if args.smoke else [])]
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
                       "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
                began = time.perf_counter()
                done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.restart_timeout)
                if done.returncode != 0 or not out.exists():
                    raise RuntimeError(f"start {len(starts) + 1} failed: {(done.stderr or done.stdout)[-800:]}")
                starts.append({**json.loads(out.read_text()), "process_s": time.perf_counter() - began})
    return {"cold": starts[0], "second": starts[1]}


def _start_child(args) -> int:
    """One start of the compiled pipeline (for ``_restarts``): its times, as JSON."""
    family = args.models.split(",")[0]
    cuda = args.backend == "cuda"
    device = "cuda:0" if cuda else "cpu"
    config = {**CONFIGS[family], **(SMOKE if args.smoke else {})}
    sizes = tuple(int(s) for s in args.sizes.split(","))
    decode = Decode(family, config, sizes, device, torch.bfloat16 if cuda else torch.float32)
    setting = Compile(backend=args.compile_backend, mode=args.compile_mode, dynamic=args.dynamic)
    engine, info = _pipeline(decode_plan(config["vocab_size"], sizes, compile=setting, atol=args.atol), decode, args)
    engine.close()
    pathlib.Path(args.start_child).write_text(json.dumps(info))
    return 0


def _print(result: dict) -> None:
    for family, record in result["models"].items():
        print(f"\n{family} decode step, {record['dtype']}, {result['device']}, torch {result['torch']} (ms/step, "
              f"medians of {result['rounds']} rounds)")
        head = ("B", "eager", "FULL", "FULL compiled", "reduce-overhead", "compiled/RO", "FULL/compiled",
                "diff FULL", "diff compiled", "diff RO")
        print("  ".join(f"{h:>15}" for h in head))
        for row in record["rows"]:
            diff = row.get("max_abs_diff_vs_eager", {})

            def ratio(a, b):
                return row[a] / row[b] if a in row and b in row and row[b] else None

            cells = (row["batch"], row.get("eager_ms"), row.get("FULL_ms"), row.get("FULL compiled_ms"),
                     row.get("reduce-overhead_ms"), ratio("FULL compiled_ms", "reduce-overhead_ms"),
                     ratio("FULL_ms", "FULL compiled_ms"), diff.get("FULL"), diff.get("FULL compiled"),
                     diff.get("reduce-overhead"))
            print("  ".join(f"{c:>15.4g}" if isinstance(c, float) else f"{'-' if c is None else c:>15}" for c in cells))
            for key, error in row.get("errors", {}).items():
                print(f"  B={row['batch']} {key} failed: {error.splitlines()[0]}")
        for mode in ("FULL", "FULL compiled", "reduce-overhead"):
            info = record.get(mode, {})
            if "error" in info:
                print(f"{mode}: failed: {info['error'].splitlines()[0]}")
            elif mode == "reduce-overhead" and info:
                print(f"{mode}: warm-up {info['warmup_s']:.2f} s ({len(record['sizes'])} sizes x 3 calls), "
                      f"cudagraph skips {info['cudagraph_skips']}")
            elif info:
                compiled = info.get("compile")
                verdict = (f"verify refused it ({info['verify_error'].splitlines()[0]}), so it was captured again "
                           "unverified" if "verify_error" in info else
                           f"verify max |diff| {info['verify_max_abs_diff']:.3g} against {info['verify_against'][0]}")
                print(f"{mode}: pipeline {info['pipeline_s']:.2f} s (warmup {info['warmup_s']:.2f}, capture "
                      f"{info['capture_s']:.2f}, verify {info['verify_s']:.2f}), {verdict}"
                      + (f"; {compiled['summary']}" if compiled else ""))
        restarts = record.get("restarts")
        if restarts:
            cold, second = restarts["cold"], restarts["second"]
            print(f"FULL compiled, fresh processes on one new inductor cache: cold start pipeline "
                  f"{cold['pipeline_s']:.2f} s (compile {cold['compile']['seconds']:.2f} s, cache "
                  f"{cold['compile']['cache_hits']} hit(s)); second start {second['pipeline_s']:.2f} s (compile "
                  f"{second['compile']['seconds']:.2f} s, cache {second['compile']['cache_hits']} hit(s))")
        for key, error in record.get("errors", {}).items():
            print(f"{key} failed: {error.splitlines()[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="folder for hf_compile.json")
    parser.add_argument("--models", default="llama,deepseek_v3")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--iters", type=int, default=50, help="timed steps per mode and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--decode-steps", type=int, default=8, help="tokens decoded to compare each mode with eager")
    parser.add_argument("--atol", type=float, default=0.05, help="verify tolerance of the compiled plan (atol = rtol)")
    parser.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"))
    parser.add_argument("--dynamic", action="store_true", help="compile shape-generic code (default: one per size)")
    parser.add_argument("--no-reduce-overhead", action="store_true", help="skip the torch.compile reduce-overhead row")
    parser.add_argument("--restarts", action=argparse.BooleanOptionalAction, default=True,
                        help="measure a cold and a second start of the compiled pipeline in fresh processes")
    parser.add_argument("--restart-timeout", type=float, default=300.0)
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--detectors", choices=("first", "all", "off"), default="first",
                        help="graphflow's capture-safety detectors (default: the first descriptor)")
    parser.add_argument("--smoke", action="store_true", help="CPU, fp32, 2 tiny layers, B=1,2, few iterations")
    parser.add_argument("--start-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.backend, args.sizes, args.iters, args.rounds, args.decode_steps = "cpu", "1,2", 2, 1, 2
    if args.start_child:
        return _start_child(args)
    if args.backend == "cuda" and not torch.cuda.is_available():
        print("hf_compile: needs a CUDA GPU (or --smoke / --backend cpu)", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0) if args.backend == "cuda" else "cpu",
              "torch": torch.__version__, "smoke": args.smoke, "rounds": args.rounds, "iters": args.iters,
              "position": POSITION, "compile": {"backend": args.compile_backend, "mode": args.compile_mode,
                                                "dynamic": args.dynamic}, "models": {}}

    def save() -> None:
        result["elapsed_s"] = time.perf_counter() - STARTED
        (out / "hf_compile.json").write_text(json.dumps(result, indent=2))

    for family in args.models.split(","):
        if family not in CONFIGS:
            parser.error(f"unknown model {family!r}: choose among {', '.join(CONFIGS)}")
        outcome: dict = {}
        _guard(outcome, family, lambda: run_model(family, args, result, save))
        result.setdefault("errors", {}).update(outcome.get("errors", {}))
        save()
    if not result["errors"]:
        del result["errors"]
    save()
    _print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
