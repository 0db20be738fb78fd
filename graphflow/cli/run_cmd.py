"""``graphflow run PLAN``: the whole capture pipeline, a phase-by-phase report, and timings.

The plan is a YAML file or, with ``--module pkg.mod:factory [--step METHOD]``, the plan
a decorated model declares (``graphflow.decorators.plan_source``). Load, validate (stop
on errors), run allocate → warmup → prewarm → capture → verify → commit with a progress
display on stderr, then report: descriptors captured, time per phase, pool bytes,
verify results, and eager versus graph step time per descriptor (the median of a few
steps of each: the runner's step program against the eager step).
Exit 0 on success, 1 when the plan has errors or capture failed (rolled back; the
error names phase, descriptor, segment and what to do, with no traceback), 2 when the
plan cannot be read or the arguments are bad.

Channels: when the plan declares any, or ``--trace DIR`` or ``GRAPHFLOW_TRACE`` asks
for a trace, a ``ChannelRuntime`` (rank 0 of world size 1: each collective is the
identity) listens to the pipeline and gives the model its handles. ``--trace DIR``
writes ``DIR/rank0.jsonl``, which ``graphflow trace diff`` reads.

The module-level imports are cheap on purpose: every ``graphflow`` command builds this
parser, so torch, rich, the engine, the channels and ``graphflow.render`` load only
when ``run`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from graphflow.cli import parse_sizes
from graphflow.cli.source import add_plan_source_arguments, plan_source
from graphflow.errors import CaptureError, PlanError
from graphflow.validate import validate

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "run",
        help="capture a plan: allocate, warmup, prewarm, capture, verify, commit; report and time it",
        description="Run the capture pipeline on a plan and report it. Exit 0: captured; 1: plan errors or "
                    "capture failed (rolled back); 2: the plan cannot be read or bad arguments.",
    )
    add_plan_source_arguments(parser, settings=False)
    parser.add_argument("--backend", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when a GPU is present, else cpu (regions replayed eagerly)")
    parser.add_argument("--sizes", metavar="N,N,...", help="capture only these descriptor sizes, e.g. 1,2,4")
    parser.add_argument("--no-verify", action="store_true", help="skip comparing replay with eager")
    parser.add_argument("--no-detectors", action="store_true", help="do not watch segments for capture hazards")
    parser.add_argument("--disable-check", action="append", default=[], metavar="NAME",
                        help="turn off one capture-safety check (repeat), e.g. host_sync")
    parser.add_argument("--steps", type=int, default=10, metavar="N",
                        help="steps timed per descriptor, eager and graph (default 10; 0 skips timing)")
    parser.add_argument("--json", action="store_true", help="write the report as JSON to stdout")
    parser.add_argument("--quiet", action="store_true", help="print only the result line")
    parser.add_argument("--trace", metavar="DIR",
                        help="write this rank's capture trace to DIR/rank0.jsonl (for 'graphflow trace diff'; "
                             "GRAPHFLOW_TRACE=DIR does the same)")
    parser.add_argument("--report", metavar="FILE",
                        help="write per-descriptor warmup/capture/verify time and pool memory to FILE: "
                             ".json for scripts, .png or .svg as bars (graphflow.report)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_source(args)
    except PlanError as err:
        print(f"graphflow: {err}", file=sys.stderr)
        return 2
    source = args.plan or args.module
    try:
        sizes = parse_sizes(args.sizes)
    except ValueError as err:
        print(f"graphflow: {err}", file=sys.stderr)
        return 2
    report = validate(plan)
    if not report.ok:
        for diagnostic in report.diagnostics:
            print(diagnostic, file=sys.stderr)
        print(f"graphflow: {source}: {len(report.errors)} error(s): fix them before capture"
              + (f" (graphflow validate {args.plan})" if args.plan else ""), file=sys.stderr)
        return 1

    # torch loads only now: reading and validating a plan stays fast.
    from graphflow.engine import make_backend
    from graphflow.progress import ProgressDisplay

    try:
        backend = make_backend(args.backend)
    except ValueError as err:
        print(f"graphflow: --backend {args.backend}: {err}", file=sys.stderr)
        return 2
    if args.disable_check:
        from graphflow.detectors import Check

        known = {c.value for c in Check}
        unknown = [name for name in args.disable_check if name.lower() not in known]
        if unknown:
            print(f"graphflow: --disable-check: unknown check {', '.join(unknown)} "
                  f"(the checks are {', '.join(sorted(known))})", file=sys.stderr)
            return 2
    try:
        channels = _channels(plan, args.trace)
    except OSError as err:
        print(f"graphflow: --trace {args.trace}: cannot write there: {err.strerror or err}", file=sys.stderr)
        return 2
    listeners = [] if args.quiet or args.json else [ProgressDisplay()]
    if args.report:
        from graphflow.report import CaptureReport, report_format

        try:
            report_format(args.report)
        except ValueError as err:
            print(f"graphflow: --report {err}", file=sys.stderr)
            return 2
        listeners.append(CaptureReport(plan.name, backend.name))
    try:
        status, document = _capture(args, plan, source, backend, listeners, channels, sizes)
    finally:
        closed = _close(channels)
    if args.report and not _write_report(listeners[-1], args.report):
        return 2
    if document is None or not closed:
        return status or 1
    if channels is not None and channels.tracer is not None:
        document["trace"] = str(channels.tracer.path)
    if args.json:
        _dump(document)
    elif args.quiet:
        print(document["result"])
    else:
        print(_text(document))
    return 0


def _write_report(report, path: str) -> bool:
    """Write the capture report (also after a rolled-back capture: it shows how far it got)."""
    from graphflow.report import write_report

    if not report.started:
        return True
    try:
        write_report(report.document(), path)
    except OSError as err:
        print(f"graphflow: --report {path}: cannot write: {err.strerror or err}", file=sys.stderr)
        return False
    return True


def _channels(plan, trace: str | None):
    """The channel runtime for a single-rank run, or None when nothing needs one.

    The trace directory is made here, so a path that cannot hold it is a bad argument
    (exit 2), not a listener failing in the middle of the pipeline.
    """
    from graphflow.trace import TRACE_ENV, Tracer

    if trace is None and not plan.channels and not os.environ.get(TRACE_ENV):
        return None
    from graphflow.channels import ChannelRuntime

    tracer = None if trace is None else Tracer(trace, 0)
    if tracer is not None:
        tracer.path.parent.mkdir(parents=True, exist_ok=True)
    return ChannelRuntime(plan, tracer=tracer)


def _close(channels) -> bool:
    """Close the channel runtime (its trace file last); False, having said why, if that failed."""
    if channels is None:
        return True
    try:
        channels.close()
    except Exception as err:  # noqa: BLE001 - an ExceptionGroup of every teardown step that failed
        print(f"graphflow: channel teardown failed: {err}", file=sys.stderr)
        for failure in getattr(err, "exceptions", ()):
            print(f"graphflow:   {type(failure).__name__}: {failure}", file=sys.stderr)
        return False
    return True


def _capture(args, plan, source: str, backend, listeners, channels, sizes) -> tuple[int, dict | None]:
    """Run the pipeline and time it: ``(status, report document or None)``."""
    from graphflow.engine import run_pipeline
    from graphflow.runtime import Runner

    start = time.perf_counter()
    try:
        engine = run_pipeline(plan, backend=backend, listeners=listeners, channels=channels,
                              verify=not args.no_verify, detectors=not args.no_detectors,
                              disabled_checks=args.disable_check, sizes=sizes)
    except CaptureError as err:
        print(f"graphflow: capture failed, rolled back: {err}", file=sys.stderr)
        for note in getattr(err, "__notes__", ()):
            print(f"graphflow: {note}", file=sys.stderr)
        if args.json:
            _dump({"plan": plan.name, "file": source, "ok": False, "error": {
                "message": err.message, "phase": err.phase, "descriptor": _str(err.descriptor),
                "segment": err.segment, "rank": err.rank, "hint": err.hint}})
        return 1, None
    except ValueError as err:
        print(f"graphflow: {err}", file=sys.stderr)
        return 2, None
    total_s = time.perf_counter() - start
    with engine:
        try:
            timings = _time_steps(engine, Runner(engine), args.steps)
        except Exception as err:  # noqa: BLE001 - a model error while timing is reported, not a traceback
            print(f"graphflow: timing the captured steps failed: {type(err).__name__}: {err}", file=sys.stderr)
            return 1, None
        return 0, _document(source, engine, timings, total_s)


def _time_steps(engine, runner, steps: int) -> dict:
    """Median seconds per step, eager and graph, for each captured descriptor."""
    import statistics

    import torch

    if steps <= 0 or not engine.programs:
        return {}
    first = next(iter(engine.buffers.tensors.values()), None)
    timer = engine.backend.timer(first.device if first is not None else None)
    timings = {}
    for descriptor, program in engine.programs.items():
        eager = _loop(engine.eager_calls(descriptor.size))
        graph = _loop(program)
        with torch.no_grad():
            for call in (eager, graph):  # one untimed run each: caches, lazy modules
                call()
            timings[descriptor] = (statistics.median(timer(eager, steps)), statistics.median(timer(graph, steps)))
    return timings


def _loop(calls):
    def step() -> None:
        for call in calls:
            call()

    return step


def _document(path: str, engine, timings: dict, total_s: float) -> dict:
    report = engine.report
    verify = {r.descriptor: r for r in report.verify}
    descriptors = []
    for descriptor in report.descriptors:
        row = {"mode": descriptor.mode.value, "size": descriptor.size, "verify": None,
               "eager_ms": None, "graph_ms": None, "speedup": None}
        if descriptor in verify:
            row["verify"] = {"bit_exact": verify[descriptor].bit_exact, "max_abs_diff": verify[descriptor].max_abs_diff}
        if descriptor in timings:
            eager_s, graph_s = timings[descriptor]
            row.update(eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3, speedup=eager_s / graph_s if graph_s else None)
        descriptors.append(row)
    verified = [r for r in report.verify]
    exact = sum(r.bit_exact for r in verified)
    what = "graphs" if report.captures_graphs else "regions (no graph captured: CPU backend replays eagerly)"
    result = (f"ok: {engine.plan.name}: {len(report.descriptors)} descriptors, {report.graphs} {what}, "
              f"in {total_s:.2f} s on {report.backend}"
              + (f"; verify {exact}/{len(verified)} bit-exact" if verified else "; not verified"))
    return {
        "plan": engine.plan.name, "file": path, "ok": True, "backend": report.backend,
        "graphs_captured": report.captures_graphs, "remapped": dict(report.remapped), "rank": report.rank,
        "graphs": report.graphs, "pool_bytes": report.pool_bytes, "buffer_bytes": report.buffer_bytes,
        "total_s": total_s,
        "phases": [{"phase": r.phase.value, "outcome": r.outcome.value, "seconds": r.duration} for r in report.phases],
        "descriptors": descriptors, "result": result,
    }


def _text(document: dict) -> str:
    from graphflow.render import format_bytes

    lines = [f"plan {document['plan']} ({document['file']}), backend {document['backend']}"]
    if not document["graphs_captured"]:
        lines.append("  no CUDA graph was captured: the CPU backend runs every phase and replays each region eagerly")
    for device, mapped in document["remapped"].items():
        lines.append(f"  device {device} mapped to {mapped}")
    lines.append("")
    lines.append(f"{'phase':<10}{'outcome':<10}{'seconds':>10}")
    for phase in document["phases"]:
        lines.append(f"{phase['phase']:<10}{phase['outcome']:<10}{phase['seconds']:>10.3f}")
    lines.append("")
    lines.append(f"graphs {document['graphs']}, pool {format_bytes(document['pool_bytes'])}, "
                 f"static buffers {format_bytes(document['buffer_bytes'])}")
    if document.get("trace"):
        lines.append(f"trace {document['trace']}")
    lines.append("")
    lines.append(f"{'descriptor':<18}{'verify':<22}{'eager ms':>10}{'graph ms':>10}{'speed-up':>10}")
    for row in document["descriptors"]:
        name = f"{row['mode']}(B={row['size']})"
        verify = row["verify"]
        check = ("not verified" if verify is None else "bit-exact" if verify["bit_exact"]
                 else f"max|diff| {verify['max_abs_diff']:.2g}")
        timing = (f"{row['eager_ms']:>10.3f}{row['graph_ms']:>10.3f}{row['speedup']:>9.2f}x"
                  if row["eager_ms"] is not None else f"{'-':>10}{'-':>10}{'-':>10}")
        lines.append(f"{name:<18}{check:<22}{timing}")
    lines.append("")
    lines.append(document["result"])
    return "\n".join(lines)


def _dump(document: dict) -> None:
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _str(value) -> str | None:
    return None if value is None else str(value)
