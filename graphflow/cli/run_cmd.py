"""``graphflow run PLAN``: the whole capture pipeline, a phase-by-phase report, and timings.

The plan is a YAML file or, with ``--module pkg.mod:factory [--step METHOD]``, the plan
a decorated model declares (``graphflow.cli.source``). The plan is validated (errors
stop it before any capture), captured in a ``graphflow.session.Session`` with a
progress display on stderr, then reported: descriptors captured, time per phase, pool
bytes, verify results and, on a GPU, eager versus graph step time per descriptor (the
median of a few steps of each). On the CPU backend no graph exists, regions are
replayed eagerly and a speed-up would be noise, so none is shown. Exit 0 on success,
1 when the plan has errors or capture failed (rolled back; the error names phase,
descriptor, segment and what to do, with no traceback), 2 when the plan cannot be
read or the arguments are bad.

Channels: when the plan declares any, or ``--trace DIR`` or ``GRAPHFLOW_TRACE`` asks
for a trace, the session's channel runtime (rank 0 of world size 1: each collective is
the identity) listens to the pipeline and gives the model its handles. ``--trace DIR``
writes ``DIR/rank0.jsonl``, which ``graphflow trace diff`` reads.

Under torchrun (RANK and WORLD_SIZE set) each process runs as its rank of the job,
``graphflow.cli.ranks``: every rank captures and traces, rank 0 reports for all.

The module-level imports are cheap on purpose: every ``graphflow`` command builds this
parser, so torch, rich, the engine and the channels load only when ``run`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from graphflow.cli import CommandError, parse_sizes
from graphflow.cli.source import add_plan_source_arguments, plan_source, with_modes
from graphflow.dist.distributed import in_job
from graphflow.errors import CaptureError, InvalidPlanError

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
    parser.add_argument("--modes", metavar="MODE,...",
                        help="capture these modes instead of the plan's: PIECEWISE, FULL or both "
                             "(GRAPHFLOW_MODES=... does the same)")
    parser.add_argument("--no-verify", action="store_true", help="skip comparing replay with eager")
    parser.add_argument("--no-compile", action="store_true",
                        help="run the segments the plan compiles (torch.compile) uncompiled, to compare")
    parser.add_argument("--detectors", choices=("first", "all", "off"), default="first",
                        help="watch graph segments for capture hazards on the first descriptor of each mode "
                             "(default: a hazard is in the code, not in a size), on all of them, or not at all")
    parser.add_argument("--no-detectors", action="store_const", const="off", dest="detectors",
                        help="the same as --detectors off")
    parser.add_argument("--lazy", action="store_true",
                        help="be ready after the first warmup, serving eagerly, and capture the descriptors in a "
                             "background thread, each switched in once verified (one rank, no channels); "
                             "reports when all are live")
    parser.add_argument("--disable-check", action="append", default=[], metavar="NAME",
                        help="turn off one capture-safety check (repeat), e.g. host_sync")
    parser.add_argument("--steps", type=int, default=10, metavar="N",
                        help="steps timed per descriptor, eager and graph (default 10; 0 skips timing)")
    parser.add_argument("--json", action="store_true", help="write the report as JSON to stdout")
    parser.add_argument("--quiet", action="store_true", help="print only the result line")
    parser.add_argument("--trace", metavar="DIR",
                        help="write this rank's capture trace to DIR/rank0.jsonl, DIR/rank{N}.jsonl under torchrun "
                             "(for 'graphflow trace diff'; GRAPHFLOW_TRACE=DIR does the same)")
    parser.add_argument("--report", metavar="FILE",
                        help="write per-descriptor warmup/capture/verify time and pool memory to FILE: "
                             ".json for scripts, .png or .svg as bars (graphflow.view.report)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    plan = plan_source(args)
    if args.modes is not None:
        plan = with_modes(plan, args.modes, "--modes")
    elif os.environ.get("GRAPHFLOW_MODES"):
        plan = with_modes(plan, os.environ["GRAPHFLOW_MODES"], "GRAPHFLOW_MODES")
    source = args.plan or args.module
    options = _options(args)
    if in_job():  # a rank of a torchrun job: graphflow.cli.ranks
        if args.lazy:
            raise CommandError("--lazy serves one process: under torchrun every rank captures in the foreground, "
                               "so that all ranks capture the same descriptors in the same order")
        from graphflow.cli.ranks import run_ranks

        return run_ranks(args, plan, source, options)
    # torch loads only now: reading and validating a plan stays fast.
    from graphflow.view.progress import ProgressDisplay
    from graphflow.session import Session

    captures_graphs = check_backend(options)
    if args.trace is not None:
        trace_dir(args.trace)
    listeners = [] if args.quiet or args.json else [ProgressDisplay(graphs=captures_graphs)]
    report = report_listener(args.report, plan, options) if args.report else None
    if report is not None:
        listeners.append(report)
    session = Session(plan, options, listeners=listeners, trace=args.trace)
    try:
        started = time.perf_counter()
        try:
            engine = session.capture()
        except CaptureError as err:
            if args.json:
                _dump({"plan": plan.name, "file": source, "ok": False, "error": {
                    "message": err.message, "phase": err.phase, "descriptor": _str(err.descriptor),
                    "segment": err.segment, "rank": err.rank, "hint": err.hint}})
            raise
        except InvalidPlanError:
            raise
        except ValueError as err:  # sizes the plan does not have
            raise CommandError(str(err)) from err
        ready_s = None
        if options.lazy:
            ready_s = time.perf_counter() - started
            wait_lazy(engine, ready_s, say=not (args.quiet or args.json))
        captured_s = time.perf_counter() - started
        timings = time_steps(engine, args.steps)
        document = report_document(source, engine, timings, captured_s, time.perf_counter() - began)
        document["ready_s"] = ready_s
    except BaseException:
        close(session)
        if report is not None:  # also after a rolled-back capture: it shows how far it got
            write_report(report, args.report, failed=True)
        raise
    close(session)
    if report is not None:
        write_report(report, args.report)
    if session.tracer is not None:
        document["trace"] = str(session.tracer.path)
    if args.json:
        _dump(document)
    elif args.quiet:
        print(document["result"])
    else:
        print_report(document)
    return 0


def wait_lazy(engine, ready_s: float, *, say: bool) -> None:
    """Wait for a lazy engine's capture thread; the first descriptor that failed fails the
    run (the engine would go on serving it eagerly or on a larger one: a job that checks a
    plan must hear of it)."""
    background = engine.background
    if say:
        print(f"ready in {ready_s:.2f} s: serving eagerly while {len(engine.report.descriptors)} descriptors are "
              "captured in the background", file=sys.stderr)
    background.wait()
    if background.failures:
        descriptor, error = next(iter(background.failures.items()))
        others = len(background.failures) - 1
        if others:
            error.add_note(f"{others} more descriptor(s) failed in the background: "
                           + ", ".join(str(d) for d in list(background.failures)[1:]))
        raise error


def report_listener(path: str, plan, options):
    """The capture report's listener; a FILE it cannot write is a bad argument (exit 2)."""
    from graphflow.engine import make_backend
    from graphflow.view.report import CaptureReport, report_format

    try:
        report_format(path)
    except ValueError as err:
        raise CommandError(f"--report {err}") from err
    return CaptureReport(plan.name, make_backend(options.backend).name)


