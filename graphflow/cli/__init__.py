"""The ``graphflow`` command line.

Each subcommand lives in its own module beside this one and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function taking
the parsed arguments and returning the exit status. A command that cannot go on raises
instead, and ``main`` turns the error into one message and an exit status, the same for
every subcommand: 0 success, 1 the plan has errors or the job failed, 2 the input could
not be read (bad YAML, unknown file, bad arguments). Nothing reaches the user as a
traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from graphflow import __version__
from graphflow.errors import TRACEBACK_NOTE, CaptureError, GraphflowError, InvalidPlanError, PlanError

__all__ = ["CommandError", "main", "parse_sizes"]

#: Subcommand modules, in the order ``graphflow --help`` lists them.
_COMMANDS = ("validate", "show", "run", "launch", "export", "trace", "rules")


class CommandError(GraphflowError):
    """A command cannot go on: ``main`` prints the message and exits with ``status``
    (2: bad input or arguments, the default; 1: the job failed)."""

    def __init__(self, message: str, status: int = 2):
        self.status = status
        super().__init__(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphflow",
        description="Declarative CUDA-graph capture: validate, show and run capture plans.",
    )
    parser.add_argument("--version", action="version", version=f"graphflow {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _COMMANDS:
        importlib.import_module(f"graphflow.cli.{name}_cmd").register(subparsers)
    return parser


def parse_sizes(text: str | None) -> tuple[int, ...] | None:
    """``--sizes 1,2,4`` as a tuple, or None (every descriptor) when the option is absent."""
    if text is None:
        return None
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as err:
        raise CommandError(f"--sizes: expected comma-separated integers (got {text!r})") from err


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("graphflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except GraphflowError as err:
        return report_error(err)


def report_error(err: GraphflowError) -> int:
    """Say what went wrong, once, and return the exit status it means."""
    if isinstance(err, InvalidPlanError):
        for diagnostic in err.report.diagnostics:
            print(diagnostic, file=sys.stderr)
        where = next((d.origin.file for d in err.report.errors if d.origin is not None), err.report.plan_name)
        print(f"graphflow: {where}: {len(err.report.errors)} error(s): fix them before capture "
              f"(graphflow validate {where} lists them)", file=sys.stderr)
        return 1
    if isinstance(err, CaptureError):
        print(f"graphflow: capture failed, rolled back: {err}", file=sys.stderr)
        for note in getattr(err, "__notes__", ()):
            if not note.startswith(TRACEBACK_NOTE):  # where in the code: for a debugger, not the user
                print(f"graphflow: {note}", file=sys.stderr)
        return 1
    print(f"graphflow: {err}", file=sys.stderr)
    if isinstance(err, CommandError):
        return err.status
    return 2 if isinstance(err, PlanError) else 1
