"""The package's import graph, read from the source: what tests/test_architecture.py checks."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphflow"

#: Layers from the bottom up; a module may import its own layer and those below. The
#: package's own names (``import graphflow``) are what integrations build on; the command
#: line fronts everything, integrations included.
LAYERS = (
    ("base", ("graphflow.errors", "graphflow.events", "graphflow.units", "graphflow.exports")),
    ("plan", ("graphflow.plan",)),
    ("engine", ("graphflow.engine",)),
    ("dist", ("graphflow.dist",)),
    ("view", ("graphflow.view",)),
    ("runtime", ("graphflow.runtime",)),
    ("session", ("graphflow.session",)),
    ("api", ("graphflow",)),
    ("integrations", ("graphflow.integrations",)),
    ("cli", ("graphflow.cli", "graphflow.__main__")),
)


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name: str) -> int:
    """The layer of a module: the longest prefix any layer names."""
    best, at = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
                best, at = len(prefix), index
    if at is None:
        raise ValueError(f"{name} is in no layer")
    return at


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules this one imports, at its top, inside functions or under
    ``if TYPE_CHECKING:``: an import only a type checker runs still ties the two modules,
    and a circle through it is a circle the reader must follow."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports(name, path, known) for name, path in mods.items()}


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer to a higher one."""
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer(b) > layer(a))
