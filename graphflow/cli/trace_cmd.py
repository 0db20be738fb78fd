"""``graphflow trace diff TRACE...``: the first event where per-rank traces differ.

Each TRACE is a rank's JSON-lines file or a directory of them (``GRAPHFLOW_TRACE=DIR``
writes ``DIR/rank{N}.jsonl``). Fields that legitimately differ between ranks (rank,
timestamps, a p2p peer) are ignored. A trace whose tracer lost events (it ends with a
``trace_incomplete`` record: a full disk, a dead mount) is compared only as far as it
was written. Exit status: 0 the traces agree, 1 they differ, 2 a trace could not be
read (an error, said on stderr), or they agree as far as an incomplete trace goes and
cannot be compared after (a result, said on stdout with the others).

``graphflow trace export --format chrome TRACE... [-o FILE]``: the traces as one Chrome
trace (``graphflow.dist.chrome_trace``) for Perfetto (https://ui.perfetto.dev, "Open trace
file") or chrome://tracing: one track per rank, phases and descriptors as spans,
collectives as instants, the first divergence marked. Exit status: 0 written, 2 a trace
could not be read or the file could not be written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from graphflow.cli import CommandError

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser("trace", help="inspect per-rank capture traces",
                                   description="Inspect the per-rank traces written by GRAPHFLOW_TRACE=DIR or --trace DIR.")
    actions = parser.add_subparsers(dest="trace_command", metavar="ACTION")
    actions.required = True
    diff = actions.add_parser("diff", help="name the first event where ranks differ",
                              description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    diff.add_argument("traces", nargs="+", metavar="TRACE", help="a rank's .jsonl trace, or a directory of them")
    diff.add_argument("--context", type=int, default=3, metavar="N", help="events shown before the difference (3)")
    diff.set_defaults(func=run_diff)
    export = actions.add_parser("export", help="write the traces as a timeline for Perfetto or chrome://tracing",
                                description="Write per-rank traces as one Chrome trace (the JSON Perfetto and "
                                            "chrome://tracing open): one track per rank, phases and descriptors as "
                                            "spans, collectives as instants, the first divergence marked.")
    export.add_argument("traces", nargs="+", metavar="TRACE", help="a rank's .jsonl trace, or a directory of them")
    export.add_argument("--format", choices=("chrome",), default="chrome",
                        help="chrome: the Trace Event Format's JSON object (default)")
    export.add_argument("-o", "--output", metavar="FILE", help="write to FILE (default: standard output)")
    export.set_defaults(func=run_export)


def _files(arguments: list[str]) -> list[Path]:
    from graphflow.dist.trace import TraceReadError

    files: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        if path.is_dir():
            found = sorted(path.glob("*.jsonl"), key=lambda p: (len(p.name), p.name))
            if not found:
                raise TraceReadError(f"{path}: no .jsonl trace files in this directory")
            files.extend(found)
        else:
            files.append(path)
    return files


def _read(args: argparse.Namespace, action: str) -> tuple[list[Path], list[list[dict]]]:
    """The TRACE arguments' files and their events; a trace that cannot be read is bad
    input (exit 2)."""
    # Imported here: every ``graphflow`` command builds this parser.
    from graphflow.dist.trace import TraceReadError, read_trace

    try:
        files = _files(args.traces)
        return files, [read_trace(f) for f in files]
    except TraceReadError as e:
        raise CommandError(str(e), prog=f"graphflow trace {action}") from e


def run_diff(args: argparse.Namespace) -> int:
    from graphflow.dist.trace import comparable, describe, diff_traces, incomplete, written

    files, traces = _read(args, "diff")
    if len(traces) < 2:
        raise CommandError("give at least two traces (one per rank) or a directory of them",
                           prog="graphflow trace diff")
    labels = [_label(f, t) for f, t in zip(files, traces)]
    found = diff_traces(traces)
    lost = "; ".join(f"{label}'s trace is incomplete ({record.get('lost')} events lost: {record.get('error')})"
                     for label, record in zip(labels, map(incomplete, traces)) if record is not None)
    if found is None and lost:
        held = min(len(written(t)) for t in traces if incomplete(t) is not None)
        print(f"{lost}: the traces agree on the {held} events every trace holds; after that they cannot be compared")
        return 2
    if found is None:
        print(f"{len(traces)} traces agree: {len(traces[0])} events each ({', '.join(labels)})")
        return 0
    traces = [written(t) for t in traces]
    index = found.index
    differing = ", ".join(labels[i] for i in found.differing)
    majority = ", ".join(labels[i] for i in found.majority)
    verb = "differs" if len(found.differing) == 1 else "differ"
    print(f"traces differ at event {index}: {differing} {verb} from {majority}")
    for label, path, trace in zip(labels, files, traces):
        print(f"  {label}: {path} ({len(trace)} events)")
    if lost:
        print(f"  ({lost}: compared as far as it was written)")
    print()
    start = max(0, index - max(0, args.context))
    for i in range(start, index + 3):
        column = [t[i] if i < len(t) else None for t in traces]
        if all(e is None for e in column):
            break
        keys = {None if e is None else tuple(sorted((k, str(v)) for k, v in comparable(e).items())) for e in column}
        mark = ">" if i == index else " "
        if len(keys) == 1:
            print(f"{mark} {i:>6}  all     {describe(column[0])}")
            continue
        for label, event in zip(labels, column):
            print(f"{mark} {i:>6}  {label:<7} {describe(event)}")
            mark = " "
    return 1


def run_export(args: argparse.Namespace) -> int:
    import json

    from graphflow.dist.chrome_trace import chrome_trace

    files, traces = _read(args, "export")
    document = chrome_trace(traces, files)
    text = json.dumps(document, separators=(",", ":"), default=str)
    if args.output is None:
        sys.stdout.write(text + "\n")
        return 0
    try:
        Path(args.output).write_text(text + "\n", encoding="utf-8")
    except OSError as e:
        raise CommandError(f"{args.output}: cannot write: {e.strerror or e}", prog="graphflow trace export") from e
    events = sum(len(t) for t in traces)
    divergence = document["otherData"].get("first_divergence")
    where = ("" if divergence is None else
             f"; ranks diverge at event {divergence['event']} ({', '.join(f'rank {r}' for r in divergence['ranks'])})")
    print(f"wrote {args.output}: {len(traces)} rank(s), {events} events{where}")
    print("open it at https://ui.perfetto.dev (Open trace file) or in chrome://tracing (Load)")
    return 0


def _label(path: Path, trace: list[dict]) -> str:
    rank = trace[0].get("rank") if trace else None
    return f"rank {rank}" if isinstance(rank, int) else path.stem
