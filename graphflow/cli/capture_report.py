"""The capture report of ``graphflow run``, and what surrounds it in every process.

A lone ``graphflow run`` (``graphflow.cli.run_cmd``) and each rank of a torchrun job
(``graphflow.cli.ranks``) capture the same way: the arguments that name a backend, a
trace directory or a report file are checked before anything is built, so a bad one is
bad input (exit 2) rather than a failure halfway; after capture the steps are timed, the
report is made as plain data (what ``--json`` prints, what the text report draws) and
the session is closed, a teardown that failed being the job failing (exit 1). Here
once, so both read the same report.

The imports are cheap on purpose, as in ``run_cmd``: torch, rich, the engine and the
runtime load only when a run gets that far.
"""

from __future__ import annotations

import sys

import attrs

from graphflow.cli import CommandError, flag

__all__ = ["DEFAULT_STEPS", "EAGER_BUDGET_S", "backend_for", "close", "print_report", "report_document", "report_listener",
           "sample", "time_steps", "trace_dir", "write_report"]


def backend_for(options):
    """The backend the options name, built once for the whole run (it exists here, or exit 2)."""
    from graphflow.engine import make_backend
    from graphflow.errors import OptionError

    try:
        return make_backend(options.backend)
    except OptionError as err:
        raise CommandError(f"--backend {options.backend.value}: {err.describe(flag)}") from err


def trace_dir(path: str) -> None:
    """Made here, so a path that cannot hold the trace is a bad argument (exit 2), not a
    listener failing in the middle of the pipeline."""
    from pathlib import Path

    target = Path(path)
    try:
        (target.parent if target.suffix == ".jsonl" else target).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CommandError(f"--trace {path}: cannot write there: {err.strerror or err}") from err


def report_listener(path: str, plan, backend):
    """The capture report's listener; a FILE it cannot write is a bad argument (exit 2)."""
    from graphflow.view.report import CaptureReport, report_format

    try:
        report_format(path)
    except ValueError as err:
        raise CommandError(f"--report {err}") from err
    return CaptureReport(plan.name, backend.name)


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


def close(session) -> None:
    """Close the session; a teardown that failed is the job failing (exit 1)."""
    try:
        session.close()
    except Exception as err:  # noqa: BLE001 - an ExceptionGroup of every teardown step that failed
        lines = [f"teardown failed: {err}"]
        lines += [f"  {type(f).__name__}: {f}" for f in getattr(err, "exceptions", ())]
        raise CommandError("\n".join(lines), status=1) from err


#: Steps timed per descriptor, eager and replayed, when ``--steps`` does not say: a few
#: is enough for a median, and keeps timing a large plan to seconds.
DEFAULT_STEPS = 3

#: When ``--steps`` does not say, the eager runs of a descriptor stop once they would pass
#: this (``graphflow.runtime.time_steps``'s ``eager_budget_s``): a step this long is timed
#: once, a short one ``DEFAULT_STEPS`` times.
EAGER_BUDGET_S = 0.25


