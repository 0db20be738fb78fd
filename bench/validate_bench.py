"""How long ``graphflow validate`` takes on a DeepSeek-size plan: 61 layers x 67 descriptors.

Measures the whole command as a user runs it (a fresh interpreter per run, median of
5, interpreter start included), what starting it costs (a bare interpreter, importing
the CLI, and networkx on its own), and, in process, loading the YAML and validating
the plan separately. Prints a table and writes ``bench/results/validate.json``. Target:
the whole command under 1 s.

The plan is ``plans/dsv4_61l_decode.yaml`` when the checkout has it; otherwise one of
the same shape is generated: per layer a graph pre-attention segment, an eager
attention and a graph post-attention with an all-reduce, with per-layer buffers.

Run from the repository root: ``python bench/validate_bench.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLAN = ROOT / "plans" / "dsv4_61l_decode.yaml"
RESULT = ROOT / "bench" / "results" / "validate.json"

#: The descriptor sizes vLLM captures by default for decode: 67 of them, 1 to 512.
SIZES = [1, 2, 4, *range(8, 513, 8)]


def generated_plan(layers: int = 61) -> str:
    """A 61-layer split-graph decode plan in the YAML format, with ``for_each``."""
    return f"""\
graphflow: 1
name: dsv4-{layers}l-decode-bench
model: graphflow.integrations.dsv4:build_model
world_size: 2
symbols: {{B: {SIZES}}}
for_each: {{layer: "range({layers})"}}
streams:
  s0: {{device: cuda:0}}
buffers:
  tokens:          {{shape: [B], dtype: int64, device: cuda:0, role: input, values: [0, 32000]}}
  x:               {{shape: [B, 4096], dtype: bfloat16, device: cuda:0}}
  "q{{layer}}":      {{shape: [B, 16, 1, 128], dtype: bfloat16, device: cuda:0}}
  "kv{{layer}}":     {{shape: [B, 1, 576], dtype: bfloat16, device: cuda:0}}
  "cache{{layer}}":  {{shape: [512, 64, 576], dtype: bfloat16, device: cuda:0, role: state}}
  "o{{layer}}":      {{shape: [B, 16, 1, 128], dtype: bfloat16, device: cuda:0}}
  logits:          {{shape: [B, 32000], dtype: float32, device: cuda:0, role: output}}
channels:
  tp_ar: {{kind: all_reduce, group: tp, id: 1, family: target, warmup: real}}
segments:
  - {{name: embed, kind: graph, call: embed, reads: [tokens], writes: [x], stream: s0}}
  - {{name: "L{{layer}}.pre", kind: graph, call: "layers.{{layer}}.pre_attention",
     reads: [x], writes: ["q{{layer}}", "kv{{layer}}"], stream: s0}}
  - {{name: "L{{layer}}.attn", kind: eager, call: "layers.{{layer}}.attention",
     reads: ["q{{layer}}", "kv{{layer}}", "cache{{layer}}"], writes: ["o{{layer}}", "cache{{layer}}"]}}
  - {{name: "L{{layer}}.post", kind: graph, call: "layers.{{layer}}.post_attention",
     reads: ["o{{layer}}", x], writes: [x], stream: s0, channels: [tp_ar], data_dependent: true}}
  - {{name: head, kind: graph, call: head, reads: [x], writes: [logits], stream: s0}}
capture:
  modes: [PIECEWISE]
  sizes: B
  warmup_iters: 2
  verify: {{atol: 0, rtol: 0}}
