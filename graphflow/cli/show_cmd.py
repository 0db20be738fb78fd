"""``graphflow show PLAN``: what a plan declares, as a summary, DOT or a picture.

``text`` prints rich tables on a terminal and plain text otherwise (pipes, files);
``dot`` prints Graphviz DOT; ``png`` and ``svg`` draw the step with matplotlib into
the file ``-o`` names; ``picture`` picks PNG for a picture a screen shows at full size
and SVG for a larger one, into ``-o FILE`` (the suffix added) or ``<plan name>.png|svg``.
The format defaults to the ``-o`` file's extension, else text. ``graphflow.view.render`` and
``graphflow.view.picture`` are imported when the command runs: every ``graphflow`` command
builds this parser, and ``graphflow validate`` should not pay for them.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import time
from pathlib import Path

from graphflow.cli import CommandError, write_out
from graphflow.cli.source import add_plan_source_arguments, plan_source

__all__ = ["register"]

_FORMATS = ("text", "dot", "png", "svg", "picture")
_PICTURES = ("png", "svg", "picture")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "show",
        help="summarize a plan, or write its DAG as DOT or a PNG/SVG picture",
        description="Show a capture plan: a text summary (default), Graphviz DOT, or a PNG/SVG picture "
                    "(needs matplotlib: pip install 'graphflow[draw]'). The picture draws copies of a "
                    "for_each block once; --expand or --layers draws them apart.",
    )
    add_plan_source_arguments(parser)
    parser.add_argument("--format", choices=_FORMATS,
                        help="output format (default: from -o's extension, else text); picture: PNG when it fits "
                             "a screen, else SVG")
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE (required for png and svg)")
    parser.add_argument("--expand", action="store_true",
                        help="picture: draw every copy of each for_each block (as many as the size cap allows)")
    parser.add_argument("--layers", metavar="N[-M],...",
                        help="picture: draw these copies apart (numbered as in their names, e.g. 0-3 or 30,40-42)")
    parser.add_argument("--mode", choices=("piecewise", "full"),
                        help="picture: whose regions to box and order the step by (default: PIECEWISE unless the "
                             "plan captures FULL only)")
    parser.add_argument("--serving", metavar="PKG.MOD:FACTORY",
                        help="instead of a plan: the serving plan of the continuous-batching manager this factory "
                             "returns (transformers' ContinuousBatchingManager; docs/serving.md): its graph keys "
                             "and their modes (PIECEWISE or FULL), the engine tensors they adopt and their memory, "
                             "before any capture")
    parser.add_argument("--longest", type=int, metavar="TOKENS",
                        help="with --serving: the most tokens one request holds (prompt and new tokens), which "
                             "bounds the keys")
    parser.set_defaults(func=run)


def _format(args: argparse.Namespace) -> str:
    if args.format is not None:
        return args.format
    suffix = Path(args.output).suffix.lstrip(".").lower() if args.output else ""
    return {"png": "png", "svg": "svg", "dot": "dot", "gv": "dot"}.get(suffix, "text")


def run(args: argparse.Namespace) -> int:
    if args.serving:
        return _serving(args)
    fmt = _format(args)
    if fmt in ("png", "svg") and not args.output:
        raise CommandError(f"show --format {fmt} needs -o FILE")
    if fmt in _PICTURES and importlib.util.find_spec("matplotlib") is None:
        raise CommandError(f"show --format {fmt} needs matplotlib: pip install 'graphflow[draw]'")
    if fmt not in _PICTURES and (args.expand or args.layers or args.mode):
        raise CommandError("--expand, --layers and --mode shape the picture: add --format png, svg or picture")
    layers = None
    if args.layers:
        from graphflow.view.picture import parse_layers

        try:
            layers = parse_layers(args.layers)
        except ValueError as err:
            raise CommandError(str(err)) from err
    plan = plan_source(args)
    if fmt in _PICTURES:
        return _picture(args, plan, fmt, layers)
    from graphflow.view.render import format_summary, summarize, to_dot, to_rich

    if fmt == "text" and args.output is None and sys.stdout.isatty():
        from rich.console import Console

        Console().print(to_rich(summarize(plan)))
        return 0
    return write_out(to_dot(plan) if fmt == "dot" else format_summary(summarize(plan)), args.output)


def _serving(args: argparse.Namespace) -> int:
    """The serving plan of the manager ``--serving`` builds (the factory runs: it builds
    the model and the engine's cache on its own device)."""
    if args.plan or args.module:
        raise CommandError("--serving shows the plan of a serving engine: give it instead of PLAN or --module")
    from graphflow.engine.model.binding import import_factory
    from graphflow.errors import PlanError
    from graphflow.integrations.hf.batching import serving_plan

    if args.longest is not None and args.longest < 1:
        raise CommandError(f"--longest {args.longest}: the most tokens one request holds, at least 1")
    try:
        factory = import_factory(args.serving)
    except PlanError as err:
        raise CommandError(f"--serving {args.serving}: {err.message}") from err
    manager = factory()
    if not hasattr(manager, "batch_processor"):
        raise CommandError(f"--serving {args.serving} returned {type(manager).__name__}, not a "
                           "ContinuousBatchingManager (model.init_continuous_batching(...))")
    return write_out(serving_plan(manager, longest=args.longest).render() + "\n", args.output)


def _picture(args: argparse.Namespace, plan, fmt: str, layers) -> int:
    from graphflow.view.picture import SCREEN_PIXELS, Expand, ImageFormat, draw, layout
    from graphflow.plan import Mode

    start = time.perf_counter()
    mode = Mode(args.mode.upper()) if args.mode else None
    picture = layout(plan, mode=mode, expand=Expand.ALL if args.expand else Expand.NONE, layers=layers)
    width, height = picture.pixels
    path = args.output
    if fmt == "picture":
        named = Path(path).suffix.lower().lstrip(".") if path else ""
        if named in ("png", "svg"):
            fmt = named
        else:
            fmt = "png" if width <= SCREEN_PIXELS[0] and height <= SCREEN_PIXELS[1] else "svg"
            stem = path or re.sub(r"[^\w-]+", "_", plan.name)
            path = f"{stem}.{fmt}"
    try:
        draw(picture, path, ImageFormat(fmt))
    except OSError as err:
        raise CommandError(f"{path}: cannot write: {err.strerror or err}") from err
    size = f"{width} x {height} px" if fmt == "png" else f"{width * 0.72:.0f} x {height * 0.72:.0f} pt"
    print(f"wrote {path} ({size}, {time.perf_counter() - start:.1f} s)")
    for note in picture.notes:
        print(f"  {note}")
    return 0
