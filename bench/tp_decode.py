"""Decode-step time of the tensor-parallel dsv4 model per GPU count: eager, PIECEWISE, FULL.

    PYTHONPATH=. python3 bench/tp_decode.py --out DIR [--layers 61] [--sizes 1,8,32] [--steps 30]
    PYTHONPATH=. python3 bench/tp_decode.py --out DIR --smoke     # CPU, gloo, tiny model: checks the script

For each GPU count in 1, 2, 4, 8 up to the GPUs present (and dividing the model's heads
and experts), one ``graphflow.dist.launch`` of that many NCCL ranks captures both TP plans
(``plans/dsv4_tp_piecewise.yaml``, ``plans/dsv4_tp_full.yaml``, resized with ``plan_variant``)
through ``run_pipeline`` with verify on, and times, per batch size:

* eager: the PIECEWISE plan's step run eagerly (the committed channel's plain all-reduce);
* PIECEWISE and FULL: ``Runner.run`` replaying the captured step.

Every rank times the same loop (the all-reduces keep them in step); the table shows the
slowest rank. Writes ``DIR/tp_decode.json`` after each GPU count and prints a table. On
one GPU it runs the 1-rank count only (the TP code path over NCCL, no peer: the
baseline row); with no GPU it records that and exits 0 (``--smoke`` aside).
"""

from __future__ import annotations

import argparse
import json
import statistics
import pathlib
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from graphflow.dist.launch import NVLS_ENV, launch  # noqa: E402

PLANS = {"piecewise": ROOT / "plans/dsv4_tp_piecewise.yaml", "full": ROOT / "plans/dsv4_tp_full.yaml"}
POSITION = 200  # sequence b decodes token POSITION + b % compress_every: compressed entries and a tail
#: The 61-layer plans' widths (plans/dsv4_61l_full.yaml), with experts and heads every count divides.
MODEL_ARGS = {"vocab_size": 32768, "hidden_size": 2048, "hc_streams": 4, "n_heads": 16, "kv_dim": 512, "rope_dim": 64,
              "n_experts": 16, "top_k": 2, "moe_inter": 512, "shared_inter": 512, "compress_every": 4,
              "max_len": 256, "block_size": 16, "max_batch": 32, "sinkhorn_iters": 4, "dtype": "bfloat16"}
SMOKE_ARGS = {"vocab_size": 64, "hidden_size": 32, "hc_streams": 2, "n_heads": 4, "kv_dim": 16, "rope_dim": 8,
              "n_experts": 4, "top_k": 2, "moe_inter": 16, "shared_inter": 16, "compress_every": 4, "max_len": 32,
              "block_size": 8, "max_batch": 8, "sinkhorn_iters": 4, "dtype": "float32"}


