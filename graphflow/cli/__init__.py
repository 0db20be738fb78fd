"""The ``graphflow`` command line.

Each subcommand lives in its own module beside this one and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function taking
the parsed arguments and returning the exit status. A command that cannot go on raises
instead, and ``main`` turns the error into one message and an exit status, the same for
every subcommand: 0 success, 1 the plan has errors or the job failed, 2 the input could
not be read (bad YAML, unknown file, bad arguments) or a plan names a model factory or
call that does not exist. Nothing reaches the user as a traceback: a failure in the
user's own code (a segment, a factory) ends with where in it (``(at mine.py:42)``), and
``--debug`` (or ``GRAPHFLOW_DEBUG=1``) lists those frames with their source lines, so
"where did my code fail?" needs no debugger.

Errors are exceptions, results are return values. A command raises ``CommandError``
(with its status and, for a ``trace`` action, the words its message starts with) or
lets a ``GraphflowError`` through, and ``report_error`` alone prints it, so every
command says an error the same way; it returns a status only for an outcome
it has already reported in full on standard output: ``validate`` 1 or 2 after checking
every plan given, ``launch`` and a torchrun job's rank 0 1 when a rank failed (after the
job's report), ``trace diff`` 1 when the traces differ and 2 when an incomplete trace
leaves them incomparable.

Engine errors keep what to change as data, ``RunOptions`` settings
(``graphflow.errors.OptionFix``), which their text says as ``RunOptions(sizes=...)`` for a
script; ``report_error`` says each as the flag ``graphflow run`` sets it with (``flag``),
so a hint reads right on the command line too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from graphflow import __version__
from graphflow.errors import (TRACEBACK_NOTE, CaptureError, GraphflowError, InvalidPlanError, OptionError, PlanError,
                              OptionFix, user_frames)

__all__ = ["FLAGS", "CommandError", "flag", "main", "parse_sizes", "write_out"]

#: Subcommand modules, in the order ``graphflow --help`` lists them.
_COMMANDS = ("validate", "show", "run", "launch", "export", "trace", "rules", "vllm")


#: Each ``RunOptions`` field ``graphflow run`` sets from its command line, and its flag
#: (``seed`` and ``skip_rules`` have none); ``flag`` says a value with it.
FLAGS = {
    "backend": "--backend",
    "verify": "--verify",
    "detectors": "--detectors",
    "disabled_checks": "--disable-check",
    "sizes": "--sizes",
    "lazy": "--lazy",
    "compile": "--no-compile",
    "save_graphs": "--save-graphs",
    "graphs_from": "--graphs-from",
}


#: What a flag takes where a fix leaves the value to the user.
_ANY = {"backend": "auto|cpu|cuda", "verify": "sample|all|off", "detectors": "first|all|off",
        "disabled_checks": "NAME", "sizes": "N,N,...", "save_graphs": "DIR", "graphs_from": "DIR"}


def flag(setting: OptionFix) -> str:
    """``setting`` as ``graphflow run``'s flags set it (``--sizes N,N,...`` where the value
    is the user's to pick); one no flag sets (``seed``, a default) as ``RunOptions`` says it."""
    name = FLAGS.get(setting.field)
    value = getattr(setting.value, "value", setting.value)  # an enum member as its value
    if name is None:
        return str(setting)
    if value is ...:
        return f"{name} {_ANY[setting.field]}" if setting.field in _ANY else name
    match setting.field, value:
        case "sizes", _:
            return f"{name} {','.join(str(size) for size in value)}"
        case "disabled_checks", _:
            return " ".join(f"{name} {check}" for check in sorted(getattr(c, "value", c) for c in value))
        case ("verify" | "detectors") as field, (False | "off"):
            return f"--no-{field}"
        case ("verify" | "detectors" | "backend"), str():
            return f"{name} {value}"
        case ("lazy", True) | ("compile", False):
            return name
    return str(setting)


