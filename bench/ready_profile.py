"""Where time to ready goes: cProfile of the hand loop and of graphflow's bare and default
runs on a few descriptors of a 61-layer dsv4 plan, in one process.

    PYTHONPATH=. python3 bench/ready_profile.py --out DIR [--plan FULL|PIECEWISE] [--count 16]
    PYTHONPATH=. python3 bench/ready_profile.py --out DIR --smoke     # CPU, 2 layers: checks the script

Each run is profiled once after an untimed hand loop (the process's cold start). Prints,
per run, its total and the functions with the most own time and the most cumulative time
(graphflow's host time beside the hand loop's), and writes them to ``ready_profile.txt``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pathlib
import pstats
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.ready_bench import PLANS, SMOKE_ARGS, graphflow_run, hand_loop  # noqa: E402
from graphflow.engine import RunOptions  # noqa: E402
from graphflow.engine.model.binding import build_model  # noqa: E402
from graphflow.integrations.dsv4.plans import plan_variant  # noqa: E402


def profiled(name: str, run, top: int) -> str:
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    row = run()
    profile.disable()
    total = time.perf_counter() - began
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"== {name}: {total:.2f} s (warmup {row['warmup_s']:.2f}, capture {row['capture_s']:.2f}, "
               f"verify {row['verify_s']:.2f})\n-- own time\n")
    stats.sort_stats("tottime").print_stats(top)
    text.write("-- cumulative\n")
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--plan", default="FULL", choices=sorted(PLANS))
    parser.add_argument("--count", type=int, default=16, help="descriptors, spread over the plan's sizes")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    backend = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    overrides = dict(n_layers=2, **SMOKE_ARGS) if args.smoke else dict(n_layers=61)
    full = plan_variant(PLANS[args.plan], **overrides)
    sizes = [1, 2, 4] if args.smoke else sorted(full.capture.all_sizes)  # the mini widths hold 32 rows
    step = max(len(sizes) // args.count, 1)
    plan = plan_variant(PLANS[args.plan], sizes=tuple(sizes[::step][: args.count]), **overrides)
    model = build_model(plan, {"device": torch.device("cpu" if backend == "cpu" else "cuda:0"), "plan": plan})
    hand_loop(plan, model, backend)  # the cold start, untimed
    runs = [("hand loop", lambda: hand_loop(plan, model, backend)),
            ("graphflow bare", lambda: graphflow_run(plan, model, RunOptions(backend=backend, verify=False,
                                                                            detectors=False))),
            ("graphflow default", lambda: graphflow_run(plan, model, RunOptions(backend=backend)))]
    text = f"# {args.plan}, {len(plan.descriptors())} descriptors, {backend}\n" + "".join(
        profiled(name, run, args.top) for name, run in runs)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"ready_profile_{args.plan.lower()}.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
