"""graphflow against a hand-written ``torch.cuda.CUDAGraph`` loop, on the same model.

The model is a decoder-like stack (32 layers, hidden 1024, bfloat16): per layer a
pre-attention graph (norm + QKV), attention over a static KV cache, and a
post-attention graph (output projection + gated MLP). PIECEWISE runs attention eagerly
between graphs; FULL captures the whole step. The hand-written side captures exactly
the regions graphflow's plan gives (``pre0``, ``post{l-1} + pre{l}``, ..., ``post31``
for PIECEWISE; the whole step for FULL), into one pool on one side stream, with the
same warmups, largest size first, the garbage collector frozen: so the ratios measure
graphflow's orchestration and nothing else.

Measured, both sides in one process:
* replay: the median step time over many steps, CUDA events around each step, the two
  sides alternating step by step (``Runner.run(x)`` against ``static_x.copy_(x)`` + the
  hand-written loop). Targets: FULL <= 1.02x, PIECEWISE <= 1.05x.
* capture: wall time from nothing to captured graphs (buffers, warmup, capture),
  graphflow without verify and without detectors against the hand-written loop,
  median of several runs. Target <= 1.2x. graphflow with detectors and with verify
  are reported beside it.

Run on a GPU from the repository root: ``python bench/engine_bench.py --out DIR``;
writes ``DIR/engine.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from graphflow.engine import RunOptions, run_pipeline  # noqa: E402
from graphflow.errors import CaptureError  # noqa: E402
from graphflow.plan import (  # noqa: E402
    Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream,
)
from graphflow.runtime import Runner  # noqa: E402

TARGETS = {"FULL": 1.02, "PIECEWISE": 1.05, "capture": 1.2}


class Layer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm1 = nn.RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm2 = nn.RMSNorm(hidden)
        self.up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def pre(self, x, qkv):
        # x: [B, H] -> qkv: [B, 3H]
        torch.matmul(self.norm1(x), self.qkv.weight.t(), out=qkv)

    def attention(self, qkv, k_cache, v_cache, o):
        # qkv: [B, 3H]; k_cache, v_cache: [B, heads, L, d] (the newest entry in the last slot); o: [B, H]
        b = qkv.shape[0]
        q, k, v = qkv.view(b, 3, self.heads, self.head_dim).unbind(1)
        k_cache[:, :, -1].copy_(k)
        v_cache[:, :, -1].copy_(v)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k_cache, v_cache)
        o.copy_(out.view(b, -1))

    def post(self, o, x):
        # x += o_proj(o); x += down(silu(gate) * up)
        x.add_(self.o(o))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        x.add_(self.down(F.silu(gate) * up))


class Decoder(nn.Module):
    def __init__(self, layers: int, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer(hidden, heads, ffn) for _ in range(layers))


def make_plan(layers, hidden, heads, cache_len, sizes, mode: Mode, warmup_iters: int) -> Plan:
    d = hidden // heads
    buffers = [Buffer("x", ("B", hidden), "bfloat16", "cuda:0", role=BufferRole.INPUT)]
    segments = []
    attention = SegmentKind.EAGER if mode is Mode.PIECEWISE else SegmentKind.GRAPH
    for i in range(layers):
        buffers += [
            Buffer(f"qkv{i}", ("B", 3 * hidden), "bfloat16", "cuda:0"),
            Buffer(f"k{i}", ("B", heads, cache_len, d), "bfloat16", "cuda:0", role=BufferRole.STATE),
            Buffer(f"v{i}", ("B", heads, cache_len, d), "bfloat16", "cuda:0", role=BufferRole.STATE),
            Buffer(f"o{i}", ("B", hidden), "bfloat16", "cuda:0"),
        ]
        segments += [
            Segment(f"L{i}.pre", SegmentKind.GRAPH, f"layers.{i}.pre", reads=("x",), writes=(f"qkv{i}",), stream="s0"),
            Segment(f"L{i}.attn", attention, f"layers.{i}.attention", reads=(f"qkv{i}", f"k{i}", f"v{i}"),
                    writes=(f"k{i}", f"v{i}", f"o{i}"), stream="s0"),
            Segment(f"L{i}.post", SegmentKind.GRAPH, f"layers.{i}.post", reads=(f"o{i}", "x"), writes=("x",),
                    stream="s0"),
        ]
    return Plan(name=f"bench-{mode.value.lower()}", buffers=buffers, streams=[Stream("s0", "cuda:0")],
                segments=segments, capture=CaptureSettings(modes=(mode,), sizes=tuple(sizes),
                                                           warmup_iters=warmup_iters))


class HandWritten:
    """What an engineer writes without graphflow: static buffers, a side stream, one pool."""

    def __init__(self, model: Decoder, sizes, mode: Mode, heads: int, cache_len: int, warmup_iters: int):
        self.model, self.mode = model, mode
        layers = model.layers
        hidden = layers[0].o.in_features
        big = max(sizes)
        kw = {"device": "cuda", "dtype": torch.bfloat16}
        self.x = torch.zeros(big, hidden, **kw)
        self.qkv = [torch.zeros(big, 3 * hidden, **kw) for _ in layers]
        self.k = [torch.zeros(big, heads, cache_len, hidden // heads, **kw) for _ in layers]
        self.v = [torch.zeros(big, heads, cache_len, hidden // heads, **kw) for _ in layers]
        self.o = [torch.zeros(big, hidden, **kw) for _ in layers]
        stream = torch.cuda.Stream()
        pool = torch.cuda.graph_pool_handle()
        order = sorted(sizes, reverse=True)
        started = time.perf_counter()
        for size in order:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup_iters):
                    self._eager(size)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
        self.seconds = {"warmup": time.perf_counter() - started}
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        self.steps = {}
        try:
            for size in order:
                self.steps[size] = self._capture(size, stream, pool)
        finally:
            gc.unfreeze()
        torch.cuda.synchronize()
        self.seconds["capture"] = time.perf_counter() - started

    def _args(self, size):
        n = slice(0, size)
        x = self.x[n]
        return x, [(x, q[n]) for q in self.qkv], [(q[n], k[n], v[n], o[n]) for q, k, v, o in
                                                   zip(self.qkv, self.k, self.v, self.o)], [(o[n], x) for o in self.o]

    def _eager(self, size):
        _, pre, attn, post = self._args(size)
        for layer, a, b, c in zip(self.model.layers, pre, attn, post):
            layer.pre(*a)
            layer.attention(*b)
            layer.post(*c)

    def _capture(self, size, stream, pool):
        x, pre, attn, post = self._args(size)
        layers = self.model.layers
        if self.mode is Mode.FULL:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                for layer, a, b, c in zip(layers, pre, attn, post):
                    layer.pre(*a)
                    layer.attention(*b)
                    layer.post(*c)
            replay = graph.replay

            def step(value):
                x.copy_(value)
                replay()

            step.graphs = [graph]
            return step
        graphs = []
        for i in range(len(layers) + 1):  # pre0 | post0 pre1 | ... | post31, as the plan's regions
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                if i > 0:
                    layers[i - 1].post(*post[i - 1])
                if i < len(layers):
                    layers[i].pre(*pre[i])
            graphs.append(graph)
        first, rest = graphs[0].replay, [g.replay for g in graphs[1:]]
        attention = [(layer.attention, args) for layer, args in zip(layers, attn)]

        def step(value):
            x.copy_(value)
            first()
            for (attend, args), replay in zip(attention, rest):
                attend(*args)
                replay()

        step.graphs = graphs
        return step

    def close(self):
        for step in self.steps.values():
            for graph in step.graphs:
                graph.reset()
        self.steps = {}


def compare_replay(graphflow_step, handwritten_step, x, steps: int) -> tuple[float, float]:
    """Median ms per step of each, the two alternating step by step so drift hits both alike."""
    for _ in range(10):
        graphflow_step(x)
        handwritten_step(x)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(steps)]
    torch.cuda.synchronize()
    for a, b, c, d in events:
        a.record()
        graphflow_step(x)
        b.record()
        c.record()
        handwritten_step(x)
        d.record()
    torch.cuda.synchronize()
    ours = statistics.median(a.elapsed_time(b) for a, b, _, _ in events)
    theirs = statistics.median(c.elapsed_time(d) for _, _, c, d in events)
    return ours, theirs


def timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--cache-len", type=int, default=256)
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--warmup-iters", type=int, default=2)
    parser.add_argument("--steps", type=int, default=500, help="timed steps per side and size")
    parser.add_argument("--capture-runs", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("engine_bench: needs a CUDA GPU (run it on the device: scripts/gpu_check.sh)", file=sys.stderr)
        return 1
    sizes = [int(s) for s in args.sizes.split(",")]
    torch.manual_seed(0)
    model = Decoder(args.layers, args.hidden, args.heads, args.ffn).to("cuda", torch.bfloat16).requires_grad_(False)
    shape = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, cache_len=args.cache_len, sizes=sizes)
    results = {"replay": [], "capture": [], "verify": {}}

    for mode in (Mode.PIECEWISE, Mode.FULL):
        plan = make_plan(**shape, mode=mode, warmup_iters=args.warmup_iters)
        # Untimed first: cuBLAS and attention kernels, the detectors' imports, and verify's proof.
        try:
            with run_pipeline(plan, RunOptions(backend="cuda"), model=model) as engine:
                results["verify"][mode.value] = all(r.bit_exact for r in engine.report.verify)
        except CaptureError as err:  # report what the detectors (or verify) said, then measure without them
            results.setdefault("errors", {})[mode.value] = str(err)
            with run_pipeline(plan, RunOptions(backend="cuda", detectors=False), model=model) as engine:
                results["verify"][mode.value] = all(r.bit_exact for r in engine.report.verify)
        HandWritten(model, sizes, mode, args.heads, args.cache_len, args.warmup_iters).close()

        runs = {"handwritten": [], "graphflow": [], "graphflow_detectors": [], "graphflow_verify": []}
        # Where each side's time goes: the hand loop's warmup and capture, graphflow's phases
        # (bare: no detectors, no verify), and what lies outside its phases (validation,
        # freezing the collector, the report).
        parts: dict[str, list[float]] = {}
        for _ in range(args.capture_runs):
            seconds, hand = timed(lambda: HandWritten(model, sizes, mode, args.heads, args.cache_len,
                                                      args.warmup_iters))
            runs["handwritten"].append(seconds)
            for name, took in hand.seconds.items():
                parts.setdefault(f"hand {name}", []).append(took)
            hand.close()
            del hand
            for key, options in (("graphflow", dict(verify=False, detectors=False)),
                                 ("graphflow_detectors", dict(verify=False, detectors="errors" not in results)),
                                 ("graphflow_verify", dict(verify=True, detectors=False))):
                seconds, engine = timed(lambda: run_pipeline(plan, RunOptions(backend="cuda", **options), model=model))
                runs[key].append(seconds)
                if key == "graphflow":
                    phases = {p.phase.value: p.seconds for p in engine.report.phases}
                    phases["outside phases"] = seconds - sum(phases.values())
                    for name, took in phases.items():
                        parts.setdefault(f"graphflow {name}", []).append(took)
                engine.close()
                del engine
            torch.cuda.empty_cache()
        capture = {k: statistics.median(v) for k, v in runs.items()}
        results["capture"].append({
            "mode": mode.value, "descriptors": len(sizes), "handwritten_s": capture["handwritten"],
            "graphflow_s": capture["graphflow"], "ratio": capture["graphflow"] / capture["handwritten"],
            "target": TARGETS["capture"], "graphflow_detectors_s": capture["graphflow_detectors"],
            "graphflow_verify_s": capture["graphflow_verify"],
            "parts_s": {name: statistics.median(v) for name, v in parts.items()}})

        engine = run_pipeline(plan, RunOptions(backend="cuda", verify=False, detectors=False), model=model)
        hand = HandWritten(model, sizes, mode, args.heads, args.cache_len, args.warmup_iters)
        runner = Runner(engine)
        for size in sizes:
            x = torch.randn(size, args.hidden, device="cuda", dtype=torch.bfloat16)
            ours, theirs = compare_replay(runner.run, hand.steps[size], x, args.steps)
            results["replay"].append({"mode": mode.value, "size": size, "handwritten_ms": theirs,
                                      "graphflow_ms": ours, "ratio": ours / theirs, "target": TARGETS[mode.value]})
        hand.close()
        engine.close()
        del engine, hand, runner

    document = {
        "benchmark": "engine", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "python": platform.python_version(), "model": {**shape, "ffn": args.ffn, "dtype": "bfloat16"},
        "warmup_iters": args.warmup_iters, "steps_per_size": args.steps, **results,
        "ok": all(r["ratio"] <= r["target"] for r in results["replay"] + results["capture"])
        and all(results["verify"].values()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"engine bench on {document['device']}, torch {document['torch']}: {args.layers} layers, hidden "
          f"{args.hidden}, sizes {sizes}")
    print(f"verify bit-exact: {results['verify']}")
    print(f"{'replay':<10}{'B':>4}{'hand ms':>10}{'graphflow ms':>14}{'ratio':>8}{'target':>8}")
    for r in results["replay"]:
        print(f"{r['mode']:<10}{r['size']:>4}{r['handwritten_ms']:>10.3f}{r['graphflow_ms']:>14.3f}"
              f"{r['ratio']:>8.3f}{r['target']:>8.2f}")
    print(f"{'capture':<10}{'N':>4}{'hand s':>10}{'graphflow s':>14}{'ratio':>8}{'target':>8}"
          f"{'+detectors s':>14}{'+verify s':>11}")
    for r in results["capture"]:
        print(f"{r['mode']:<10}{r['descriptors']:>4}{r['handwritten_s']:>10.3f}{r['graphflow_s']:>14.3f}"
              f"{r['ratio']:>8.3f}{r['target']:>8.2f}{r['graphflow_detectors_s']:>14.3f}{r['graphflow_verify_s']:>11.3f}")
    for r in results["capture"]:
        print(f"{r['mode']} capture, where the time goes (median s): "
              + ", ".join(f"{name} {took:.3f}" for name, took in r["parts_s"].items()))
    print("all targets met" if document["ok"] else "TARGET MISSED")
    return 0 if document["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
