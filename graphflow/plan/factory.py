"""Where a plan's model factory is, found before anything runs.

``graphflow validate`` and ``graphflow run`` look for the module ``model:`` names and
read the names its source defines, importing nothing: a typo (``pkg.mod:fatcory``) is
said at once, with the plan's file, the line of ``model:`` and the name most likely
meant, where importing would cost the model's own imports (torch, seconds) and run the
user's code. The import itself stays the engine's (``graphflow.engine.model.binding``),
in the allocate phase, which looks in the same places.

What the source cannot say is not judged: a module that makes names when it runs (a
module ``__getattr__``, ``from x import *``), a compiled module, a submodule its parent
makes. Those are found, or not, by the import.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
import os
import pkgutil
import sys
import tokenize
from collections.abc import Iterable, Sequence

from graphflow.errors import PlanError, did_you_mean
from graphflow.plan.model import Plan

__all__ = ["closest_name", "find_factory", "search_dirs"]

#: What every module has, whatever its source says.
_MODULE_NAMES = frozenset({"__name__", "__doc__", "__file__", "__spec__", "__loader__", "__package__", "__path__",
                           "__builtins__", "__cached__", "__dict__"})


def search_dirs(plan: Plan | None) -> list[str]:
    """Where a factory's module is looked for after the import path: the plan file's
    directory (when it came from a file), then the current directory."""
    origin = plan.origin("plan", plan.name) if plan is not None else None
    dirs = [os.path.dirname(os.path.abspath(origin.file))] if origin is not None and os.path.isfile(origin.file) else []
    return list(dict.fromkeys([*dirs, os.getcwd()]))


def closest_name(word: str, names: Iterable[str]) -> tuple[str, ...]:
    """The name ``word`` most likely meant, by its letters (none when nothing is close)."""
    return tuple(difflib.get_close_matches(word, sorted(set(names)), n=1))


def find_factory(plan: Plan, *, search: Sequence[str] | None = None) -> None:
    """Raise ``PlanError`` at the plan's ``model:`` line when its module cannot be found,
    or its source defines no such name; ``search``: the directories after the import
    path (default: ``search_dirs``)."""
    if plan.model is None:
        return
    origin = plan.origin("model", "model")
    where = {"element": "model"} if origin is None else {"file": origin.file, "line": origin.line, "element": "model"}
    module_name, _, attr = plan.model.partition(":")
    dirs = search_dirs(plan) if search is None else list(search)
    found, siblings = _find(module_name, dirs)
    if found is None:
        parent = module_name.rpartition(".")[0]
        meant = tuple(f"{parent}.{name}" if parent else name for name in closest_name(module_name.rpartition(".")[2],
                                                                                        siblings))
        looked = f"the import path, {', '.join(dirs[:-1])} or {dirs[-1]}" if len(dirs) > 1 else \
            f"the import path or {dirs[0]}" if dirs else "the import path"
        meant_said = f" ({did_you_mean(meant, '')})" if meant else ""
        raise PlanError(f"cannot find module {module_name!r} for model {plan.model!r} in {looked}{meant_said} — put "
                        "the module beside the plan or in the current directory, install its package, or add its "
                        "directory to PYTHONPATH", **where)
    names = _names(found)
    first = attr.split(".")[0]
    if names is not None and first not in names:
        raise PlanError(f"module {module_name!r} has no attribute {first!r} (model {plan.model!r}"
                        f"{did_you_mean(closest_name(first, names), '; ')})", **where)


#: A module whose parent is no package: only importing the parent can make it (``os.path``).
_MADE_BY_PARENT = object()


def _find(name: str, dirs: list[str]) -> tuple[object | None, list[str]]:
    """The module (already imported) or the spec of ``name``, found without running any
    of it or its parents; else None with the names beside where it was looked for.
    A module whose parent is no package may be one the parent makes: it is taken as found."""
    if name in sys.modules:
        return sys.modules[name], []
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0]) or importlib.machinery.PathFinder.find_spec(parts[0], dirs)
    places: list[str] | None = None
    for index in range(1, len(parts)):
        if spec is None:
            break
        if spec.submodule_search_locations is None:
            return _MADE_BY_PARENT, []
        places = list(spec.submodule_search_locations)
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:index + 1]), places)
    if spec is not None:
        return spec, []
    return None, [module.name for module in pkgutil.iter_modules(places if places is not None else [*sys.path, *dirs])]


def _names(found) -> set[str] | None:
    """The names a module has: an imported one's own, else those its source binds at its
    top level (and, for a package, its submodules); None when the source cannot say."""
    if found is _MADE_BY_PARENT:
        return None
    if not isinstance(found, importlib.machinery.ModuleSpec):
        return None if "__getattr__" in vars(found) else set(dir(found))
    if found.origin is None or not found.origin.endswith(".py"):
        return None
    try:
        with tokenize.open(found.origin) as source:
            tree = ast.parse(source.read(), found.origin)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None  # the import says what is wrong with it
    names = _bound(tree.body)
    if names is None or "__getattr__" in names:
        return None
    names |= _MODULE_NAMES
    if found.submodule_search_locations is not None:
        names |= {module.name for module in pkgutil.iter_modules(found.submodule_search_locations)}
    return names


def _bound(body: list[ast.stmt]) -> set[str] | None:
    """The names statements bind in their scope, into branches and ``try`` blocks; None
    for ``from x import *``, whose names only running it tells."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(alias.name == "*" for alias in node.names):
                return None
            names |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        names |= {n.id for target in _targets(node) for n in ast.walk(target)
                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        inner = [*getattr(node, "body", ()), *getattr(node, "orelse", ()), *getattr(node, "finalbody", ()),
                 *(s for handler in getattr(node, "handlers", ()) for s in handler.body)]
        more = _bound(inner) if inner else set()
        if more is None:
            return None
        names |= more
    return names


def _targets(node: ast.stmt) -> list[ast.expr]:
    """What a statement assigns to (``x = ...``, ``for x in ...``, ``with ... as x``)."""
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign, ast.For, ast.AsyncFor)):
        return [node.target]
    if isinstance(node, (ast.With, ast.AsyncWith)):
        return [item.optional_vars for item in node.items if item.optional_vars is not None]
    return []