class CommandError(GraphflowError):
    """A command cannot go on: ``main`` prints the message and exits with ``status``
    (2: bad input or arguments, the default; 1: the job failed). ``prog`` starts the
    message: ``graphflow``, or the action that speaks for itself (``graphflow trace
    diff``)."""

    def __init__(self, message: str, status: int = 2, *, prog: str = "graphflow"):
        self.status = status
        self.prog = prog
        super().__init__(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphflow",
        description="Declarative CUDA-graph capture: validate, show and run capture plans.",
    )
    parser.add_argument("--version", action="version", version=f"graphflow {__version__}")
    parser.add_argument("--debug", action="store_true", default=None,
                        help="on an error, also show the frames of your own code it came from, with their source "
                             "lines (GRAPHFLOW_DEBUG=1 does the same)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _COMMANDS:
        importlib.import_module(f"graphflow.cli.{name}_cmd").register(subparsers)
    return parser


def write_out(text: str, output: str | None) -> int:
    """A command's text to the ``-o`` file, or to standard output without one; exit status 0."""
    if output is None:
        sys.stdout.write(text)
        return 0
    try:
        Path(output).write_text(text)
    except OSError as err:
        raise CommandError(f"{output}: cannot write: {err.strerror or err}") from err
    return 0


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
        return report_error(err, debug=args.debug)


def _debugging(flag: bool | None = None) -> bool:
    """Whether errors show the user's frames: ``--debug``, else ``GRAPHFLOW_DEBUG``."""
    if flag is not None:
        return flag
    return os.environ.get("GRAPHFLOW_DEBUG", "").strip().lower() not in ("", "0", "false", "no", "off")


def report_error(err: GraphflowError, *, debug: bool | None = None) -> int:
    """Say what went wrong, once, and return the exit status it means.

    The one line ends with the innermost frame of the user's own code, the first place
    to look; ``debug`` (``None``: ``GRAPHFLOW_DEBUG`` decides) lists all of them after it.
    """
    chain = user_frames(err)
    at = f" (at {chain[0][1][-1].where()})" if chain else ""
    status = _report(err, at)
    if chain and _debugging(debug):
        print("graphflow: where in your code (most recent call last):", file=sys.stderr)
        for error, frames in chain:
            print(f"  {type(error).__name__}: {error}" if error is not err else f"  {type(error).__name__}",
                  file=sys.stderr)
            for frame in frames:
                print(f"    {frame.where()} in {frame.function}", file=sys.stderr)
                if frame.source:
                    print(f"      {frame.source}", file=sys.stderr)
    return status


def _report(err: GraphflowError, at: str) -> int:
    if isinstance(err, InvalidPlanError):
        for diagnostic in err.report.diagnostics:
            print(diagnostic, file=sys.stderr)
        where = next((d.origin.file for d in err.report.errors if d.origin is not None), err.report.plan_name)
        print(f"graphflow: {where}: {len(err.report.errors)} error(s): fix them before capture "
              f"(graphflow validate {where} lists them)", file=sys.stderr)
        return 1
    if isinstance(err, CaptureError):
        print(f"graphflow: capture failed, rolled back: {err.describe(flag)}{at}", file=sys.stderr)
        for note in getattr(err, "__notes__", ()):
            if not note.startswith(TRACEBACK_NOTE):  # where in the code: the user frames say it
                print(f"graphflow: {note}", file=sys.stderr)
        # A plan naming a factory, module or call that is not there is bad input, like a
        # plan that cannot be read: fixed in the plan, not in the model.
        return 2 if isinstance(err.__cause__, PlanError) else 1
    if isinstance(err, CommandError):
        print(f"{err.prog}: {err}{at}", file=sys.stderr)
        return err.status
    print(f"graphflow: {err.describe(flag)}{at}", file=sys.stderr)
    return 2 if isinstance(err, (PlanError, OptionError)) else 1
