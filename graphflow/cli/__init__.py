"""The ``graphflow`` command line.

Each subcommand lives in its own module beside this one and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to a function taking
the parsed arguments and returning the exit status. Exit statuses are the same for
every subcommand: 0 success, 1 the plan has errors or the job failed, 2 the input could
not be read (bad YAML, unknown file, bad arguments).
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main", "parse_sizes"]

#: Subcommand modules, in the order ``graphflow --help`` lists them.
_COMMANDS = ("validate", "show", "run", "launch", "export", "trace", "rules")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphflow",
        description="Declarative CUDA-graph capture: validate, show and run capture plans.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in _COMMANDS:
        importlib.import_module(f"graphflow.cli.{name}_cmd").register(subparsers)
    return parser


def parse_sizes(text: str | None) -> tuple[int, ...] | None:
    """``--sizes 1,2,4`` as a tuple, or None (every descriptor) when the option is absent.

    The ValueError carries the message to print, so ``run`` and ``launch`` word a bad
    list alike.
    """
    if text is None:
        return None
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError as err:
        raise ValueError(f"--sizes: expected comma-separated integers (got {text!r})") from err


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
