"""Decode-step time of Hugging Face Llama and DeepSeek-V3: eager, graphflow PIECEWISE and
FULL, a hand-written CUDA graph of the same step, and torch.compile(reduce-overhead).

    PYTHONPATH=. python3 bench/hf_decode.py --out DIR [--sizes 1,2,4,8] [--models llama,deepseek_v3]
    PYTHONPATH=. python3 bench/hf_decode.py --out DIR --smoke      # CPU, the examples' tiny models

Writes ``DIR/hf_decode.json`` (after every row, with the error of any part that failed)
and prints a table of ms per step and ratios. Every model is a random-weight
``transformers`` model (nothing downloaded, bf16 on the GPU) with a ``StaticCache``; one
step is the model's own ``forward`` on one token per sequence, writing its cache.

The columns are ``VARIANTS``, a table of ``Variant(name, gpu_only, make)``: ``make(bench,
size)`` returns a ``Prepared`` step (``step()`` runs one decode step, ``reset()`` empties
the cache between rounds, outside the timing). A new column is one more row:

* ``HF eager``: ``model(input_ids=tokens, past_key_values=cache)``;
* ``graphflow PIECEWISE`` / ``graphflow FULL``: the plan ``decode_plan`` writes (the one
  examples/hf_*/decode.yaml spell), captured through ``Session`` at every size, run
  with ``Runner.run(tokens=...)``; PIECEWISE cuts the forward at every ``self_attn``;
* ``hand-written graph``: ``torch.cuda.CUDAGraph`` over the same forward, on the
  same weights as graphflow FULL and a StaticCache of its own, tokens copied into a
  static input before each replay (the work the runner does);
* ``torch.compile``: ``torch.compile(model.forward, mode="reduce-overhead")`` on its own
  StaticCache (initialized eagerly first, as transformers recommends), one compile per
  batch size; its warm-up time, and whether inductor skipped CUDA graphs, are recorded.
  It runs at ``--compile-sizes`` (1 and 8 by default) and only while ``--budget-s``
  lasts: its warm-up dominates the run. Its steps are made first, before any other
  graph of the model family is captured (``_compile_first`` says why).

Timing: for each model and batch size, ``--rounds`` rounds; each round times every
variant in turn (``--steps`` steps from an empty cache), so host drift hits every
column alike; the table shows each column's median and the JSON every sample.
graphflow FULL and the hand-written graph run the same kernels (a profile shows the same
kernels and device time within 1%), yet one capture of either ran up to 6% slower or
faster than the other from run to run, by where its memory happened to lie. So each is
captured ``--instances`` times (graphflow: a session each, of every size; hand: a graph
each, on that session's weights), every instance is timed in every round, and a
column's median is over all of them (``instances`` in the JSON keeps each one's samples).
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable

import attrs
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.timing import sync as _sync  # noqa: E402
from graphflow.engine import RunOptions  # noqa: E402
from graphflow.integrations.hf import decode_plan, static_cache  # noqa: E402
from graphflow.session import Session  # noqa: E402

STARTED = time.perf_counter()

#: The benchmarked models: bf16, sized so a step is launch-bound (what graphs remove) but not trivial.
CONFIGS = {
    "llama": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
    "deepseek_v3": dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=256,
                        num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=8, num_key_value_heads=8,
                        q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64,
                        v_head_dim=64, max_position_embeddings=1024, experts_implementation="batched_mm"),
}
MAX_LEN = 256


@attrs.frozen
class Prepared:
    """One variant at one batch size: ``step`` runs a decode step, ``reset`` empties its cache."""

    step: Callable[[], object]
    reset: Callable[[], object]
    info: dict = attrs.field(factory=dict)


@attrs.frozen
class Variant:
    """A column of the table: ``make(bench, size)`` prepares it, or raises to record why not."""

    name: str
    gpu_only: bool
    make: Callable[[Bench, int, int], Prepared]
    #: Captured ``--instances`` times, each on memory of its own (see "Timing").
    instanced: bool = False


@attrs.define
class Bench:
    """One model family on one device: the weights every variant shares (by seed), and the tokens."""

    family: str
    device: str
    dtype: torch.dtype
    config: dict
    sizes: tuple[int, ...]
    sessions: dict = attrs.field(factory=dict)
    compiled: dict = attrs.field(factory=dict)  # size -> Prepared, or the error that stopped it

    def model(self):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model(_model_type(self.family), **self.config)
        return AutoModelForCausalLM.from_config(config, dtype=self.dtype).to(self.device).eval()

    def tokens(self, size: int) -> torch.Tensor:
        return torch.randint(0, self.config["vocab_size"], (size, 1), generator=torch.Generator().manual_seed(size)
                             ).to(self.device)

    def cache(self, model, size: int):
        """A StaticCache of the model's own, initialized by one eager step at ``size`` rows, then emptied."""
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=MAX_LEN)
        with torch.no_grad():
            model(input_ids=self.tokens(size), past_key_values=cache, use_cache=True)
        cache.reset()
        return cache


