"""``graphflow rules``: the validation rule table, for ``--disable`` and for reading.

Each rule's ``doc`` explains the failure it prevents; ``--json`` includes it.
"""

from __future__ import annotations

import argparse
import json
import sys

from graphflow.plan.rules import RULES

__all__ = ["register"]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "rules", help="list the validation rules (code, severity, title)",
        description="List the rules 'graphflow validate' runs; a code can be passed to 'validate --disable'.",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list with each rule's documentation")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.json:
        rows = [{"code": r.code, "severity": r.severity.value, "title": r.title, "doc": r.doc} for r in RULES]
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    width = max((len(r.code) for r in RULES), default=4)
    severity_width = max((len(r.severity.value) for r in RULES), default=8)
    for rule in RULES:
        print(f"{rule.code:<{width}}  {rule.severity.value:<{severity_width}}  {rule.title}")
    return 0
