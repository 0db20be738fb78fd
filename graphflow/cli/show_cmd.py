"""``graphflow show PLAN``: what a plan declares, as a summary, DOT or a picture.

``text`` prints rich tables on a terminal and plain text otherwise (pipes, files);
``dot`` prints Graphviz DOT; ``png`` and ``svg`` draw the step with matplotlib into
the file ``-o`` names. The format defaults to the ``-o`` file's extension, else text.
``graphflow.render`` is imported when the command runs: every ``graphflow`` command
builds this parser, and ``graphflow validate`` should not pay for it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from graphflow.errors import PlanError
from graphflow.cli.source import add_plan_source_arguments, plan_source

__all__ = ["register"]

_FORMATS = ("text", "dot", "png", "svg")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "show",
        help="summarize a plan, or write its DAG as DOT or a PNG/SVG picture",
        description="Show a capture plan: a text summary (default), Graphviz DOT, or a PNG/SVG picture "
                    "(needs matplotlib: pip install 'graphflow[draw]').",
    )
    add_plan_source_arguments(parser)
    parser.add_argument("--format", choices=_FORMATS, help="output format (default: from -o's extension, else text)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE (required for png and svg)")
    parser.set_defaults(func=run)


def _format(args: argparse.Namespace) -> str:
    if args.format is not None:
        return args.format
    suffix = Path(args.output).suffix.lstrip(".").lower() if args.output else ""
    return {"png": "png", "svg": "svg", "dot": "dot", "gv": "dot"}.get(suffix, "text")


def run(args: argparse.Namespace) -> int:
    fmt = _format(args)
    if fmt in ("png", "svg"):
        if not args.output:
            print(f"graphflow: show --format {fmt} needs -o FILE", file=sys.stderr)
            return 2
        if importlib.util.find_spec("matplotlib") is None:
            print(f"graphflow: show --format {fmt} needs matplotlib: pip install 'graphflow[draw]'", file=sys.stderr)
            return 2
    try:
        plan = plan_source(args)
    except PlanError as err:
        print(f"graphflow: {err}", file=sys.stderr)
        return 2
    from graphflow.render import ImageFormat, draw, format_summary, summarize, to_dot, to_rich

    if fmt == "text" and args.output is None and sys.stdout.isatty():
        from rich.console import Console

        Console().print(to_rich(summarize(plan)))
        return 0
    text = None if fmt in ("png", "svg") else to_dot(plan) if fmt == "dot" else format_summary(summarize(plan))
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        if text is None:
            draw(plan, args.output, ImageFormat(fmt))
        else:
            Path(args.output).write_text(text)
    except OSError as err:
        print(f"graphflow: {args.output}: cannot write: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0
