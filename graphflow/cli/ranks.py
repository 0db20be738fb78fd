"""``graphflow run PLAN`` as one rank of a torchrun job: every rank captures, rank 0 reports.

``torchrun --nproc-per-node N [--nnodes M ...] -m graphflow run PLAN`` starts the ranks;
``graphflow run`` sees RANK and WORLD_SIZE in its environment and hands over to
``run_ranks``. Each rank:

1. checks the plan's ``world_size`` against the job's (every rank says the same, exit 2);
2. joins the job (``graphflow.dist.distributed.joined``): NVLink multicast off,
   ``cuda:{LOCAL_RANK}`` and its own stream on NCCL, the default process group over
   env://, whose store the phase barriers and the trace agreement use;
3. captures the plan, placed on its device, in a ``Session`` and times it as ``run``
   does (``graphflow.cli.capture_report``); ``--trace DIR`` writes ``DIR/rank{N}.jsonl``
   on the rank's own node;
4. publishes a summary of its outcome in the store. Rank 0 waits for every rank's,
   prints its own report, then one line per rank and the job's result, and says so in
   the store; the other ranks print their own error, if any, and wait for that before
   they exit. The wait is why: torchrun stops the whole job as soon as one rank exits
   non-zero, so a failed rank leaving first would cut rank 0's report off.

Exit status: rank 0's is 1 when any rank failed, so torchrun reports the job failed
whichever rank it saw first; every other rank's is its own (0, 1, or 2 for bad input).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import pathlib
import socket
import sys
import time

from graphflow.cli import CommandError, report_error
from graphflow.cli.capture_report import (backend_for, close, print_report, report_document, report_listener,
                                          time_steps, trace_dir, write_report)
from graphflow.errors import GraphflowError

__all__ = ["rank_line", "rank_summary", "run_ranks", "tell_torchrun", "world_line"]

#: One namespace per ``run_ranks`` call in a process, the same on every rank.
_calls = itertools.count()


def rank_summary(engine) -> dict:
    """What one rank captured, for its line in the job's report."""
    checked = engine.report.verify
    verify = ("bit-exact" if all(v.bit_exact for v in checked) else "within tolerance") if checked else "skipped"
    return {"ok": True, "graphs": engine.report.graphs, "descriptors": len(engine.report.descriptors),
            "verify": verify}


def rank_line(rank: int, summary: dict | None, seconds: float | None = None) -> str:
    """``rank 1: 6 graph(s), 6 descriptor(s), verify bit-exact, 4.1 s``, or how it failed."""
    if summary is None:
        return f"rank {rank}: no result"
    where = f" ({summary['host']}, {summary['device']})" if "host" in summary else ""
    if not summary.get("ok"):
        return f"rank {rank}{where}: failed, rolled back: {summary.get('error')}"
    took = f", {seconds:.1f} s" if seconds is not None else ""
    return (f"rank {rank}{where}: {summary['graphs']} graph(s), {summary['descriptors']} descriptor(s), "
            f"verify {summary['verify']}{took}")


def world_line(plan_name: str, ok: bool, ranks: int, backend: str) -> str:
    return f"{plan_name}: {'captured on' if ok else 'failed on'} {ranks} rank(s) ({backend})"


def run_ranks(args: argparse.Namespace, plan, source: str, options) -> int:
    """This process's rank of ``graphflow run`` under torchrun; the exit status. Bad input
    raises (every rank says so and exits, none joined: ``tell_torchrun``)."""
    from graphflow.dist.distributed import identity, joined

    try:
        rank, world_size = identity()
    except ValueError as err:
        raise CommandError(str(err)) from err
    if plan.world_size != world_size:
        raise CommandError(f"{source}: the plan is written for world_size {plan.world_size}, the job has "
                           f"{world_size} rank(s) — set world_size in the plan or start {plan.world_size} "
                           "(nodes × processes per node)")
    backend = backend_for(options)
    report = report_listener(args.report, plan, backend) if args.report else None  # checked on every rank
    timeout_s = plan.capture.barrier_timeout_s
    with contextlib.ExitStack() as stack:
        try:
            ctx = stack.enter_context(joined(_group_backend(options), group_timeout_s=max(60.0, timeout_s)))
        except ValueError as err:
            raise CommandError(str(err)) from err
        except RuntimeError as err:  # c10d could not reach the job's store
            raise CommandError(f"joining the job's process group failed: {err}", status=1) from err
        document, error, summary = _capture(args, ctx.place(plan), source, options, backend, ctx,
                                            report if ctx.rank == 0 else None)
        return _finish(args, plan, source, ctx, document, error, summary, timeout_s)


def _group_backend(options) -> str:
    import torch

    from graphflow.engine.backend import BackendKind

    if options.backend is BackendKind.AUTO:
        return "nccl" if torch.cuda.is_available() else "gloo"
    return "nccl" if options.backend is BackendKind.CUDA else "gloo"


