"""``graphflow launch --nproc N PLAN``: capture a multi-rank plan, one process per rank.

The ranks are started by torch.distributed's elastic launcher (``graphflow.dist.launch``, the
API torchrun runs), each with NVLink multicast off and, on NCCL, ``cuda:{rank}`` and its
own stream; each loads the plan, places it on its device and captures it in a
``graphflow.session.Session`` over the world group, the plan's factory getting the
rank, the world size and the channel handles. Before any rank starts, the plan's factory
is looked for and the plan validated, and the first line says what starts (the ranks
take seconds to load torch). While they capture, each rank prints its
progress on stderr, a line per descriptor (``rank 1: captured 3/8: ...``); then one line
per rank and the result (``--quiet``: the result only; ``--json``: the report as JSON).
Exit 0 when every rank committed, 1 when the plan has errors or any rank failed
(every rank rolled back), 2 when the plan cannot be read or the arguments are bad.
For several nodes, start ``graphflow run`` with torchrun instead (docs/tp.md).
"""

from __future__ import annotations

import argparse
import json
import sys

from graphflow.cli import CommandError, parse_sizes
from graphflow.cli.ranks import rank_line, rank_summary, world_line
from graphflow.errors import InvalidPlanError
from graphflow.plan.factory import find_factory
from graphflow.plan.loader import load_plan
from graphflow.plan.rules import validate

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="capture a multi-rank plan in N processes (gloo on CPUs, NCCL on one GPU each)",
        description="Run the capture pipeline of a plan on N ranks, one process each. Exit 0: every rank "
                    "captured; 1: plan errors or a rank failed (all rolled back); 2: unreadable plan or bad arguments.",
    )
    parser.add_argument("plan", metavar="PLAN", help="plan YAML file; its world_size must equal --nproc")
    parser.add_argument("--nproc", type=int, required=True, metavar="N", help="number of ranks")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="gloo: CPU processes, regions replayed eagerly; nccl: one GPU per rank, CUDA graphs")
    parser.add_argument("--sizes", metavar="N,N,...", help="capture only these descriptor sizes")
    parser.add_argument("--no-verify", action="store_true", help="skip comparing replay with eager")
    parser.add_argument("--trace", metavar="DIR", help="write one trace per rank, DIR/rank{N}.jsonl")
    parser.add_argument("--timeout-s", type=float, default=600.0, metavar="S",
                        help="kill ranks still running after S seconds (default 600)")
    parser.add_argument("--quiet", action="store_true", help="print only the result line")
    parser.add_argument("--json", action="store_true", help="write the report as JSON to stdout")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    find_factory(plan)  # a typo in model: is said now, not by every rank after it has loaded torch
    if plan.world_size != args.nproc:
        raise CommandError(f"{args.plan}: the plan is written for world_size {plan.world_size}, --nproc is "
                           f"{args.nproc} — set world_size in the plan or launch {plan.world_size} processes")
    sizes = parse_sizes(args.sizes)
    report = validate(plan)
    if not report.ok:
        raise InvalidPlanError(report)
    if not args.quiet:
        from graphflow.view.progress import starting

        starting("launch", args.plan, plan.name, f"starting {args.nproc} {args.backend} ranks, each loading torch "
                 "and building the model", json=args.json)
    from graphflow.dist.launch import launch

    try:
        ranks = launch(capture_rank, args.nproc, args.backend,
                       args=(args.plan, sizes, not args.no_verify, args.trace, not (args.quiet or args.json)),
                       timeout_s=args.timeout_s)
    except ValueError as err:
        raise CommandError(str(err)) from err
    summaries = [result.value if result.ok else {"ok": False, "error": result.error} for result in ranks]
    ok = all(s.get("ok") for s in summaries)
    if args.json:
        json.dump({"plan": plan.name, "file": args.plan, "ok": ok, "backend": args.backend, "ranks": [
            {"rank": r.rank, "elapsed_s": r.elapsed_s, **s} for r, s in zip(ranks, summaries)]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if not args.quiet:
            for result, summary in zip(ranks, summaries):
                print(rank_line(result.rank, summary, result.elapsed_s))
        print(world_line(plan.name, ok, args.nproc, args.backend))
    return 0 if ok else 1


def capture_rank(ctx, path: str, sizes, verify: bool, trace: str | None, progress: bool) -> dict:
    """One rank of ``graphflow launch``: load, place, capture, report, release.

    The ranks share the launcher's stderr: their progress is plain lines, each with the
    rank, never a live bar (several bars on one terminal overwrite each other)."""
    from graphflow.engine import RunOptions
    from graphflow.errors import CaptureError
    from graphflow.view.progress import ProgressDisplay
    from graphflow.session import Session

    plan = ctx.place(load_plan(path))
    nccl = ctx.backend == "nccl"
    options = RunOptions(backend="cuda" if nccl else "cpu", verify=verify, sizes=sizes)
    listeners = [ProgressDisplay(prefix=f"rank {ctx.rank}: ", force_terminal=False, graphs=nccl)] if progress else []
    with Session(plan, options, rank=ctx.rank, world_size=ctx.world_size, trace=trace,
                 listeners=listeners) as session:
        try:
            return rank_summary(session.capture())
        except (CaptureError, ValueError) as err:
            return {"ok": False, "error": str(err)}