def _model_type(family: str) -> str:
    return {"llama": "llama", "deepseek_v3": "deepseek_v3"}[family]


def _eager(bench: Bench, size: int, instance: int = 0) -> Prepared:
    model = bench.model()
    cache, tokens = bench.cache(model, size), bench.tokens(size)

    def step():
        return model(input_ids=tokens, past_key_values=cache, use_cache=True)

    return Prepared(step, cache.reset)


def _graphflow(mode: str):
    def make(bench: Bench, size: int, instance: int = 0) -> Prepared:
        session = bench.sessions.get((mode, instance))
        if session is None:  # one capture per mode and instance, of every size
            model = bench.model()
            model.cache = static_cache(model, MAX_LEN)
            plan = decode_plan(model, MAX_LEN, sizes=bench.sizes, modes=(mode,), name=f"hf-{bench.family}-decode")
            session = Session(plan, RunOptions(backend="cuda" if bench.device.startswith("cuda") else "cpu"))
            start = time.perf_counter()
            session.capture(model)
            session.capture_s = time.perf_counter() - start
            bench.sessions[(mode, instance)] = session
        runner, tokens = session.runner, bench.tokens(size)
        report = session.engine.report
        info = {"capture_pipeline_s": session.capture_s, "graphs": report.graphs,
                "bit_exact": all(v.bit_exact for v in report.verify), "descriptor": str(runner.descriptor_for(size))}
        return Prepared(lambda: runner.run(tokens=tokens), runner.clear_state, info)

    return make


def _hand_graph(bench: Bench, size: int, instance: int = 0) -> Prepared:
    # The weights graphflow FULL's instance of the same index runs on (a cache of its own).
    session = bench.sessions.get(("FULL", instance))
    model = session.engine.model if session is not None else bench.model()
    cache, tokens = bench.cache(model, size), bench.tokens(size)
    static = tokens.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            model(input_ids=static, past_key_values=cache, use_cache=True)
    torch.cuda.current_stream().wait_stream(stream)
    cache.reset()
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.no_grad(), torch.cuda.graph(graph, stream=stream):
        model(input_ids=static, past_key_values=cache, use_cache=True)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - start

    def step():
        static.copy_(tokens)
        graph.replay()

    return Prepared(step, cache.reset, {"capture_s": capture_s, "graph": graph})


class _SkipLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        if "cudagraph" in record.getMessage().lower():
            self.messages.append(record.getMessage())


def _compiled(bench: Bench, size: int, instance: int = 0) -> Prepared:
    import torch._dynamo
    from torch._dynamo.utils import counters

    model = bench.model()
    cache, tokens = bench.cache(model, size), bench.tokens(size)
    counters.clear()
    log = _SkipLog()
    loggers = [logging.getLogger(n) for n in ("torch", "torch._inductor.cudagraph_utils.__cudagraphs")]
    torch._logging.set_logs(perf_hints=True)
    for logger in loggers:
        logger.addHandler(log)
    forward = torch.compile(model.forward, mode="reduce-overhead", dynamic=False)

    def step():
        torch.compiler.cudagraph_mark_step_begin()
        return forward(input_ids=tokens, past_key_values=cache, use_cache=True)

    try:
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(3):
                step()
        _sync()
        warmup_s = time.perf_counter() - start
    finally:
        for logger in loggers:
            logger.removeHandler(log)
        torch._logging.set_logs()
    cache.reset()
    info = {"warmup_s": warmup_s, "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0)),
            "skip_messages": log.messages[:3]}
    return Prepared(step, cache.reset, info)