def write_report(report, path: str, *, failed: bool = False) -> None:
    """Write the report; a path that cannot be written is a bad argument (exit 2), said
    beside the capture's own error when the capture failed too."""
    from graphflow.view.report import write_report

    if not report.started:
        return
    try:
        write_report(report.document(), path)
    except OSError as err:
        message = f"--report {path}: cannot write: {err.strerror or err}"
        if failed:
            print(f"graphflow: {message}", file=sys.stderr)
            return
        raise CommandError(message) from err


def _options(args: argparse.Namespace):
    from graphflow.engine import RunOptions
    from graphflow.engine.options import check_named

    try:
        checks = [check_named(name) for name in args.disable_check]
    except ValueError as err:
        raise CommandError(f"--disable-check: {err}") from err
    return RunOptions(backend=args.backend, verify=not args.no_verify, detectors=args.detectors,
                      disabled_checks=checks, sizes=parse_sizes(args.sizes), lazy=args.lazy,
                      compile=not args.no_compile)


def check_backend(options) -> bool:
    """Whether the backend the options name captures real graphs (it exists, or exit 2)."""
    from graphflow.engine import make_backend

    try:
        return make_backend(options.backend).captures_graphs
    except ValueError as err:
        raise CommandError(f"--backend {options.backend.value}: {err}") from err


