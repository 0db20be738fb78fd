"""``graphflow run PLAN``: the whole capture pipeline, a phase-by-phase report, and timings.

The plan is a YAML file or, with ``--module pkg.mod:factory [--step METHOD]``, the plan
a decorated model declares (``graphflow.cli.source``). Before torch loads, its factory
is looked for (``graphflow.plan.factory``), it is validated (errors stop it before any
capture) and the first line says what starts; then it is captured in a
``graphflow.session.Session`` (on the backend built here, once) with a
progress display on stderr (plain lines when stderr is no terminal, JSON lines with
``--json``, a line at least every few seconds of long work, so a long run never looks
hung), then reported: descriptors captured, time per phase, pool bytes (measured, and as
forecast before capture from the largest descriptors' warmup), warmups skipped, verify
results (of a sample of the descriptors unless ``--verify all``) and, on a GPU, eager versus graph step time (the median of a few steps of each,
the eager runs only while they stay within 0.25 s, ``graphflow.runtime.time_steps``) of a sample of descriptors, the smallest, median and
largest of each mode, or of all with ``--time-all``: timing all 67 of a large plan
takes minutes. The total's time outside capture is said too: before capture (the plan,
loading torch, the backend) and timing. The report and the checks around it are ``graphflow.cli.capture_report``,
which each rank of a torchrun job shares. On the CPU backend no graph exists, regions
are replayed eagerly and a speed-up would be noise, so nothing is timed unless asked
(``--steps N`` or ``--time-all``), and a timing shown says it is no graph's. Exit 0 on success,
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
import warnings

from graphflow.cli import CommandError, flag, parse_sizes
from graphflow.cli.capture_report import (backend_for, close, print_report, report_document, report_listener,
                                          time_steps, trace_dir, write_report)
from graphflow.cli.source import add_plan_source_arguments, plan_source, with_modes
from graphflow.dist.distributed import in_job
from graphflow.errors import CaptureError, GraphflowError, InvalidPlanError
from graphflow.plan.factory import find_factory
from graphflow.plan.rules import validate

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
    parser.add_argument("--verify", choices=("sample", "all", "off"), default="sample",
                        help="compare replay with eager on a sample of each mode's descriptors (default: the first, "
                             "the last, a few between and those the detectors watch), on all of them, or not at all")
    parser.add_argument("--no-verify", action="store_const", const="off", dest="verify",
                        help="the same as --verify off")
    parser.add_argument("--no-compile", action="store_true",
                        help="run the segments the plan compiles (torch.compile) uncompiled, to compare")
    parser.add_argument("--detectors", choices=("first", "all", "off"), default="first",
                        help="watch graph segments for capture hazards on the first descriptor of each mode "
                             "(default: a hazard is in the code, not in a size), on all of them, or not at all")
    parser.add_argument("--no-detectors", action="store_const", const="off", dest="detectors",
                        help="the same as --detectors off")
    parser.add_argument("--lazy", action="store_true",
                        help="be ready after the first warmup and the largest descriptor's capture, serving every "
                             "batch on it, padded up, and capture the others in a "
                             "background thread, each switched in and checked against the eager step on its first "
                             "batch (here, once all are captured, on verify's inputs; one rank, no channels); "
                             "reports when all are live")
    parser.add_argument("--save-graphs", metavar="DIR",
                        help="after the capture, write every graph to DIR with what must match to use them again "
                             "(GPU, driver, torch, CUDA, the plan, the model): a restart with --graphs-from DIR "
                             "builds them instead of capturing")
    parser.add_argument("--graphs-from", metavar="DIR",
                        help="bring the descriptors live from graphs saved in DIR (--save-graphs) instead of capturing "
                             "them; anything that does not match is refused in one line and the run captures")
    parser.add_argument("--disable-check", action="append", default=[], metavar="NAME",
                        help="turn off one capture-safety check (repeat), e.g. host_sync")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="steps timed per descriptor, eager and graph (default 3, an eager step run again only "
                             "while its runs stay within 0.25 s; given, N of each whatever they take; 0 skips timing; "
                             "given, it times on the CPU backend too)")
    parser.add_argument("--time-all", action="store_true",
                        help="time every descriptor, not the smallest, median and largest of each mode")
    parser.add_argument("--json", action="store_true",
                        help="write the report as JSON to stdout, and progress as JSON lines to stderr")
    parser.add_argument("--quiet", action="store_true", help="print only the result line, and no progress")
    parser.add_argument("--trace", metavar="DIR",
                        help="write this rank's capture trace to DIR/rank0.jsonl, DIR/rank{N}.jsonl under torchrun "
                             "(for 'graphflow trace diff'; GRAPHFLOW_TRACE=DIR does the same)")
    parser.add_argument("--report", metavar="FILE",
                        help="write per-descriptor warmup/capture/verify time and pool memory to FILE: "
                             ".json for scripts, .png or .svg as bars (graphflow.view.report)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except GraphflowError as err:
        if in_job():  # bad input, said by every rank: torchrun's failure summary names it too
            from graphflow.cli.ranks import tell_torchrun

            tell_torchrun(err)
        raise


def _run(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    plan = plan_source(args)
    if args.modes is not None:
        plan = with_modes(plan, args.modes, "--modes")
    elif os.environ.get("GRAPHFLOW_MODES"):
        plan = with_modes(plan, os.environ["GRAPHFLOW_MODES"], "GRAPHFLOW_MODES")
    source = args.plan or args.module
    # Before torch loads (seconds, tens on a busy machine), what the plan and the arguments
    # alone can refuse is refused: a typo in model:, bad sizes or trace directory, a plan
    # with errors (the pipeline's own validation reuses this one), a plan too large for
    # this machine from its own numbers. Then the first line says what starts.
    find_factory(plan)
    sizes = parse_sizes(args.sizes)
    if args.trace is not None:
        trace_dir(args.trace)
    validation = validate(plan)
    if not validation.ok:
        raise InvalidPlanError(validation)
    if not in_job() and _on_the_host(args.backend):
        from graphflow.engine.memory import check_plan_on_the_host

        check_plan_on_the_host(plan, sizes=sizes, verify=args.verify != "off")
    if not args.quiet and os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for all
        from graphflow.view.progress import starting

        starting("run", source, plan.name, "loading torch, then building the model", json=args.json)
    setup = {"plan_s": time.perf_counter() - began}  # where the time before capture goes, for the report
    mark = time.perf_counter()
    options = _options(args, sizes)  # torch loads here (graphflow.engine)
    setup["torch_s"] = time.perf_counter() - mark
    if in_job():  # a rank of a torchrun job: graphflow.cli.ranks
        if args.lazy:
            raise CommandError("--lazy serves one process: under torchrun every rank captures in the foreground, "
                               "so that all ranks capture the same descriptors in the same order")
        from graphflow.cli.ranks import run_ranks

        return run_ranks(args, plan, source, options)
    # torch loads only now: reading and validating a plan stays fast.
    from graphflow.view.progress import ProgressDisplay
    from graphflow.session import Session
    from graphflow.engine.restart.run import SavedGraphsNotUsed

    mark = time.perf_counter()
    backend = backend_for(options)
    setup["backend_s"] = time.perf_counter() - mark
    progress = None if args.quiet else ProgressDisplay(graphs=backend.captures_graphs, json=args.json)
    listeners = [] if progress is None else [progress]
    report = report_listener(args.report, plan, backend) if args.report else None
    if report is not None:
        listeners.append(report)
    session = Session(plan, options, listeners=listeners, trace=args.trace)
    try:
        started = time.perf_counter()
        try:
            with warnings.catch_warnings():  # said once below, as the run's own line
                warnings.simplefilter("ignore", SavedGraphsNotUsed)
                engine = session.capture(backend=backend)
        except CaptureError as err:
            if args.json:
                _dump({"plan": plan.name, "file": source, "ok": False, "error": {
                    "message": err.message, "phase": err.phase, "descriptor": _str(err.descriptor),
                    "segment": err.segment, "rank": err.rank, "hint": err.hint,
                    "settings": [_setting(s) for s in err.settings]}})
            raise
        except InvalidPlanError:
            raise
        except ValueError as err:  # sizes the plan does not have
            raise CommandError(str(err)) from err
        restart = engine.report.restart
        if restart is not None and restart.refused and not args.json:
            print(f"graphflow: {restart.refused}", file=sys.stderr)
        ready_s = None
        if options.lazy:
            ready_s = time.perf_counter() - started
            wait_lazy(engine, ready_s, say=not (args.quiet or args.json))
        captured_s = time.perf_counter() - started
        timing_began = time.perf_counter()
        timings = time_steps(engine, args.steps, time_all=args.time_all, progress=progress)
        ended = time.perf_counter()
        document = report_document(source, engine, timings, captured_s, ended - began,
                                   setup_s=started - began, timing_s=ended - timing_began, **setup)
        document["ready_s"] = ready_s
    except BaseException:
        if progress is not None:
            progress.close()
        close(session)
        if report is not None:  # also after a rolled-back capture: it shows how far it got
            write_report(report, args.report, failed=True)
        raise
    if progress is not None:
        progress.close()
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
        live, total = len(engine.programs), len(engine.report.descriptors)
        print(f"ready in {ready_s:.2f} s: serving on {live} descriptor(s) while {total - live} more are captured in "
              "the background", file=sys.stderr)
    background.wait()
    background.check_unchecked()  # no batch is served here: each descriptor is checked on verify's inputs
    if background.failures:
        descriptor, error = next(iter(background.failures.items()))
        others = len(background.failures) - 1
        if others:
            error.add_note(f"{others} more descriptor(s) failed in the background: "
                           + ", ".join(str(d) for d in list(background.failures)[1:]))
        raise error


def _on_the_host(backend: str) -> bool:
    """Whether the run will use the CPU backend, known without importing torch: asked
    for, or automatic on a machine with no NVIDIA driver loaded (so no CUDA device)."""
    return backend == "cpu" or (backend == "auto" and not os.path.exists("/proc/driver/nvidia/version"))


def _options(args: argparse.Namespace, sizes: tuple[int, ...] | None):
    from graphflow.engine import RunOptions
    from graphflow.engine.options import check_named

    try:
        checks = [check_named(name) for name in args.disable_check]
    except ValueError as err:
        raise CommandError(f"--disable-check: {err}") from err
    return RunOptions(backend=args.backend, verify=args.verify, detectors=args.detectors,
                      disabled_checks=checks, sizes=sizes, lazy=args.lazy,
                      compile=not args.no_compile, save_graphs=args.save_graphs, graphs_from=args.graphs_from)


def _dump(document: dict) -> None:
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


def _str(value) -> str | None:
    return None if value is None else str(value)


def _setting(setting) -> dict:
    """A fix's setting for a script: the field, its value as JSON (``null`` where the
    user picks it; a set as a sorted list) and the flag that sets it."""
    value = setting.value
    if value is ...:
        value = None
    elif isinstance(value, (set, frozenset)):
        value = sorted(value)
    return {"field": setting.field, "value": value, "flag": flag(setting)}