def _compile_first(bench: Bench, args, deadline: float) -> None:
    """torch.compile's steps at every ``--compile-sizes``, before any other graph is captured.

    Recording its CUDA graphs, torch.compile (reduce-overhead) clears cuBLAS's workspaces
    for every stream (``torch._inductor.cudagraph_trees.clear_cublas_manager``), and so
    frees the memory that graphs captured earlier in the process replay their matmuls
    into: run after them, it turns their next replays into illegal memory accesses.
    """
    import torch._dynamo

    torch._dynamo.reset()
    for size in args.compile_sizes:
        if size not in bench.sizes:
            continue
        if time.perf_counter() > deadline:
            bench.compiled[size] = f"skipped: the {args.budget_s:.0f} s budget was spent"
            continue
        try:
            bench.compiled[size] = _compiled(bench, size)
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a result, not the end of the run
            traceback.print_exc()
            bench.compiled[size] = f"{type(exc).__name__}: {exc}"[:800]


#: The table's columns, in order. "graphflow FULL with compiled segments" joins as one more row.
VARIANTS: tuple[Variant, ...] = (
    Variant("HF eager", False, _eager),
    Variant("graphflow PIECEWISE", False, _graphflow("PIECEWISE")),
    Variant("graphflow FULL", False, _graphflow("FULL"), instanced=True),
    Variant("hand-written graph", True, _hand_graph, instanced=True),
    Variant("torch.compile", True, _compiled),
)


def _time(prepared: Prepared, steps: int) -> float:
    """ms per step over ``steps`` steps from an empty cache (the reset is not timed)."""
    prepared.reset()
    _sync()
    with torch.no_grad():
        start = time.perf_counter()
        for _ in range(steps):
            prepared.step()
        _sync()
    return (time.perf_counter() - start) * 1e3 / steps


def _row(bench: Bench, size: int, args, deadline: float) -> dict:
    row: dict = {"model": bench.family, "batch": size, "ms": {}, "samples": {}, "instances": {}, "info": {},
                 "errors": {}}
    prepared: dict[str, list[Prepared]] = {}
    for variant in VARIANTS:
        if variant.gpu_only and not bench.device.startswith("cuda"):
            row["errors"][variant.name] = "needs a GPU"
            continue
        if variant.name == "torch.compile":
            made = bench.compiled.get(size, "skipped: not in --compile-sizes")
            if isinstance(made, Prepared):
                prepared[variant.name] = [made]
                row["info"][variant.name] = dict(made.info)
            else:
                row["errors"][variant.name] = made
            continue
        try:
            prepared[variant.name] = [variant.make(bench, size, i) for i in range(args.instances if variant.instanced
                                                                                 else 1)]
            row["info"][variant.name] = {k: v for k, v in prepared[variant.name][0].info.items() if k != "graph"}
        except Exception as exc:  # noqa: BLE001 - a variant that fails is a result, not the end of the run
            traceback.print_exc()
            row["errors"][variant.name] = f"{type(exc).__name__}: {exc}"[:800]
    for _ in range(args.rounds):
        for name, instances in prepared.items():
            for i, ready in enumerate(instances):
                row["instances"].setdefault(name, [[] for _ in instances])[i].append(_time(ready, args.steps))
    row["samples"] = {name: [t for samples in per for t in samples] for name, per in row["instances"].items()}
    row["ms"] = {name: statistics.median(samples) for name, samples in row["samples"].items()}
    hand = row["ms"].get("hand-written graph")
    row["vs_hand_graph"] = {name: ms / hand for name, ms in row["ms"].items()} if hand else {}
    for ready in (r for instances in prepared.values() for r in instances):
        graph = ready.info.get("graph")
        if graph is not None:
            graph.reset()
    return row


