"""``graphflow validate PLAN...``: run the rule table on plans, before any GPU work.

Exit 0 when every plan is clean (warnings allowed), 1 when any finding is an error,
2 when a plan cannot be read, or names a model factory whose module cannot be found or
whose source defines no such name (``graphflow.plan.factory``, which runs none of it),
or a ``--disable`` code is unknown. Imports no torch, so it runs in a fraction of a
second wherever the plans are. ``--device-memory 80GiB``
gives the memory of one GPU, so static buffers that would not fit are flagged (GF303)
before a model is ever loaded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from graphflow.cli import CommandError
from graphflow.errors import PlanError
from graphflow.plan.factory import find_factory
from graphflow.plan.loader import load_plan
from graphflow.units import plural
from graphflow.plan.rules import RULES, Report, unknown_codes, validate

__all__ = ["register"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AMOUNT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


def device_memory(text: str) -> int:
    """``80GiB`` (2**30 bytes each), ``80GB`` (10**9), ``85899345920`` (bytes): one GPU's memory."""
    match = _AMOUNT.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise argparse.ArgumentTypeError(f"expected bytes or an amount like 80GiB or 80GB, got {text!r}")
    amount = int(float(match.group(1)) * unit) if "." in match.group(1) else int(match.group(1)) * unit
    if amount <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive amount of memory, got {text!r}")
    return amount


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "validate",
        help="check plans for stream, allocation, dataflow and channel conflicts",
        description="Check capture plans before any GPU work. Exit 0: clean (warnings allowed); "
                    "1: errors found; 2: a plan cannot be read.",
    )
    parser.add_argument("plans", nargs="+", metavar="PLAN", help="plan YAML files")
    parser.add_argument("--json", action="store_true", help="print one JSON document: a list of per-plan reports")
    parser.add_argument(
        "--disable", action="append", default=[], metavar="CODE",
        help="skip a rule by code (repeat, or separate with commas); see 'graphflow rules'",
    )
    parser.add_argument(
        "--device-memory", type=device_memory, metavar="BYTES",
        help="the memory of one GPU (85899345920, 80GiB or 80GB): warn when a GPU's static buffers exceed it",
    )
    parser.set_defaults(func=run)


def summary_line(path: str, report: Report, plan) -> str:
    """``plans/x.yaml: 0 errors, 1 warning (183 segments, 67 descriptors)``."""
    return (f"{path}: {plural(len(report.errors), 'error')}, {plural(len(report.warnings), 'warning')} "
            f"({plural(len(plan.segments), 'segment')}, {plural(len(plan.descriptors()), 'descriptor')})")


def _read_error(path: str, err: PlanError) -> dict:
    return {
        "file": path,
        "status": "unreadable",
        "ok": False,
        "error": {"message": err.message, "file": err.file, "line": err.line, "element": err.element,
                  "text": str(err)},
    }


def _plan_report(path: str, plan, report: Report) -> dict:
    """The validator's report, with the file and the plan's size beside it."""
    return {
        "file": path,
        "status": "ok" if report.ok else "errors",
        "segments": len(plan.segments),
        "descriptors": len(plan.descriptors()),
        **report.to_json(),
    }


def run(args: argparse.Namespace) -> int:
    disable = tuple(code.strip() for value in args.disable for code in value.split(",") if code.strip())
    known = {rule.code for rule in RULES}
    unknown = [code for code in disable if code not in known]
    if unknown:
        raise CommandError(f"--disable: {unknown_codes(unknown)}")
    status = 0
    documents = []
    for path in args.plans:
        try:
            plan = load_plan(path)
            find_factory(plan)
        except PlanError as err:
            status = 2
            if args.json:
                documents.append(_read_error(path, err))
            else:
                print(f"graphflow: {err}", file=sys.stderr)
            continue
        report = validate(plan, disable=disable, device_memory=args.device_memory)
        if not report.ok:
            status = max(status, 1)
        if args.json:
            documents.append(_plan_report(path, plan, report))
        else:
            for diagnostic in report.diagnostics:
                print(diagnostic)
            print(summary_line(path, report, plan))
    if args.json:
        json.dump(documents, sys.stdout, indent=2)
        sys.stdout.write("\n")
    return status