def _capture(args, plan, source: str, options, backend, ctx,
             report) -> tuple[dict | None, GraphflowError | None, dict]:
    """Capture and time this rank's plan as ``run`` does; its document (rank 0's is
    printed), its error, and its summary for the job's report. ``report``: rank 0's
    capture report listener (``--report``), else None."""
    from graphflow.view.progress import ProgressDisplay
    from graphflow.session import Session

    began = time.perf_counter()
    lead = ctx.rank == 0
    progress = ProgressDisplay(json=args.json) if lead and not args.quiet else None
    listeners = [] if progress is None else [progress]
    if report is not None:
        listeners.append(report)
    document, error, summary, session = None, None, {}, None
    try:
        session = Session(plan, options, rank=ctx.rank, world_size=ctx.world_size, listeners=listeners,
                          trace=args.trace)
        started = time.perf_counter()
        engine = session.capture(backend=backend)
        captured_s = time.perf_counter() - started
        timing_began = time.perf_counter()
        timings = time_steps(engine, args.steps, time_all=args.time_all, progress=progress)
        ended = time.perf_counter()
        document = report_document(source, engine, timings, captured_s, ended - began,
                                   setup_s=started - began, timing_s=ended - timing_began)
        summary = rank_summary(engine)
    except GraphflowError as err:
        error = err
    except ValueError as err:  # sizes the plan does not have
        error = CommandError(str(err))
    if progress is not None:
        progress.close()
    try:
        if session is not None:
            close(session)
    except CommandError as err:
        error = error or err
    if report is not None:
        write_report(report, args.report, failed=error is not None)
    if error is not None:
        summary = {"ok": False, "error": str(error)}
    summary.update(rank=ctx.rank, host=socket.gethostname(), device=str(ctx.device),
                   seconds=time.perf_counter() - began,
                   trace=str(session.tracer.path) if session is not None and session.tracer is not None else None)
    return document, error, summary


def _finish(args, plan, source: str, ctx, document: dict | None, error: GraphflowError | None, summary: dict,
            timeout_s: float) -> int:
    """Publish this rank's summary; rank 0 reports the job; nobody leaves before rank 0 has."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    namespace = f"graphflow/run/{next(_calls)}"
    store.set(f"{namespace}/rank{ctx.rank}", json.dumps(summary))
    timeout = datetime.timedelta(seconds=timeout_s)
    if error is not None:
        tell_torchrun(error)
    if ctx.rank != 0:
        status = report_error(error, debug=args.debug) if error is not None else 0
        try:
            store.wait([f"{namespace}/reported"], timeout)
        except RuntimeError:  # rank 0 is gone: torchrun reports it; this rank's own status stands
            pass
        return status
    summaries = _collect(store, namespace, ctx.world_size, timeout)
    ok = all(s is not None and s["ok"] for s in summaries)
    _print_job(args, plan, source, ctx, document, summaries, ok)
    status = report_error(error, debug=args.debug) if error is not None else 0
    store.set(f"{namespace}/reported", "1")
    return status or (0 if ok else 1)


def tell_torchrun(error: GraphflowError) -> None:
    """Leave the error where torchrun's failure summary looks (its per-rank error file),
    so that summary names the failure rather than pointing at a traceback there is none of."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        message = f"{type(error).__name__}: {error}"
        with contextlib.suppress(OSError):
            pathlib.Path(path).write_text(json.dumps({"message": {"message": message, "extraInfo": {
                "py_callstack": message, "timestamp": str(int(time.time()))}}}))


def _collect(store, namespace: str, world_size: int, timeout) -> list[dict | None]:
    """Every rank's summary; None for a rank that did not publish one in time."""
    keys = [f"{namespace}/rank{r}" for r in range(world_size)]
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # some rank crashed or hangs: report the others
        pass
    return [json.loads(store.get(key)) if store.check([key]) else None for key in keys]


def _print_job(args, plan, source: str, ctx, document: dict | None, summaries: list[dict | None],
               ok: bool) -> None:

    waited = f"no result within {plan.capture.barrier_timeout_s:g} s (the rank crashed or hangs; torchrun names it)"
    lines = [rank_line(r, s, s.get("seconds")) if s is not None else f"rank {r}: {waited}"
             for r, s in enumerate(summaries)]
    last = world_line(plan.name, ok, ctx.world_size, ctx.backend)
    if args.json:
        body = dict(document) if document is not None else {"plan": plan.name, "file": source, "ok": False}
        body.update(ok=ok, world_size=ctx.world_size, group_backend=ctx.backend, ranks=summaries)
        json.dump(body, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    if args.quiet:
        print(last)
        return
    if document is not None:
        print_report(document)
        print()
    print("\n".join(lines))
    print(last)