def rank_bench(ctx, model_args: dict, sizes: tuple[int, ...], steps: int, rounds: int) -> dict:
    """One rank: capture both plans, then time eager, PIECEWISE and FULL side by side per size.

    Each round times every mode in turn (eager with a quarter of the steps: it is ~8x
    slower); the row keeps every round and reports medians, so the host's drift, which
    moves the host-bound eager step by tens of percent, hits every mode alike.
    """
    import torch.distributed as dist

    from graphflow.engine import RunOptions
    from graphflow.integrations.dsv4.plans import plan_variant
    from graphflow.session import Session

    backend = "cuda" if ctx.backend == "nccl" else "cpu"
    sync = torch.cuda.synchronize if backend == "cuda" else (lambda: None)
    every = model_args["compress_every"]
    position = min(POSITION, model_args["max_len"] - every)  # the smoke model is shorter
    row: dict = {"capture_s": {}, "verify_bit_exact": {}, "eager_ms": {}, "piecewise_ms": {}, "full_ms": {},
                 "rounds": {}}
    engines, sessions = {}, {}
    try:
        for mode, path in PLANS.items():
            plan = ctx.place(plan_variant(path, world_size=ctx.world_size, sizes=sizes, **model_args))
            session = sessions[mode] = Session(plan, RunOptions(backend=backend, detectors=False), rank=ctx.rank,
                                               world_size=ctx.world_size, namespace=f"bench-{mode}")
            start = time.perf_counter()
            engines[mode] = session.capture()
            row["capture_s"][mode] = time.perf_counter() - start
            row["verify_bit_exact"][mode] = all(v.bit_exact for v in engines[mode].report.verify)
        for size in sizes:
            host = torch.tensor([position + b % every for b in range(size)], dtype=torch.int64)
            generator = torch.Generator().manual_seed(size)
            inputs = {"tokens": torch.randint(0, model_args["vocab_size"], (size,), generator=generator)
                      .to(ctx.device), "positions": host.to(ctx.device), "positions_host": host}
            views = engines["piecewise"].buffers.views(size)
            for name, value in inputs.items():
                views[name].copy_(value)
            calls = engines["piecewise"].eager_calls(size)
            timed = {"eager": (lambda: [call() for call in calls], max(3, steps // 4))}
            for mode in engines:
                runner = sessions[mode].runner
                ordered = tuple(inputs[name] for name in runner.inputs)
                timed[mode] = (lambda runner=runner, ordered=ordered: runner.run(*ordered), steps)
            samples = {mode: [] for mode in timed}
            for _ in range(rounds):
                for mode, (step, iters) in timed.items():
                    samples[mode].append(_time(step, iters, sync, dist))
            row["rounds"][size] = samples
            for mode, values in samples.items():
                row[f"{mode}_ms"][size] = statistics.median(values)
    finally:
        for session in reversed(sessions.values()):
            session.close()
    return row


def _time(step, iters: int, sync, dist, warmup: int = 3) -> float:
    for _ in range(warmup):
        step()
    sync()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) * 1e3 / iters


def _counts(available: int, model_args: dict) -> list[int]:
    return [n for n in (1, 2, 4, 8) if n <= available and model_args["n_heads"] % n == 0
            and model_args["n_experts"] % n == 0 and model_args["shared_inter"] % n == 0]


def _table(document: dict) -> str:
    lines = [f"{'GPUs':>4} {'B':>4} {'eager ms':>9} {'PIECEWISE':>10} {'FULL':>8} {'FULL x':>7}"]
    for run in document["runs"]:
        if "error" in run:
            lines.append(f"{run['gpus']:>4}  failed: {run['error'][:100]}")
            continue
        for size in document["sizes"]:
            eager, piece, full = (run[k][str(size)] for k in ("eager_ms", "piecewise_ms", "full_ms"))
            lines.append(f"{run['gpus']:>4} {size:>4} {eager:>9.3f} {piece:>10.3f} {full:>8.3f} {eager / full:>6.1f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "bench/results"), help="directory for tp_decode.json")
    parser.add_argument("--layers", type=int, default=61, help="decoder layers (default 61, the dsv4 benchmark depth)")
    parser.add_argument("--sizes", default="1,8,32", help="batch sizes (default 1,8,32)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per mode and round (default 30)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of side-by-side timing (default 3)")
    parser.add_argument("--timeout-s", type=float, default=540.0, help="per GPU count, for the whole launch")
    parser.add_argument("--smoke", action="store_true", help="CPU, gloo, 1 and 2 ranks, a tiny 2-layer model")
    args = parser.parse_args(argv)
    sizes = tuple(sorted(int(s) for s in args.sizes.split(",")))
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    model_args = {**(SMOKE_ARGS if args.smoke else MODEL_ARGS), "n_layers": 2 if args.smoke else args.layers}
    if args.smoke:
        sizes = tuple(s for s in sizes if s <= model_args["max_batch"])
    document = {"device": torch.cuda.get_device_name(0) if gpus else "cpu", "gpus": gpus, "torch": torch.__version__,
                "backend": "gloo" if args.smoke else "nccl", "env": NVLS_ENV, "model_args": model_args,
                "sizes": list(sizes), "steps": args.steps, "rounds": args.rounds, "runs": []}
    path = out / "tp_decode.json"
    if gpus < 1 and not args.smoke:
        document["skipped"] = "no GPU: tensor-parallel timing runs NCCL ranks, one per GPU"
        path.write_text(json.dumps(document, indent=2) + "\n")
        print(f"tp_decode: {document['skipped']}; recorded in {path}")
        return 0
    counts = [1, 2] if args.smoke else _counts(gpus, model_args)
    for count in counts:
        ranks = launch(rank_bench, count, document["backend"], args=(model_args, sizes, args.steps, args.rounds),
                       timeout_s=args.timeout_s)
        failed = [r for r in ranks if not r.ok]
        if failed:
            document["runs"].append({"gpus": count, "error": failed[0].error, "traceback": failed[0].traceback})
        else:
            run = {"gpus": count}
            for key in ("eager_ms", "piecewise_ms", "full_ms"):
                run[key] = {str(s): max(r.value[key][s] for r in ranks) for s in sizes}  # the slowest rank
            run["rounds_rank0"] = {str(s): ranks[0].value["rounds"][s] for s in sizes}
            run["capture_s"] = {m: max(r.value["capture_s"][m] for r in ranks) for m in PLANS}
            run["verify_bit_exact"] = all(all(r.value["verify_bit_exact"].values()) for r in ranks)
            document["runs"].append(run)
        path.write_text(json.dumps(document, indent=2) + "\n")
    print(_table(document))
    print(f"written {path}")
    return 0 if all("error" not in run for run in document["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