"""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_command(plan: Path, runs: int) -> tuple[list[float], list[float], int, str]:
    """Wall and CPU time of ``python -m graphflow validate PLAN`` in a fresh interpreter, per run.

    CPU time (user + system of the child) barely moves when other work shares the
    machine; wall time is what a user waits.
    """
    walls, cpus, status, output = [], [], 0, ""
    for _ in range(runs):
        cpu, start = _child_cpu(), time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "graphflow", "validate", str(plan)],
                              capture_output=True, text=True, env=_env(), cwd=ROOT)
        walls.append(time.perf_counter() - start)
        cpus.append(_child_cpu() - cpu)
        status, output = proc.returncode, proc.stdout + proc.stderr
    return walls, cpus, status, output


def time_snippet(code: str, runs: int) -> list[float]:
    """Wall time of ``python -c CODE`` in a fresh interpreter, per run."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=ROOT)
        times.append(time.perf_counter() - start)
    return times


def time_in_process(plan: Path, runs: int) -> tuple[list[float], list[float], object, object]:
    """Load and validate separately, in this process, after one warm-up of each."""
    from graphflow.plan.loader import load_plan
    from graphflow.plan.rules import validate

    loaded = load_plan(plan)
    report = validate(loaded)
    loads, checks = [], []
    for _ in range(runs):
        start = time.perf_counter()
        loaded = load_plan(plan)
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        report = validate(loaded)
        checks.append(time.perf_counter() - start)
    return loads, checks, loaded, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement (the median is reported)")
    parser.add_argument("--generate", action="store_true", help=f"use a generated plan even if {PLAN.name} exists")
    parser.add_argument("-o", "--output", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))

    with tempfile.TemporaryDirectory() as tmp:
        if PLAN.exists() and not args.generate:
            plan_path, source = PLAN, str(PLAN.relative_to(ROOT))
        else:
            plan_path, source = Path(tmp) / "dsv4_61l_decode.yaml", "generated (bench/validate_bench.py)"
            plan_path.write_text(generated_plan())
        command, command_cpu, status, output = time_command(plan_path, args.runs)
        bare = time_snippet("pass", args.runs)
        imports = time_snippet("import graphflow.cli; graphflow.cli.build_parser()", args.runs)
        networkx = time_snippet("import networkx", args.runs)
        loads, checks, plan, report = time_in_process(plan_path, args.runs)

    rows = [  # (key in the JSON, label in the table, seconds per run)
        ("command_wall", "graphflow validate (whole process)", command),
        ("command_cpu", "  its CPU time (user + sys)", command_cpu),
        ("interpreter", "python -c pass (interpreter floor)", bare),
        ("import_cli", "import graphflow.cli + parser (fresh)", imports),
        ("import_networkx", "  of which import networkx (fresh)", networkx),
        ("load_plan", "load_plan (in process)", loads),
        ("validate", "validate (in process)", checks),
    ]
    result = {
        "benchmark": "validate",
        "plan": source,
        "segments": len(plan.segments),
        "buffers": len(plan.buffers),
        "descriptors": len(plan.descriptors()),
        "diagnostics": {"errors": len(report.errors), "warnings": len(report.warnings)},
        "exit_status": status,
        "runs": args.runs,
        "measurements": {key: label.strip() for key, label, _ in rows},
        "median_s": {key: statistics.median(times) for key, _, times in rows},
        "all_s": {key: times for key, _, times in rows},
        "target_s": {"command_wall": 1.0},
        "machine": {
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0],
            "processor": platform.processor() or platform.machine(),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"plan: {source}: {result['segments']} segments, {result['buffers']} buffers, "
          f"{result['descriptors']} descriptors; validate exit {status}, "
          f"{len(report.errors)} errors, {len(report.warnings)} warnings")
    print(f"{'measurement':<38} {'median':>9} {'min':>9} {'max':>9}")
    for _, label, times in rows:
        print(f"{label:<38} {statistics.median(times) * 1e3:>7.1f}ms {min(times) * 1e3:>7.1f}ms "
              f"{max(times) * 1e3:>7.1f}ms")
    if status not in (0, 1):
        print(f"graphflow validate failed (exit {status}):\n{output}", file=sys.stderr)
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output.relative_to(ROOT) if args.output.is_relative_to(ROOT) else args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
