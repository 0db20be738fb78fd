"""Binding a plan to code: import the model factory, build the model, resolve ``call`` paths.

This is the only place graphflow imports code a plan names. Resolution happens once, in
the allocate phase, so a typo in ``call`` fails before any warmup or capture, naming
the segment, the path and how far it got.

A factory's module that is not importable as it stands is looked for in the plan file's
directory, then in the current directory (``model: model:build`` beside the plan works
without ``PYTHONPATH``): those directories are appended to ``sys.path``, after every
installed package, only when the module is not found otherwise.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping

from graphflow.errors import PlanError, did_you_mean
from graphflow.plan import Plan
from graphflow.plan.factory import closest_name, search_dirs

__all__ = ["FACTORY_KEYWORDS", "build_model", "import_factory", "resolve"]

#: Keyword arguments the engine offers a model factory; each is passed only if accepted.
FACTORY_KEYWORDS = ("device", "channels", "rank", "world_size", "plan")


def import_factory(ref: str, *, plan: Plan | None = None) -> Callable[..., object]:
    """Import ``pkg.mod:attr`` (attr may be dotted); PlanError names the plan's ``model``."""
    where = _where(plan, "model", "model")
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise PlanError(f"model {ref!r} must be 'package.module:factory'", **where)
    try:
        obj = _import(module_name, search_dirs(plan))
    except ImportError as exc:
        tried = ", ".join(search_dirs(plan))
        raise PlanError(f"cannot import module {module_name!r} for model {ref!r}: {exc} (also looked in {tried}) — "
                        "put the module beside the plan or in the current directory, install its package, or add "
                        "its directory to PYTHONPATH", **where) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            meant = did_you_mean(closest_name(part, dir(obj)), "; ")
            raise PlanError(f"module {module_name!r} has no attribute {attr!r} (model {ref!r}{meant})", **where) from exc
    if not callable(obj):
        raise PlanError(f"model {ref!r} is not callable", **where)
    return obj


def _import(module_name: str, dirs: list[str]):
    """Import ``module_name``; when it (not something it imports) is missing, again with
    ``dirs`` appended to the import path."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if not (module_name == missing or module_name.startswith(missing + ".")):
            raise
        added = [d for d in dirs if d not in sys.path]
        if not added:
            raise
        sys.path.extend(added)
        importlib.invalidate_caches()
        return importlib.import_module(module_name)


def build_model(plan: Plan, offered: Mapping[str, object]) -> object:
    """Call the plan's factory with ``model_args`` and the offered keywords it accepts."""
    if plan.model is None:
        raise PlanError("the plan names no model factory: set 'model: package.module:factory' "
                        "or pass model= to the engine", **_where(plan, "model", "model"))
    factory = import_factory(plan.model, plan=plan)
    kwargs = dict(plan.model_args)
    kwargs.update({k: v for k, v in offered.items() if k in FACTORY_KEYWORDS and _accepts(factory, k)})
    return factory(**kwargs)


def resolve(model: object, path: str, *, kind: str, name: str, plan: Plan | None = None) -> Callable[..., object]:
    """The callable at ``path`` on the model; digits index ModuleLists and sequences."""
    obj = model
    walked: list[str] = []
    for part in path.split("."):
        try:
            obj = obj[int(part)] if part.isdigit() and hasattr(obj, "__getitem__") else getattr(obj, part)
        except (AttributeError, IndexError, KeyError, TypeError) as exc:
            at = ".".join(walked) or "the model"
            meant = "" if part.isdigit() else did_you_mean(closest_name(part, dir(obj)), ", ")
            raise PlanError(f"call {path!r}: {at} ({type(obj).__name__}) has no {'item' if part.isdigit() else 'attribute'} "
                            f"{part!r}{meant} — fix the call path or the model", **_where(plan, kind, name)) from exc
        walked.append(part)
    if not callable(obj):
        raise PlanError(f"call {path!r} is a {type(obj).__name__}, not a callable", **_where(plan, kind, name))
    return obj


def _accepts(factory: Callable[..., object], keyword: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    if keyword in params and params[keyword].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _where(plan: Plan | None, kind: str, name: str) -> dict:
    origin = plan.origin(kind, name) if plan is not None else None
    element = f"{kind} {name}" if kind != "model" else "model"
    if origin is None:
        return {"element": element}
    return {"file": origin.file, "line": origin.line, "element": element}
