"""What ``graphflow show PLAN -o FILE.png`` costs and produces, for five plans, against an older checkout.

Runs the command as a user does (a fresh interpreter per run, best of ``--runs``) for
the toy plan, dsv4 mini PIECEWISE and FULL, the 61-layer plan, the TP plan and a
generated 10,001-segment plan (2,500 copies of a 4-segment for_each block,
``tests/big_plans.py``), with this checkout and, with ``--before DIR``, with another
one side by side (e.g. ``git archive <commit> | tar -x -C DIR``), and this checkout
with ``--expand`` (every copy drawn, up to the size cap). Records wall time, peak
memory (max RSS of the child) and the PNG's pixel size; prints a table with the ratios
and writes ``bench/results/picture.json``.

Run from the repository root: ``python bench/picture_bench.py [--before DIR] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULT = ROOT / "bench" / "results" / "picture.json"
PLANS = ("toy", "dsv4_mini_piecewise", "dsv4_mini_full", "dsv4_61l_decode", "dsv4_tp_piecewise")


def _png_size(path: Path) -> tuple[int, int] | None:
    """The width and height in a PNG's header (no image library needed)."""
    try:
        head = path.read_bytes()[:24]
    except OSError:
        return None
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _run(checkout: Path, plan: Path, out: Path, extra: list[str]) -> dict:
    """One ``graphflow show`` in a fresh interpreter: seconds, peak RSS of the child, pixels."""
    env = dict(os.environ, PYTHONPATH=str(checkout), MPLBACKEND="Agg")
    with tempfile.TemporaryFile() as log:
        start = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "graphflow", "show", str(plan), "-o", str(out), *extra],
                                 cwd=checkout, env=env, stdout=log, stderr=log)
        _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage: its peak RSS
        seconds = time.perf_counter() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read().decode(errors="replace").strip()
    if child.returncode != 0:
        return {"error": text.splitlines()[-1] if text else f"exit {child.returncode}"}
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024, "pixels": _png_size(out),
            "bytes": out.stat().st_size}


def _best(checkout: Path, plan: Path, out: Path, runs: int, extra: list[str]) -> dict:
    results = [_run(checkout, plan, out, extra) for _ in range(runs)]
    good = [r for r in results if "error" not in r]
    if not good:
        return results[0]
    return min(good, key=lambda r: r["seconds"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="another checkout to measure side by side")
    parser.add_argument("--runs", type=int, default=3, help="runs per plan and checkout (best is kept)")
    parser.add_argument("--layers", type=int, default=2500, help="copies in the generated plan (2500: 10,001 segments)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from big_plans import layered_yaml

    work = Path(tempfile.mkdtemp(prefix="picture-bench-"))
    generated = work / "layered.yaml"
    generated.write_text(layered_yaml(args.layers))
    plans = [(name, ROOT / "plans" / f"{name}.yaml") for name in PLANS]
    plans.append((f"layered ({4 * args.layers + 1:,} segments)", generated))
    checkouts = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    rows = []
    for name, plan in plans:
        row = {"plan": name}
        for label, checkout in checkouts:
            # The generated plan takes the old drawing tens of seconds: one run of it is enough.
            runs = 1 if label == "before" and plan == generated else args.runs
            row[label] = _best(checkout, plan, work / f"{label}-{plan.stem}.png", runs, [])
        row["after --expand"] = _best(ROOT, plan, work / f"expand-{plan.stem}.png", args.runs, ["--expand"])
        rows.append(row)
        _print_row(row, [label for label, _ in checkouts] + ["after --expand"])
    RESULT.parent.mkdir(parents=True, exist_ok=True)
    RESULT.write_text(json.dumps({
        "what": "graphflow show PLAN -o FILE.png, fresh interpreter, best of runs",
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "load_1m": os.getloadavg()[0]},
        "runs": args.runs, "checkouts": {label: str(path) for label, path in checkouts}, "rows": rows,
    }, indent=2) + "\n")
    print(f"\nwrote {RESULT.relative_to(ROOT)}")
    return 0


def _cell(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error'][:40]}"
    w, h = result["pixels"] or (0, 0)
    rss = f"{result['peak_rss_mb']:.0f} MB"
    return f"{w:>6} x {h:<5} {result['seconds']:6.2f} s {rss:>8}"


def _print_row(row: dict, labels: list[str]) -> None:
    if row is not None and not getattr(_print_row, "header", False):
        print(f"{'plan':<28}" + "".join(f"{label + ': pixels, time, peak RSS':<40}" for label in labels)
              + ("time before/after" if "before" in labels else ""))
        _print_row.header = True
    ratio = ""
    if "before" in labels and "seconds" in row["after"] and "seconds" in row["before"]:
        ratio = f"{row['before']['seconds'] / row['after']['seconds']:.2f}"
    print(f"{row['plan']:<28}" + "".join(f"{_cell(row[label]):<40}" for label in labels) + ratio)


if __name__ == "__main__":
    sys.exit(main())