def trace_dir(path: str) -> None:
    """Made here, so a path that cannot hold the trace is a bad argument (exit 2), not a
    listener failing in the middle of the pipeline."""
    from pathlib import Path

    target = Path(path)
    try:
        (target.parent if target.suffix == ".jsonl" else target).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CommandError(f"--trace {path}: cannot write there: {err.strerror or err}") from err


def close(session) -> None:
    """Close the session; a teardown that failed is the job failing (exit 1)."""
    try:
        session.close()
    except Exception as err:  # noqa: BLE001 - an ExceptionGroup of every teardown step that failed
        lines = [f"teardown failed: {err}"]
        lines += [f"  {type(f).__name__}: {f}" for f in getattr(err, "exceptions", ())]
        raise CommandError("\n".join(lines), status=1) from err


def time_steps(engine, steps: int) -> dict:
    """Median seconds per step, eager and graph, for each captured descriptor."""
    import statistics

    import torch

    if steps <= 0 or not engine.programs:
        return {}
    first = next(iter(engine.buffers.tensors.values()), None)
    timer = engine.backend.timer(first.device if first is not None else None)
    timings = {}
    try:
        for descriptor, program in engine.programs.items():
            eager = _loop(engine.eager_calls(descriptor.size))
            graph = _loop(program)
            with torch.no_grad():
                for call in (eager, graph):  # one untimed run each: caches, lazy modules
                    call()
                timings[descriptor] = (statistics.median(timer(eager, steps)),
                                       statistics.median(timer(graph, steps)))
    except Exception as err:  # noqa: BLE001 - a model error while timing is reported, not a traceback
        raise CommandError(f"timing the captured steps failed: {type(err).__name__}: {err}", status=1) from err
    return timings


def _loop(calls):
    def step() -> None:
        for call in calls:
            call()

    return step


def report_document(path: str, engine, timings: dict, captured_s: float, total_s: float) -> dict:
    """The report as plain data: what ``--json`` prints and the text report draws."""
    report = engine.report
    verify = {r.descriptor: r for r in report.verify}
    real = report.captures_graphs
    descriptors = []
    for descriptor in report.descriptors:
        row = {"mode": descriptor.mode.value, "size": descriptor.size, "verify": None,
               "eager_ms": None, "graph_ms": None, "speedup": None}
        row.update({f"{t.phase.value}_s": t.seconds for t in report.times if t.descriptor == descriptor})
        if descriptor in verify:
            row["verify"] = {"bit_exact": verify[descriptor].bit_exact, "max_abs_diff": verify[descriptor].max_abs_diff,
                             "against": list(verify[descriptor].against)}
        if descriptor in timings:
            eager_s, graph_s = timings[descriptor]
            row.update(eager_ms=eager_s * 1e3, graph_ms=graph_s * 1e3)
            if real and graph_s:
                row["speedup"] = eager_s / graph_s
        descriptors.append(row)
    verified = report.verify
    exact = sum(r.bit_exact for r in verified)
    what = f"{report.graphs} graphs" if real else "no graph captured (CPU backend: regions replayed eagerly)"
    against = " and ".join(dict.fromkeys(a for r in verified for a in r.against))
    if verified and report.compile is not None:  # fusion rounds differently: the tolerance is what applies
        worst = max(r.max_abs_diff for r in verified)
        checked = (f"; verify {len(verified)}/{len(verified)} within atol={engine.plan.capture.atol:g}, "
                   f"rtol={engine.plan.capture.rtol:g} of {against} (max |diff| {worst:.3g}, {exact} bit-exact)")
    else:
        checked = f"; verify {exact}/{len(verified)} bit-exact against {against}" if verified else "; not verified"
    result = (f"ok: {engine.plan.name}: {len(report.descriptors)} descriptors, {what}, "
              f"in {total_s:.2f} s on {report.backend}" + checked)
    compiled = report.compile
    compile_doc = None if compiled is None else {
        "summary": compiled.summary(), "seconds": compiled.seconds,
        "segments": [{"segment": c.segment, "backend": c.setting.backend, "mode": c.setting.mode,
                      "dynamic": c.setting.dynamic, "compiles": c.compiles, "graphs": c.graphs,
                      "graph_breaks": list(c.graph_breaks), "recompiles": list(c.recompiles), "seconds": c.seconds,
                      "cache_hits": c.cache_hits, "cache_misses": c.cache_misses, "fallback": c.fallback,
                      "reuses": c.shares if c.reused else None} for c in compiled.segments]}
    return {
        "plan": engine.plan.name, "file": path, "ok": True, "backend": report.backend,
        "graphs_captured": real, "remapped": dict(report.remapped), "rank": report.rank,
        "graphs": report.graphs, "pool_bytes": report.pool_bytes, "buffer_bytes": report.buffer_bytes,
        "pool_estimate": report.pool_estimate,
        "capture_s": captured_s, "total_s": total_s,
        "phases": [{"phase": r.phase.value, "outcome": r.outcome.value, "seconds": r.seconds} for r in report.phases],
        "descriptors": descriptors, "compile": compile_doc, "result": result,
    }


