"""What a graphflow decorator costs on the eager path, and how long a plan takes to build.

The decorators hand the original function back to the class, so a decorated method
should cost exactly what the undecorated one does. This measures it rather than
assuming it: the same ``nn.Module`` method, undecorated and decorated, called many
times (median of repeats), for a method that does nothing (the call alone) and for
one that does a small torch op. An undecorated-vs-undecorated row (two identical
classes) shows the noise floor the difference must be read against. Target: the
decorated call within noise, under 1 microsecond a call.

It also times ``plan_from_module`` (walk the tree, record the steps, build and check
the plan) for the test model at 3 and 61 layers and for the dsv4 mini model.

Prints a table and writes ``bench/results/decorator.json``. Run from the repository
root: ``PYTHONPATH=. python bench/decorator_bench.py [--calls 200000] [--repeats 15]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import timeit
from pathlib import Path

import torch
from torch import nn

import graphflow
from graphflow.plan.decorators import plan_from_module
from tests.tiny_decorated import build_model

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "decorator.json"


class Plain(nn.Module):
    def noop(self, x, y):
        return None

    def add(self, x, y):
        torch.add(x, 1.0, out=y)


class PlainAgain(nn.Module):
    """Identical to Plain: the difference between the two is noise."""

    def noop(self, x, y):
        return None

    def add(self, x, y):
        torch.add(x, 1.0, out=y)


class Decorated(nn.Module):
    @graphflow.segment(reads=["x"], writes=["y"], stream="s0")
    def noop(self, x, y):
        return None

    @graphflow.segment(reads=["x"], writes=["y"], stream="s0")
    def add(self, x, y):
        torch.add(x, 1.0, out=y)


def per_call_ns(module: nn.Module, method: str, calls: int, repeats: int) -> list[float]:
    """Nanoseconds a call, one value per repeat (each repeat is ``calls`` calls)."""
    bound = getattr(module, method)
    x, y = torch.zeros(4), torch.zeros(4)
    timer = timeit.Timer("m(x, y)", globals={"m": bound, "x": x, "y": y})
    timer.timeit(number=calls // 10)  # warm up
    return [t / calls * 1e9 for t in timer.repeat(repeat=repeats, number=calls)]


#: The torch op costs ~100x the bare call: fewer calls keep each repeat near the same wall time.
CALL_SCALE = {"noop": 1, "add": 50}


def interleaved(calls: int, repeats: int) -> dict[tuple[str, str], list[float]]:
    """Repeats alternate between the classes, so drift (clock, load, cache) hits them alike."""
    samples: dict[tuple[str, str], list[float]] = {}
    modules = {"undecorated": Plain(), "undecorated (again)": PlainAgain(), "decorated": Decorated()}
    for _ in range(repeats):
        for method, scale in CALL_SCALE.items():
            for label, module in modules.items():
                samples.setdefault((method, label), []).extend(per_call_ns(module, method, calls // scale, 1))
    return samples


def build_time_ms(model: nn.Module, repeats: int, **kwargs) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_from_module(model, **kwargs)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def plan_builds(repeats: int) -> list[dict]:
    """plan_from_module on the test model (3 and 61 layers) and on the dsv4 mini model."""
    from graphflow.integrations.dsv4 import build_model as build_dsv4

    models = [(f"tests.tiny_decorated, {n} layers", build_model(layers=n), {}) for n in (3, 61)]
    models.append(("dsv4 mini (4 layers), piecewise_step", build_dsv4(), {"step": "piecewise_step"}))
    return [{"model": label, "plan_from_module_ms": round(build_time_ms(model, repeats, **kwargs), 2)}
            for label, model, kwargs in models]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per repeat")
    parser.add_argument("--repeats", type=int, default=15, help="repeats (the median is reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a 4-element op needs no pool; one thread keeps the timing steady

    samples = interleaved(args.calls, args.repeats)
    rows = []
    for method in ("noop", "add"):
        base = statistics.median(samples[(method, "undecorated")])
        for label in ("undecorated", "undecorated (again)", "decorated"):
            values = samples[(method, label)]
            median = statistics.median(values)
            rows.append({
                "method": method, "variant": label, "median_ns": round(median, 1),
                "min_ns": round(min(values), 1), "max_ns": round(max(values), 1),
                "delta_vs_undecorated_ns": round(median - base, 1),
            })
    builds = plan_builds(repeats=5)

    print(f"{'method':6} {'variant':20} {'median ns':>10} {'min ns':>8} {'max ns':>8} {'delta ns':>9}")
    for row in rows:
        print(f"{row['method']:6} {row['variant']:20} {row['median_ns']:10.1f} {row['min_ns']:8.1f} "
              f"{row['max_ns']:8.1f} {row['delta_vs_undecorated_ns']:+9.1f}")
    print()
    print(f"{'model':40} {'plan_from_module ms':>20}")
    for build in builds:
        print(f"{build['model']:40} {build['plan_from_module_ms']:20.2f}")

    noise = {m: abs(next(r["delta_vs_undecorated_ns"] for r in rows
                         if r["method"] == m and r["variant"] == "undecorated (again)")) for m in ("noop", "add")}
    result = {
        "benchmark": "decorator eager-path overhead and plan build time",
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "calls_per_repeat": {m: args.calls // scale for m, scale in CALL_SCALE.items()},
        "repeats": args.repeats,
        "calls": rows,
        "noise_floor_ns": noise,
        "decorated_is_original_function": Decorated.__dict__["noop"].__qualname__ == "Decorated.noop",
        "plan_build": builds,
        "target": "decorated within noise of undecorated, and under 1000 ns a call",
    }
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
