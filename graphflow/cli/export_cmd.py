"""``graphflow export --module pkg.mod:factory``: a decorated model's plan, written as YAML.

The YAML is what ``graphflow.plan.loader.dump_plan`` writes (expanded, no ``for_each``),
so loading it back gives a plan equal to the one the decorators declare. Given a
plan file instead of ``--module``, it writes that plan expanded. Exit 2 when the
plan cannot be built or read, with the error naming the module and method.
"""

from __future__ import annotations

import argparse

from graphflow.cli import write_out
from graphflow.cli.source import add_plan_source_arguments, plan_source
from graphflow.plan.loader import dump_plan

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write the plan a decorated model declares (--module) as YAML",
        description="Write a capture plan as YAML: the plan a decorated model declares (--module "
                    "pkg.mod:factory), or a plan file expanded.",
    )
    add_plan_source_arguments(parser)
    parser.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of standard output")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    return write_out(dump_plan(plan_source(args)), args.output)
