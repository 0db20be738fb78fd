"""The folder tree is the architecture: layers, imports and the map agree."""

from __future__ import annotations

import re
import subprocess
import sys

import networkx as nx
import pytest

from tests.architecture import LAYERS, PACKAGE, ROOT, graph, imports, layer, modules, upward

TOP_LEVEL = {"__init__", "__main__", "session", "runtime", "events", "errors", "units", "exports"}
FOLDERS = {"plan", "engine", "dist", "view", "cli", "integrations"}


def test_the_plan_layer_imports_no_torch():
    code = ("import sys, graphflow, graphflow.plan, graphflow.plan.loader, graphflow.plan.rules, "
            "graphflow.plan.decorators, graphflow.plan.fields, graphflow.plan.templates, graphflow.plan.schema, "
            "graphflow.plan.schedule, graphflow.units; assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_no_import_circle():
    edges = graph()
    circles = [sorted(c) for c in nx.strongly_connected_components(nx.DiGraph(
        [(a, b) for a, targets in edges.items() for b in targets])) if len(c) > 1]
    assert circles == []


def test_imports_run_from_higher_layers_to_lower_ones():
    assert upward(graph()) == []


def test_a_type_only_import_is_an_edge_too(tmp_path):
    module = tmp_path / "typed.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from graphflow.engine.context import "
                      "Context\n")
    assert imports("graphflow.engine.typed", module, {"graphflow.engine.context"}) == {"graphflow.engine.context"}


def test_every_module_is_in_a_layer():
    for name in modules():
        layer(name)  # raises for a module no layer names
    assert [name for name, _ in LAYERS][:2] == ["base", "plan"]


def test_the_top_level_holds_its_modules_and_the_layer_folders():
    files = {p.stem for p in PACKAGE.glob("*.py")}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files == TOP_LEVEL
    assert folders == FOLDERS


def _map() -> dict[str, set[str]]:
    """docs/architecture.md's table: folder -> the modules its row names."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`graphflow/"):
            rows[cells[0].strip("`").rstrip("/")] = set(re.findall(r"`(\w+)`", cells[3]))
    return rows


def test_the_map_names_every_module_of_every_folder():
    rows = _map()
    for folder in {p.parent for p in PACKAGE.rglob("*.py")}:
        key = str(folder.relative_to(ROOT))
        here = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("__")}
        assert key in rows, f"docs/architecture.md has no row for {key}/"
        assert rows[key] == here, f"{key}/: the map names {sorted(rows[key])}, the folder holds {sorted(here)}"


def test_the_readme_links_the_map_first():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[\w-]+\.md)", readme)
    assert links and links[0] == "docs/architecture.md"


def test_git_ignores_no_file_of_the_package(tmp_path):
    """A pattern meant for the checkout's root (``dist/``, what ``python -m build`` writes)
    must not hide a new module of a package folder by the same name (``graphflow/dist/``)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    folders = sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__")
    paths = [f"{folder}/new_module.py" for folder in ["graphflow", *folders]]
    done = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert done.stdout.split() == []