def _table(rows: list[dict]) -> str:
    names = [v.name for v in VARIANTS]
    header = ["model", "B", *(f"{n} ms" for n in names), "FULL / hand", "PIECEWISE / hand", "eager / FULL"]
    lines = [" | ".join(header), " | ".join("---" for _ in header)]
    for row in rows:
        ms, ratio = row["ms"], row["vs_hand_graph"]
        cells = [row["model"], str(row["batch"])]
        cells += [f"{ms[n]:.3f}" if n in ms else "-" for n in names]
        cells += [f"{ratio[n]:.3f}x" if n in ratio else "-" for n in ("graphflow FULL", "graphflow PIECEWISE")]
        full = ms.get("graphflow FULL")
        cells.append(f"{ms['HF eager'] / full:.1f}x" if full and "HF eager" in ms else "-")
        lines.append(" | ".join(cells))
    return "\n".join(f"| {line} |" for line in lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out", help="folder for hf_decode.json")
    parser.add_argument("--models", default="llama,deepseek_v3", help="model families, comma separated")
    parser.add_argument("--sizes", default="1,2,4,8", help="batch sizes, comma separated")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per variant and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of side-by-side timing")
    parser.add_argument("--instances", type=int, default=5,
                        help="independent captures of graphflow FULL and of the hand-written graph")
    parser.add_argument("--compile-sizes", default="1,8",
                        help="batch sizes torch.compile runs at (each is a warm-up of tens of seconds)")
    parser.add_argument("--budget-s", type=float, default=150.0,
                        help="seconds after which torch.compile is no longer started (its warm-up dominates)")
    parser.add_argument("--smoke", action="store_true",
                        help="check the script on a CPU: the examples' tiny models, B=1,2, 2 rounds of 4 steps")
    args = parser.parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("hf_decode: needs transformers (pip install 'graphflow[hf]')", file=sys.stderr)
        return 2
    if not args.smoke and not torch.cuda.is_available():
        print("hf_decode: needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda:0", torch.bfloat16)
    if args.smoke:
        args.sizes, args.steps, args.rounds = "1,2", 4, 2
    sizes = tuple(int(s) for s in args.sizes.split(","))
    args.compile_sizes = tuple(int(s) for s in args.compile_sizes.split(",") if s.strip())
    configs = _smoke_configs() if args.smoke else CONFIGS
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(0) if device != "cpu" else "cpu", "torch": torch.__version__,
              "transformers": __import__("transformers").__version__, "smoke": args.smoke, "max_len": MAX_LEN,
              "steps": args.steps, "rounds": args.rounds, "variants": [v.name for v in VARIANTS],
              "configs": {}, "rows": []}

    def save() -> None:  # after every row, so a run cut short still leaves its numbers
        result["elapsed_s"] = time.perf_counter() - STARTED
        (out / "hf_decode.json").write_text(json.dumps(result, indent=2))

    deadline = STARTED + args.budget_s
    for family in args.models.split(","):
        bench = Bench(family, device, dtype, configs[family], sizes)
        result["configs"][family] = bench.config
        if device.startswith("cuda"):
            _compile_first(bench, args, deadline)
        try:
            for size in sizes:
                result["rows"].append(_row(bench, size, args, deadline))
                save()
        finally:
            for session in bench.sessions.values():
                session.close()
    print(_table(result["rows"]))
    result["table"] = _table(result["rows"])
    save()
    failed = [f"{r['model']} B={r['batch']} {name}: {e}" for r in result["rows"] for name, e in r["errors"].items()
              if e != "needs a GPU" and not e.startswith("skipped")]
    for line in failed:
        print(f"hf_decode: {line}", file=sys.stderr)
    return 1 if failed else 0


def _smoke_configs() -> dict:
    """The examples' tiny configs (examples/hf_*), in float32 on the CPU."""
    import importlib.util

    configs = {}
    for family, path in (("llama", "examples/hf_llama/llama.py"), ("deepseek_v3",
                                                                     "examples/hf_deepseek_v3/deepseek_v3.py")):
        spec = importlib.util.spec_from_file_location(f"_bench_{family}", ROOT / path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        configs[family] = dict(module.CONFIG)
    return configs


if __name__ == "__main__":
    sys.exit(main())
