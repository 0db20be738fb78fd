"""Where a subcommand's plan comes from: a YAML file, or a decorated model's declarations.

``validate`` reads files only; ``show``, ``run`` and ``export`` also take ``--module
pkg.mod:factory`` and record the plan the model's decorators declare (docs/decorators.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from graphflow.plan.decorators import plan_from_module
from graphflow.errors import PlanError
from graphflow.plan import Mode, Plan

__all__ = ["add_plan_source_arguments", "plan_source", "with_modes"]


def add_plan_source_arguments(parser: argparse.ArgumentParser, *, settings: bool = True) -> None:
    """Add ``PLAN`` (a YAML file) or ``--module pkg.mod:factory`` with its options to a subcommand.

    ``settings=False`` leaves out ``--name``, ``--sizes``, ``--modes`` and ``--world-size``
    (overrides of the ``@step``'s settings), for a subcommand with options of its own
    by those names (``run --sizes``).
    """
    parser.add_argument("plan", nargs="?", metavar="PLAN", help="plan YAML file (or use --module)")
    parser.set_defaults(plan_settings=settings)
    group = parser.add_argument_group("plan from a decorated model (instead of PLAN)")
    group.add_argument("--module", metavar="PKG.MOD:FACTORY",
                       help="build the model with this factory (on the CPU) and take the plan its decorators "
                            "declare")
    group.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="a factory argument; VALUE is read as YAML (repeat for more)")
    group.add_argument("--step", metavar="METHOD",
                       help="the @graphflow.step method to record (needed when the model has several)")
    if settings:
        group.add_argument("--name", help="plan name (default: the @graphflow.step's)")
        group.add_argument("--sizes", metavar="N,N,...", help="descriptor sizes (default: the @graphflow.step's)")
        group.add_argument("--modes", metavar="MODE,...", help="PIECEWISE, FULL or both (default: the step's)")
        group.add_argument("--world-size", type=int, metavar="N", help="ranks (default: the step's, else 1)")


def plan_source(args: argparse.Namespace) -> Plan:
    """The plan a subcommand's arguments name: ``load_plan(PLAN)`` or the ``--module``'s declarations.

    Raises ``PlanError`` for a bad file, a bad option or a misdeclared model; ``main``
    prints it and exits 2, as for any unreadable plan.
    """
    module_ref = getattr(args, "module", None)
    if (args.plan is None) == (module_ref is None):
        raise PlanError("give a plan file or --module PKG.MOD:FACTORY (exactly one)", element="arguments")
    if module_ref is None:
        from graphflow.plan.loader import load_plan

        return load_plan(args.plan)
    model_args = _model_args(args.model_arg)
    from graphflow.engine.model.binding import build_model

    skeleton = Plan(name=module_ref, model=module_ref, model_args=model_args)
    try:
        model = build_model(skeleton, {"device": "cpu"})
    except PlanError:
        raise
    except Exception as exc:
        raise PlanError(f"the factory raised {type(exc).__name__}: {exc}", element=module_ref) from exc
    settings = args if args.plan_settings else argparse.Namespace(name=None, sizes=None, modes=None,
                                                                  world_size=None)
    return plan_from_module(model, step=args.step, factory=module_ref, model_args=model_args, name=settings.name,
                            sizes=_csv(settings.sizes, int, "--sizes"), modes=_csv(settings.modes, Mode, "--modes"),
                            world_size=settings.world_size)


def _model_args(items: list[str]) -> dict[str, Any]:
    import yaml

    result: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.isidentifier():
            raise PlanError(f"expected KEY=VALUE, got {item!r}", element="--model-arg")
        try:
            result[key] = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise PlanError(f"{key}: value {text!r} is not YAML: {exc}", element="--model-arg") from exc
    return result


def _csv(text: str | None, convert: Callable[[str], Any], option: str) -> tuple | None:
    if text is None:
        return None
    try:
        return tuple(convert(part.strip()) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise PlanError(f"cannot read {text!r}: {exc}", element=option) from exc


def with_modes(plan: Plan, text: str | None, option: str) -> Plan:
    """``plan`` captured in the modes ``text`` lists (``PIECEWISE,FULL``; None: as written),
    so switching modes needs no edit of the plan (``graphflow run --modes``,
    ``GRAPHFLOW_MODES``). A mode the plan cannot capture is then a validation error, as
    if written in the file (an eager segment in a FULL step)."""
    if text is None:
        return plan
    names = [part.strip().upper() for part in text.split(",") if part.strip()]
    known = ", ".join(m.value for m in Mode)
    bad = [n for n in names if n not in {m.value for m in Mode}]
    if not names or bad:
        from graphflow.cli import CommandError

        raise CommandError(f"{option}: expected modes among {known}, comma-separated (got {text!r})")
    return plan.with_modes([Mode(n) for n in dict.fromkeys(names)])
