"""The pictures in docs/cli.md are current: made by scripts/make_pictures.py from today's plans and code."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SVG_TEXT = "{http://www.w3.org/2000/svg}text"


def _script():
    spec = importlib.util.spec_from_file_location("make_pictures", ROOT / "scripts" / "make_pictures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPT = _script()
NAMES = [name for name, _, _ in SCRIPT.PICTURES] + [SCRIPT.REPORT_PICTURE]


def _texts(path: Path) -> list[str]:
    return sorted("".join(t.itertext()) for t in ET.parse(path).getroot().iter(SVG_TEXT))


def test_the_pictures_were_made_from_the_current_plans_and_code():
    recorded = (DOCS / "pictures" / "SOURCES").read_text().strip()
    assert recorded == SCRIPT.sources_hash(), (
        "docs/pictures are out of date with the plans or the drawing code: run python scripts/make_pictures.py")


@pytest.mark.parametrize("name", NAMES)
def test_docs_show_each_picture_and_it_is_small(name):
    assert f"](pictures/{name})" in (DOCS / "cli.md").read_text()
    path = DOCS / "pictures" / name
    assert path.stat().st_size < 150_000
    assert ET.parse(path).getroot().tag == "{http://www.w3.org/2000/svg}svg"


@pytest.mark.parametrize("name,plan,options", SCRIPT.PICTURES)
def test_each_dag_picture_says_what_the_code_draws_today(tmp_path, name, plan, options):
    from graphflow.plan.loader import load_plan
    from graphflow.view.picture import Expand, ImageFormat, draw, layout

    picture = layout(load_plan(ROOT / plan), expand=Expand.ALL if options.get("expand") else Expand.NONE)
    draw(picture, str(tmp_path / name), ImageFormat.SVG)
    assert _texts(tmp_path / name) == _texts(DOCS / "pictures" / name)