def sample(descriptors) -> list:
    """The smallest, the median and the largest size of each mode: what the speed-up of
    capturing looks like across sizes, at a few descriptors' cost instead of all of them."""
    by_mode: dict = {}
    for descriptor in descriptors:
        by_mode.setdefault(descriptor.mode, []).append(descriptor)
    chosen = []
    for group in by_mode.values():
        group.sort(key=lambda d: d.size)
        chosen += dict.fromkeys((group[0], group[len(group) // 2], group[-1]))
    return chosen


def time_steps(engine, steps: int | None, *, time_all: bool = False, progress=None) -> dict:
    """Each sampled descriptor's step (every one with ``time_all``), eager and replayed
    (``graphflow.runtime.time_steps``), each said to ``progress`` (a ``ProgressDisplay``)
    once timed. ``steps`` runs of each when given; by default ``DEFAULT_STEPS``, the eager
    ones within ``EAGER_BUDGET_S``. On a backend that captures no graph the two run the
    same calls, so nothing is timed unless asked (``--steps N`` or ``--time-all``). A
    model error while timing is the job failing (exit 1), said without a traceback."""
    from graphflow.runtime import time_steps as timed

    asked = steps is not None or time_all
    budget_s = EAGER_BUDGET_S if steps is None else None
    steps = DEFAULT_STEPS if steps is None else steps
    if steps <= 0 or not engine.programs or not (asked or engine.report.captures_graphs):
        return {}
    chosen = list(engine.programs) if time_all else sample(engine.programs)
    if progress is not None:
        progress.timing_begin(len(chosen), steps, eager_budget_s=budget_s)
    timings = {}
    try:
        for index, descriptor in enumerate(chosen, 1):
            if progress is not None:
                progress.timing(descriptor, index)
            timings.update(timed(engine, steps, only=(descriptor,), eager_budget_s=budget_s))
            if progress is not None:
                progress.timed(timings[descriptor], index)
    except Exception as err:  # noqa: BLE001 - a model error while timing is reported, not a traceback
        raise CommandError(f"timing the captured steps failed: {type(err).__name__}: {err}", status=1) from err
    finally:
        if progress is not None:
            progress.timing_end()
    return timings


def report_document(path: str, engine, timings: dict, captured_s: float, total_s: float, *,
                    setup_s: float | None = None, timing_s: float | None = None, plan_s: float | None = None,
                    torch_s: float | None = None, backend_s: float | None = None) -> dict:
    """The report as plain data: what ``--json`` prints and the text report draws.

    ``total_s`` is the command from its start to the end of timing, but the interpreter's
    own start and imports; of what is not ``captured_s``, ``setup_s`` came before capture
    and ``timing_s`` after it (``time_steps``), so a slow total says where it went. Of
    ``setup_s``, where known: ``plan_s`` reading and checking the plan, ``torch_s``
    loading torch and the engine, ``backend_s`` making the backend (on a GPU, CUDA's
    first call); the rest is the progress display and the session."""
    report = engine.report
    verify = {r.descriptor: r for r in report.verify}
    real = report.captures_graphs
    descriptors = []
    for descriptor in report.descriptors:
        row = {"mode": descriptor.mode.value, "size": descriptor.size, "verify": None,
               "eager_ms": None, "graph_ms": None, "speedup": None, "warmup_skipped": False}
        for t in report.times:
            if t.descriptor == descriptor:
                row[f"{t.phase.value}_s"] = None if t.skipped else t.seconds
                row["warmup_skipped"] |= t.skipped and t.phase.value == "warmup"
        if descriptor in verify:
            row["verify"] = {"bit_exact": verify[descriptor].bit_exact, "max_abs_diff": verify[descriptor].max_abs_diff,
                             "against": list(verify[descriptor].against)}
        if descriptor in timings:
            timed = timings[descriptor]
            row.update(eager_ms=timed.eager_s * 1e3, graph_ms=timed.replay_s * 1e3, eager_runs=timed.eager_runs,
                       graph_runs=timed.replay_runs)
            if real and timed.replay_s:
                row["speedup"] = timed.eager_s / timed.replay_s
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
    checks = engine.checks
    if verified and len(verified) < len(report.descriptors):
        checked += f" ({len(verified)} of {len(report.descriptors)} descriptors verified before ready" + (
            f", {checks.waiting} more checked on their first batch)" if checks.waiting else ")")
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
        "graphs": report.graphs if real else 0, "pool_bytes": report.pool_bytes, "buffer_bytes": report.buffer_bytes,
        "pool_estimate": report.pool_estimate,
        # Before any capture: the largest descriptors' warmup peaks (None on the CPU backend).
        "pool_forecast_bytes": report.pool_forecast, "pool_probe_bytes": report.pool_probe,
        "verified": len(verified), "warmups_skipped": report.warmups_skipped,
        # Before ready (verify), on their first batch since, still to come, found wrong there.
        "checks": {"before_ready": checks.before_ready, "on_first_use": checks.on_first_use,
                   "waiting": checks.waiting, "failed": checks.failed},
        "capture_s": captured_s, "total_s": total_s, "setup_s": setup_s, "timing_s": timing_s,
        "setup": {"plan_s": plan_s, "torch_s": torch_s, "backend_s": backend_s},
        "phases": [{"phase": r.phase.value, "outcome": r.outcome.value, "seconds": r.seconds} for r in report.phases],
        "descriptors": descriptors, "compile": compile_doc, "result": result,
        "restart": None if report.restart is None else attrs.asdict(report.restart),
    }


def restart_line(restart: dict) -> str:
    """What saving or restoring graphs did, in one line."""
    if restart["saved"] or restart["left_out"]:
        left = "".join(f"; left out {why}" for why in restart["left_out"])
        return (f"graphs of {restart['saved']} descriptors saved in {restart['directory']} "
                f"({restart['seconds']:.2f} s){left}")
    recaptured = restart.get("recaptured") or ()
    why = "".join(f"; captured {line}" for line in recaptured[:3]) + (
        f"; {len(recaptured) - 3} more captured (the JSON report lists them)" if len(recaptured) > 3 else "")
    return (f"{restart['restored']} descriptors restored from {restart['directory']}, {restart['captured']} captured "
            f"({restart['seconds']:.2f} s){why}")


def print_report(document: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from graphflow.view.progress import NO_GRAPH
    from graphflow.units import format_bytes

    console = Console(highlight=False, soft_wrap=True)

    def line(text: str = "") -> None:
        console.print(text, markup=False)

    def table(*columns: str) -> Table:
        drawn = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        for name in columns:
            drawn.add_column(name, justify="left" if name in ("phase", "outcome", "descriptor", "verify", "note")
                             else "right")
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
    forecast = document.get("pool_forecast_bytes")
    if forecast is not None:
        estimate += f", forecast at {format_bytes(forecast)} before capture"
    line((f"graphs {document['graphs']}, pool {format_bytes(document['pool_bytes'])}{estimate}, " if real else "")
         + f"static buffers {format_bytes(document['buffer_bytes'])}")
    if document.get("trace"):
        line(f"trace {document['trace']}")
    restart = document.get("restart")
    if restart is not None and not restart["refused"]:  # a refusal is said on stderr as the run goes
        line(restart_line(restart))
    compiled = document.get("compile")
    if compiled is not None:
        line(compiled["summary"])
        for segment in compiled["segments"]:
            if segment["reuses"] is None:
                line("  " + _compile_line(segment))
        line("  verify compares the compiled capture with the uncompiled eager step: fusion reorders "
             "floating-point work, so bit-exact is not expected; the plan's tolerance applies")
    line()
    # Said in each timed row, not once above the table: a row read alone (grepped, quoted
    # in an issue) must not pass replayed calls off as a graph's speed.
    caveat = not real and any(row["eager_ms"] is not None for row in document["descriptors"])
    rows = table("descriptor", "verify", "eager ms",
                 *(("graph ms", "speed-up") if real else ("replay ms", "note") if caveat else ("replay ms",)))
    waiting = document.get("checks", {}).get("waiting", 0)
    for row in document["descriptors"]:
        verify = row["verify"]
        check = (("on first batch" if waiting else "not verified") if verify is None
                 else "bit-exact" if verify["bit_exact"] else f"max|diff| {verify['max_abs_diff']:.2g}")
        timed = row["eager_ms"] is not None
        cells = [f"{row['mode']}(B={row['size']})", check, f"{row['eager_ms']:.3f}" if timed else "-",
                 f"{row['graph_ms']:.3f}" if timed else "-"]
        if real:
            cells.append(f"{row['speedup']:.2f}x" if row["speedup"] is not None else "-")
        elif caveat:
            cells.append(NO_GRAPH if timed else "")
        rows.add_row(*cells)
    if caveat:  # the caveat unwrapped, on its row, however narrow the terminal
        console.width = max(console.width, 120)
    console.print(rows)
    runs = _runs_line(document["descriptors"])
    if runs:
        line(runs)
    line()
    total = len(document["descriptors"])
    skipped = document.get("warmups_skipped", 0)
    line(f"warmed up {total - skipped} of {total} descriptors"
         + (f" ({skipped} went straight to capture: capture.warmup auto)" if skipped else "")
         + f"; verified {document.get('verified', 0)} of {total} before ready"
         + (f", the other {waiting} checked against the eager step on their first batch (--verify all: every one "
            "before ready)" if waiting else ""))
    if document.get("ready_s") is not None:
        line(f"ready {document['ready_s']:.2f} s (serving on the largest descriptor), all descriptors live after "
             f"{document['capture_s']:.2f} s")
    line(f"capture {document['capture_s']:.2f} s; total {document['total_s']:.2f} s, reading the plan and timing "
         "included" + _outside_capture(document))
    line(document["result"])


def _runs_line(rows: list[dict]) -> str:
    """How many runs each timed median is of: fewer eager runs than replays is the
    default's time budget (``EAGER_BUDGET_S``), said so that one run is not read as three."""
    eager = sorted({row["eager_runs"] for row in rows if row.get("eager_runs")})
    graph = sorted({row["graph_runs"] for row in rows if row.get("graph_runs")})
    if not eager:
        return ""
    line = f"timed: each eager time the median of {_span(eager)} run(s), each replayed one of {_span(graph)}"
    if eager[0] < graph[-1]:
        line += (f" (an eager step is run again only while its runs stay within {EAGER_BUDGET_S:g} s; "
                 "--steps N runs every step N times)")
    return line


def _span(counts: list[int]) -> str:
    return str(counts[0]) if counts[0] == counts[-1] else f"{counts[0]}-{counts[-1]}"


def _outside_capture(document: dict) -> str:
    """Where the total's time outside capture went, when the document says."""
    parts = []
    if document.get("setup_s") is not None:
        setup = document.get("setup") or {}
        known = [f"{what} {setup[key]:.2f} s" for key, what in
                 (("plan_s", "the plan"), ("torch_s", "loading torch"), ("backend_s", "the backend"))
                 if setup.get(key) is not None]
        parts.append(f"before capture {document['setup_s']:.2f} s" + (f" ({', '.join(known)})" if known else ""))
    if document.get("timing_s") is not None:
        parts.append(f"timing {document['timing_s']:.2f} s")
    return f": {', '.join(parts)}" if parts else ""


def _compile_line(segment: dict) -> str:
    if segment["fallback"] is not None:
        return f"{segment['segment']}: runs uncompiled ({segment['fallback']})"
    breaks = f", graph breaks: {'; '.join(segment['graph_breaks'])}" if segment["graph_breaks"] else ""
    return (f"{segment['segment']}: {segment['compiles']} compile(s), {segment['graphs']} graph(s), "
            f"{len(segment['recompiles'])} recompile(s), {segment['seconds']:.2f} s, cache "
            f"{segment['cache_hits']} hit(s)/{segment['cache_misses']} miss(es){breaks}")
