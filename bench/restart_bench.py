"""Warm restart: a new process live from saved graphs, against capturing them again.

    PYTHONPATH=. python3 bench/restart_bench.py --out DIR                  # GPU: the 61-layer FULL plan
    PYTHONPATH=. python3 bench/restart_bench.py --out DIR --smoke          # CPU, 2 layers: checks the script
                                                                           # (nothing saved: the restore captures)

Three fresh processes, one after another, each building the model from the same seed:

* **capture** captures every descriptor as ``graphflow run`` does and saves the graphs
  (``RunOptions(save_graphs=DIR)``), then serves one batch of each sampled size from one
  state and keeps the logits;
* **restore** brings the same plan live from the saved graphs
  (``RunOptions(graphs_from=DIR)``) and serves the same batches from the same state:
  its logits must equal the capture's bit for bit, and the plan's eager step (the model's
  own code, outside any graph) on the same inputs;
* **changed** does the same with a plan whose key differs (one more descriptor size
  listed): the saved graphs must be refused in one line and the run captured;
* **restore-wN** (``--workers N,...``): the restore again, its graphs built by ``N``
  threads at once (the engine's default is one per core, at most 16);
* **again** (``--again``) captures and saves once more, in a fresh process: its saved
  graphs are compared with the first process's node by node (kernel, library, launch
  shape, each address as its region, every other argument byte). Graphs a restart
  builds are only right if two captures save the same graphs: where they differ, the
  first differing nodes of each descriptor are printed, and what differs.

For each: seconds from the model built to every descriptor live (the 61-layer FULL plan's
capture took 12-13 s on the H100; the target for a restart is at most 2 s), how many
descriptors were restored and how many captured. Prints a table and writes
``restart.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # graphflow and bench, run from anywhere

SMOKE = dict(n_layers=2, vocab_size=512, hidden_size=64, n_heads=4, kv_dim=32, rope_dim=16, n_experts=8, top_k=2,
             moe_inter=64, shared_inter=128, max_len=128, block_size=16, max_batch=32, dtype="float32")


def child(role: str, plan_path: str, saved: pathlib.Path, smoke: bool, verify: str = "sample",
          layers: int | None = None, sizes: tuple[int, ...] | None = None) -> dict:
    from graphflow.engine import RunOptions, run_pipeline
    from graphflow.engine.restart import driver as restart_driver
    from graphflow.engine.model.binding import build_model
    from graphflow.integrations.dsv4.plans import plan_variant
    from graphflow.runtime import Runner

    device = torch.device("cpu" if smoke else "cuda:0")
    sizes = sizes or ((1, 2, 4) if smoke else None)
    model_args = {**(SMOKE if smoke else {}), **({"n_layers": layers} if layers else {})}
    plan = plan_variant(plan_path, sizes=sizes, **model_args)
    if role == "changed":
        more = next(n for n in range(1, 1 << 20) if n not in plan.capture.all_sizes)
        plan = plan_variant(plan_path, sizes=tuple(sorted({*plan.capture.all_sizes, more})), **model_args)
    torch.manual_seed(0)
    model = build_model(plan, {"device": device, "plan": plan})
    if device.type == "cuda":
        torch.cuda.synchronize()
    built = time.perf_counter()
    if role == "again":
        saved = saved / "again"
    if role.startswith("restore-w"):
        restart_driver.WORKERS = int(role.removeprefix("restore-w"))
    # The CPU backend records no graphs to save: a smoke run's restore is refused and captures.
    saving = role in ("capture", "again") and device.type == "cuda"
    options = RunOptions(backend=device.type, save_graphs=saved if saving else None,
                         graphs_from=None if role in ("capture", "again") else saved,
                         verify=verify if role.startswith("restore") else "sample")
    said = []

    def show(message, *args, **kwargs) -> None:  # said as it happens: a later crash still shows why
        said.append(message)
        print(f"{role}: {message}", file=sys.stderr, flush=True)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        engine = run_pipeline(plan, options, model=model)
    if device.type == "cuda":
        torch.cuda.synchronize()
    live_s = time.perf_counter() - built
    restart = engine.report.restart
    result = {"role": role, "live_s": live_s, "descriptors": len(engine.programs),
              "restart": None if restart is None else {k: getattr(restart, k) for k in
                                                       ("saved", "restored", "captured", "refused", "seconds",
                                                        "left_out", "built", "saving", "recaptured")},
              "warnings": [str(message) for message in said]}
    try:
        result["logits"] = _serve(engine, Runner(engine), plan, device)
    finally:
        engine.close()
    return result


def _serve(engine, runner, plan, device) -> dict:
    """One batch of each sampled size from one state (every buffer zeroed, then seeded
    inputs): the logits, and whether each equals the plan's eager step from that state."""
    from bench.ready_bench import eager_reference

    sizes = sorted(plan.capture.all_sizes)
    picked = sorted({sizes[0], sizes[-1], *sizes[:: max(1, len(sizes) // 6)]})
    out, eager_equal = {}, {}
    for size in picked:
        generator = torch.Generator(device=device).manual_seed(size)
        inputs = tuple(torch.randint(0, 64, (size,), device=device, generator=generator) for _ in runner.inputs)
        for tensor in engine.buffers.tensors.values():
            tensor.zero_()
        descriptor = runner.descriptor_for(size)
        (logits,) = runner.run(*inputs)[:1]
        got = logits.clone()
        for tensor in engine.buffers.tensors.values():
            tensor.zero_()
        eager_equal[size] = bool(torch.equal(got, eager_reference(runner, size, inputs, descriptor)))
        out[size] = got.float().cpu()
    return {"eager_equal": eager_equal, "tensors": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--plan", default="plans/dsv4_61l_full.yaml")
    parser.add_argument("--smoke", action="store_true", help="CPU, 2 layers, 3 sizes")
    parser.add_argument("--verify", default="sample", choices=("sample", "off"),
                        help="what the restoring process verifies before ready (off: only the comparison here)")
    parser.add_argument("--again", action="store_true",
                        help="capture and save once more in a fresh process; compare the two saved runs node by node")
    parser.add_argument("--layers", type=int, help="the plan's layers (default: the plan's, 2 with --smoke)")
    parser.add_argument("--sizes", help="descriptor sizes (default: the plan's; 1,2,4 with --smoke)")
    parser.add_argument("--workers", default="",
                        help="comma-separated thread counts: one more restoring process for each, its graphs built "
                             "by that many threads")
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--saved", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = tuple(int(n) for n in args.sizes.split(",")) if args.sizes else None
    if args.role:
        result = child(args.role, args.plan, pathlib.Path(args.saved), args.smoke, args.verify, args.layers, sizes)
        torch.save(result, pathlib.Path(args.saved) / f"{args.role}.pt")
        return 0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as saved:
        workers = tuple(f"restore-w{n}" for n in args.workers.split(",") if n)
        results = processes(("capture", "restore", *workers, "changed", *(("again",) if args.again else ())), args.plan,
                            pathlib.Path(saved), smoke=args.smoke, verify=args.verify, layers=args.layers, sizes=sizes)
        saved_bytes = sum(p.stat().st_size for p in pathlib.Path(saved).glob("graphs.*"))
        if args.again and "live_s" in results.get("again", {}):
            from graphflow.engine.restart import store

            results["again_differs"] = differs = saved_runs_differ(store.load(pathlib.Path(saved)),
                                                                    store.load(pathlib.Path(saved) / "again"))
            print("two captures saved " + ("the same graphs" if not differs else "different graphs:"))
            for descriptor, lines in differs.items():
                print(f"  {descriptor}:\n" + "\n".join(f"    {line}" for line in lines))
    results["saved_bytes"] = saved_bytes
    results["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    _print(results)
    for role in results:
        if isinstance(results[role], dict) and "logits" in results[role]:
            results[role]["logits"] = {k: v for k, v in results[role]["logits"].items() if k != "tensors"}
    (out / "restart.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


def processes(roles, plan: str, saved: pathlib.Path, *, smoke: bool, verify: str = "sample",
              layers: int | None = None, sizes: tuple[int, ...] | None = None) -> dict[str, dict]:
    """Each role in a fresh process of its own, one after another, sharing ``saved``:
    what each did (``child``), or its exit status and the end of its stderr; the
    restoring processes' logits compared with the capturing one's (``equal_to_capture``)."""
    results: dict[str, dict] = {}
    for role in roles:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, __file__, "--role", role, "--saved", str(saved), "--plan", str(plan),
                               "--verify", verify, *(["--smoke"] if smoke else []),
                               *(["--layers", str(layers)] if layers else []),
                               *(["--sizes", ",".join(map(str, sizes))] if sizes else [])],
                              capture_output=True, text=True)
        if done.returncode != 0:
            results[role] = {"error": done.stderr[-3000:], "exit": done.returncode}
            said = "\n".join(line for line in done.stderr.splitlines() if line.startswith(f"{role}: "))
            print(f"{role}: exit {done.returncode}\n{said}\n{done.stderr[-3000:]}", flush=True)
            continue
        results[role] = torch.load(saved / f"{role}.pt", weights_only=False)
        results[role]["process_s"] = time.perf_counter() - began
        print(f"{role}: live {results[role]['live_s']:.2f} s after the model was built; "
              f"{results[role]['restart']}", flush=True)
    _compare(results)
    return results


def saved_runs_differ(first, second, limit: int = 6) -> dict[str, list[str]]:
    """Per descriptor, the first ``limit`` nodes whose saved form differs between two
    saved runs, and how; a pool's or other memory's place is compared by its kind only
    (its blocks are numbered as they were allocated)."""
    theirs = {(d.size, d.mode): d for d in second.descriptors}
    found: dict[str, list[str]] = {}
    for mine in first.descriptors:
        other = theirs.get((mine.size, mine.mode))
        name = f"{mine.mode} B={mine.size}"
        if other is None:
            found[name] = ["not saved by the second run"]
            continue
        lines = []
        if len(mine.graphs) != len(other.graphs):
            lines.append(f"{len(mine.graphs)} graphs against {len(other.graphs)}")
        for number, (a, b) in enumerate(zip((g.unpack() for g in mine.graphs), (g.unpack() for g in other.graphs))):
            if len(a.nodes) != len(b.nodes):
                lines.append(f"graph {number}: {len(a.nodes)} nodes against {len(b.nodes)}")
            if a.after != b.after:
                lines.append(f"graph {number}: the nodes wait for different nodes")
            for index, (x, y) in enumerate(zip(a.nodes, b.nodes)):
                what = _node_differs(x, y)
                if what:
                    lines.append(f"graph {number} node {index} ({getattr(x, 'name', type(x).__name__)[:60]}): {what}")
                if len(lines) >= limit:
                    break
        if lines:
            found[name] = lines[:limit]
    return found


def _kind(place) -> tuple:
    kind = place.region.split(":", 1)[0]
    return (kind,) if kind in ("pool", "memory") else (place.region, place.offset)


def _node_differs(x, y) -> str:
    from graphflow.engine.restart.saved import Kernel

    if type(x) is not type(y):
        return f"a {type(x).__name__} against a {type(y).__name__}"
    if not isinstance(x, Kernel):
        fields = [f for f in ("pitch", "value", "element", "width", "height", "src_pitch", "dst_pitch")
                  if getattr(x, f, None) != getattr(y, f, None)]
        places = [f for f in ("dst", "src") if hasattr(x, f) and _kind(getattr(x, f)) != _kind(getattr(y, f))]
        return ", ".join(fields + [f"{f} in {getattr(x, f).region} against {getattr(y, f).region}" for f in places])
    said = [f"{f} {getattr(x, f)} against {getattr(y, f)}" for f in ("name", "library", "grid", "block", "shared",
                                                                     "offsets", "cluster", "max_shared")
            if getattr(x, f) != getattr(y, f)]
    if said:
        return "; ".join(said)
    ours = {p.at: _kind(p.where) for p in x.pointers}
    theirs = {p.at: _kind(p.where) for p in y.pointers}
    if ours != theirs:
        return f"addresses at bytes {sorted(set(ours.items()) ^ set(theirs.items()))[:4]}"
    words = [at for at in range(0, len(x.args), 8) if at not in ours and x.args[at:at + 8] != y.args[at:at + 8]]
    if words:
        return "argument bytes differ, not as addresses: " + ", ".join(
            f"at {at}: {x.args[at:at + 8].hex()} against {y.args[at:at + 8].hex()}" for at in words[:3])
    return ""


def _compare(results: dict) -> None:
    if "logits" not in results.get("capture", {}):
        return
    reference = results["capture"]["logits"]["tensors"]
    for role in [role for role in results if role.startswith("restore") or role == "changed"]:
        got = results.get(role, {}).get("logits")
        if got is not None:
            results[role]["equal_to_capture"] = {size: bool(torch.equal(reference[size], tensor))
                                                 for size, tensor in got["tensors"].items() if size in reference}


def _print(results: dict) -> None:
    capture = results.get("capture", {}).get("live_s")
    print(f"\nwarm restart, {results['device']}; saved graphs {results['saved_bytes'] / 2**20:.1f} MiB")
    print(f"{'process':<10}{'live after model (s)':>22}{'vs capture':>12}  restored / captured   "
          "bit-exact (capture, eager)  built")
    for role in [role for role in results if role.startswith(("capture", "restore", "changed"))]:
        row = results.get(role, {})
        if "live_s" not in row:
            print(f"{role:<10}  failed: exit {row.get('exit')}")
            continue
        restart = row["restart"] or {}
        ratio = f"{row['live_s'] / capture:.3f}x" if capture else "-"
        counts = f"{restart.get('restored', 0)} / {restart.get('captured', 0)}" if role != "capture" else \
            f"saved {restart.get('saved', 0)}"
        exact = (all(row.get("equal_to_capture", {}).values()) if role != "capture" else "-",
                 all(row["logits"]["eager_equal"].values()))
        built = restart.get("built") or {}
        said = (f"{built['nodes']} nodes: add {built['add_s']:.2f} s, instantiate {built['instantiate_s']:.2f} s, "
                f"{built['wall_s']:.2f} s on {built['threads']} threads" if built.get("nodes") else "")
        if built.get("matmuls"):
            said += (f"; {built['matmuls']} multiplications run to load libraries in {built['matmuls_s']:.2f} s"
                     + (f" ({built['matmuls_failed']})" if built.get("matmuls_failed") else ""))
        print(f"{role:<10}{row['live_s']:>22.2f}{ratio:>12}  {counts:<20}  {str(exact):<26}  {said}")
        for line in restart.get("recaptured") or ():
            print(f"{'':<10}captured {line}")
        if restart.get("refused"):
            print(f"{'':<10}refused: {restart['refused']}")


if __name__ == "__main__":
    sys.exit(main())