def print_report(document: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from graphflow.view.units import format_bytes

    console = Console(highlight=False, soft_wrap=True)

    def line(text: str = "") -> None:
        console.print(text, markup=False)

    def table(*columns: str) -> Table:
        drawn = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for name in columns:
            drawn.add_column(name, justify="left" if name in ("phase", "outcome", "descriptor", "verify") else "right")
        return drawn

    real = document["graphs_captured"]
    line(f"plan {document['plan']} ({document['file']}), backend {document['backend']}")
    if not real:
        line("  no CUDA graph was captured: the CPU backend runs every phase and replays each region eagerly")
    for device, mapped in document["remapped"].items():
        line(f"  device {device} mapped to {mapped}")
    line()
    phases = table("phase", "outcome", "seconds")
    for phase in document["phases"]:
        phases.add_row(phase["phase"], phase["outcome"], f"{phase['seconds']:.3f}")
    console.print(phases)
    line()
    estimate = "".join(f", {mode} estimated at {format_bytes(size)} after its two largest"
                       for mode, size in document["pool_estimate"].items())
    line((f"graphs {document['graphs']}, pool {format_bytes(document['pool_bytes'])}{estimate}, " if real else "")
         + f"static buffers {format_bytes(document['buffer_bytes'])}")
    if document.get("trace"):
        line(f"trace {document['trace']}")
    compiled = document.get("compile")
    if compiled is not None:
        line(compiled["summary"])
        for segment in compiled["segments"]:
            if segment["reuses"] is None:
                line("  " + _compile_line(segment))
        line("  verify compares the compiled capture with the uncompiled eager step: fusion reorders "
             "floating-point work, so bit-exact is not expected; the plan's tolerance applies")
    line()
    rows = table("descriptor", "verify", "eager ms", *(("graph ms", "speed-up") if real else ("replay ms",)))
    for row in document["descriptors"]:
        verify = row["verify"]
        check = ("not verified" if verify is None else "bit-exact" if verify["bit_exact"]
                 else f"max|diff| {verify['max_abs_diff']:.2g}")
        timed = row["eager_ms"] is not None
        cells = [f"{row['mode']}(B={row['size']})", check, f"{row['eager_ms']:.3f}" if timed else "-",
                 f"{row['graph_ms']:.3f}" if timed else "-"]
        if real:
            cells.append(f"{row['speedup']:.2f}x" if row["speedup"] is not None else "-")
        rows.add_row(*cells)
    console.print(rows)
    line()
    if document.get("ready_s") is not None:
        line(f"ready {document['ready_s']:.2f} s (serving eagerly), all descriptors live after "
             f"{document['capture_s']:.2f} s")
    line(f"capture {document['capture_s']:.2f} s; total {document['total_s']:.2f} s, reading the plan and timing "
         "included")
    line(document["result"])


def _compile_line(segment: dict) -> str:
    if segment["fallback"] is not None:
        return f"{segment['segment']}: runs uncompiled ({segment['fallback']})"
    breaks = f", graph breaks: {'; '.join(segment['graph_breaks'])}" if segment["graph_breaks"] else ""
    return (f"{segment['segment']}: {segment['compiles']} compile(s), {segment['graphs']} graph(s), "
            f"{len(segment['recompiles'])} recompile(s), {segment['seconds']:.2f} s, cache "
            f"{segment['cache_hits']} hit(s)/{segment['cache_misses']} miss(es){breaks}")


def _dump(document: dict) -> None:
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _str(value) -> str | None:
    return None if value is None else str(value)
