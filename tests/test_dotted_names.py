"""Every ``graphflow.x.y`` a reader is told about exists: a module that imports, or an
attribute of its module.

A renamed function leaves its old name behind in prose, where no import fails: a plan's
comment sent users to a ``tp_plan`` that never existed. This reads the names in the
docs, the README, the plans and the docstrings and comments of the package, and the
``module:function`` factories the plans name, and resolves each. Names inside URLs, with
``{...}`` templates or ending in a file extension are not Python names; a logger's name
resolves when the package asks ``logging.getLogger`` for it; a module that needs an
optional package not installed here is skipped, and the skip says which.
"""

from __future__ import annotations

import ast
import functools
import importlib
import io
import pathlib
import re
import tokenize

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_IDENT = r"[A-Za-z_]\w*"
NAME = re.compile(rf"(?<![\w./\\-])graphflow(?:\.{_IDENT})+(?::{_IDENT}(?:\.{_IDENT})*)?")
FACTORY = re.compile(rf"""["']?(graphflow(?:\.{_IDENT})+:{_IDENT}(?:\.{_IDENT})*)["']?""")
URL = re.compile(r"\w+://\S+")
LOGGER = re.compile(r"""getLogger\(["'](graphflow[\w.]*)["']\)""")
EXTENSIONS = {"py", "md", "yaml", "yml", "json", "jsonl", "txt", "toml", "cfg", "ini", "so", "log", "csv", "svg",
              "png", "dot", "html"}


def _python_text(path: pathlib.Path) -> str:
    """The docstrings and comments of one module: the prose in it, not its code."""
    source = path.read_text()
    pieces = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                pieces.append(docstring)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            pieces.append(token.string)
    return "\n".join(pieces)


def _sources() -> list[tuple[str, str]]:
    paths = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", *sorted((ROOT / "plans").glob("*.yaml"))]
    found = [(str(path.relative_to(ROOT)), path.read_text()) for path in paths]
    found += [(str(path.relative_to(ROOT)), _python_text(path)) for path in sorted((ROOT / "graphflow").rglob("*.py"))]
    return found


def _names(text: str) -> set[str]:
    urls = [match.span() for match in URL.finditer(text)]
    names = set()
    for match in NAME.finditer(text):
        start, end = match.span()
        if any(low <= start < high for low, high in urls):
            continue
        if text[end:end + 1] == "{" or text[end:end + 2] == ".{":
            continue
        if match.group().rsplit(".", 1)[-1] in EXTENSIONS:
            continue
        names.add(match.group())
    return names


class _Optional(Exception):
    """A module this name needs imports a package that is not installed here."""


@functools.cache
def _module(name: str):
    """The module ``name``, None when there is no such module; imported once per run."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing == name or name.startswith(missing + "."):
            return None
        raise _Optional(f"{name} needs {missing}") from exc


def _resolve(name: str) -> str | None:
    """Why ``name`` does not resolve, or None when it does."""
    dotted, _, attribute = name.partition(":")
    parts = dotted.split(".")
    if attribute:
        module = _module(dotted)
        if module is None:
            return f"no module {dotted}"
        rest, owner, where = attribute.split("."), module, dotted
    else:
        depth = 1
        while depth < len(parts) and _module(".".join(parts[:depth + 1])) is not None:
            depth += 1
        owner, where, rest = _module(".".join(parts[:depth])), ".".join(parts[:depth]), parts[depth:]
    for part in rest:
        if not hasattr(owner, part) and not _field_of(owner, part):
            return f"{where} has no attribute {part!r}"
        owner, where = getattr(owner, part, None), f"{where}.{part}"
    return None


def _field_of(owner, name: str) -> bool:
    """An instance attribute a class declares (an attrs field or an annotation) counts as its attribute."""
    if not isinstance(owner, type):
        return False
    return any(name in getattr(cls, "__annotations__", {}) for cls in owner.__mro__)


def _loggers() -> set[str]:
    return {name for path in (ROOT / "graphflow").rglob("*.py") for name in LOGGER.findall(path.read_text())}


def _all_names() -> dict[str, list[str]]:
    where: dict[str, list[str]] = {}
    for file, text in _sources():
        names = _names(text)
        if file.endswith(".yaml"):
            names |= {match.group(1) for match in FACTORY.finditer(text)}
        for name in names:
            where.setdefault(name, []).append(file)
    return where


def test_every_dotted_name_resolves(capsys):
    pytest.importorskip("torch")
    where = _all_names()
    assert len(where) > 50, "the scan found almost nothing: the pattern is broken"
    stale, skipped = [], []
    for name in sorted(set(where) - _loggers()):
        try:
            problem = _resolve(name)
        except _Optional as exc:
            skipped.append(f"{name}: {exc}")
            continue
        if problem:
            stale.append(f"{name} ({problem}) in {', '.join(sorted(set(where[name])))}")
    with capsys.disabled():
        for line in skipped:
            print(f"skipped {line}")
    assert stale == [], "\n".join(stale)


def test_the_scan_skips_what_is_not_a_python_name():
    text = ("see https://x.org/graphflow.plan.nothing, graphflow/plan/fields.py, "
            "graphflow.foo.{name}, graphflow.plan.schema.json and graphflow.plan.loader:load_plan.")
    assert _names(text) == {"graphflow.plan.loader:load_plan"}
