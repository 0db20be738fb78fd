"""Every default the docs quote is the default the plan classes declare.

The defaults live once, on the fields of the plan classes (``graphflow.plan.fields``
and ``graphflow.plan.model``); the docs restate them in prose and tables, where nothing
fails when a default moves: ``warmup_iters`` was documented as 2 while the code, the
schema and ``show`` said 1. This reads each place the docs state one: the columns
headed "default" of ``plan-format.md`` and ``compile.md``, the ``` `key` (..., default X)```
phrases of the plan format's elements, and the phrases other pages use for a capture
setting (``` `capture.key` (default X)```, ``(`key: X`)`` under "these defaults").
"""

from __future__ import annotations

import enum
import pathlib
import re

import attrs
import pytest
import yaml

from graphflow.plan import model
from graphflow.plan.fields import yaml_fields

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PROSE = [*sorted(DOCS.glob("*.md")), ROOT / "README.md"]
REQUIRED = object()
#: Top-level keys the loader reads itself: they are no field of ``Plan``.
LOADER_KEYS = {"graphflow", "for_each"}
ELEMENTS = {"stream": model.Stream, "buffer": model.Buffer, "channel": model.Channel, "prewarm": model.Prewarm,
            "segment": model.Segment, "reference": model.Reference, "capture": model.CaptureSettings,
            "compile": model.Compile}


def _real(cls: type, attribute: attrs.Attribute):
    """The default of one field as the docs spell it: plain YAML data, REQUIRED when there is none.

    A ``compile`` field defaults to "not given", so a segment can inherit the plan's; what
    the docs state is the setting a segment runs with when nothing gives it."""
    if cls is model.Compile:
        return _plain(getattr(model.COMPILE_DEFAULTS, attribute.name))
    default = attribute.default
    if default is attrs.NOTHING:
        return REQUIRED
    if isinstance(default, attrs.Factory):
        default = default.factory()
    return _plain(default)


def _plain(value):
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _same(documented, real) -> bool:
    """Equal as YAML data; an empty list and an empty mapping are both "none" (a plan's
    ``streams`` is a mapping in YAML and a tuple in Python)."""
    if documented in ([], {}) and real in ([], {}, ()):
        return True
    return documented == real


def _literal(text: str):
    return yaml.safe_load(text.strip().strip("`"))


def _table(text: str, after: str) -> list[list[str]]:
    """The rows of the first table after ``after`` whose header has a "default" column,
    each as [key, default, the cells between them joined]."""
    lines = text[text.index(after):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|") and "| default |" in line)
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    column = header.index("default")
    table = []
    for row in lines[start + 2:]:
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        table.append([cells[0], cells[column], " ".join(cells[1:column])])
    return table


def _parenthesis(text: str, start: int) -> str:
    """The text inside the balanced parenthesis that opens at ``start``."""
    depth = 0
    for index in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[index], 0)
        if depth == 0:
            return text[start + 1:index]
    raise AssertionError(f"unbalanced parenthesis at {text[start:start + 40]!r}")


_DEFAULT = re.compile(r"(?<!`)\bdefault\b(?!`)")


def _stated(parenthesis: str) -> str | None:
    """The default a ``` `key` (...)``` states: the first literal after the word, None when it states none."""
    found = _DEFAULT.search(parenthesis)
    if found is None:
        return None
    clause = re.split(r"[;)]", parenthesis[found.end():].lstrip(": "))[0]
    quoted = re.search(r"`([^`]+)`", clause)
    return quoted.group(1) if quoted else clause.split()[0].rstrip(",:")


def _element_paragraphs() -> dict[str, str]:
    text = (DOCS / "plan-format.md").read_text()
    paragraphs = re.split(r"\n\s*\n", text)
    found = {}
    for paragraph in paragraphs:
        head = re.match(r"\*\*(\w+)\*\*", paragraph)
        if head and head.group(1) in ELEMENTS:
            found[head.group(1)] = paragraph
    return found


def _prose_defaults() -> list[tuple[str, type, attrs.Attribute, str]]:
    """(where, class, field, what the page says) for every ``` `key` (... default X ...)``` of an element."""
    stated = []
    for element, paragraph in _element_paragraphs().items():
        cls = ELEMENTS[element]
        layout = yaml_fields(cls)
        for match in re.finditer(r"`(\w+)`\s+\(", paragraph):
            key, inside = match.group(1), _parenthesis(paragraph, match.end() - 1)
            value = _stated(inside)
            if re.match(r"(?:[^;:(]*,\s*)?required\b", inside):
                value = "required"
            if value is None:
                continue
            assert key in layout, f"plan-format.md, {element}: `{key}` states a default but is no field"
            fields = layout[key].values() if isinstance(layout[key], dict) else [layout[key]]
            stated += [(f"plan-format.md, {element}.{key}", cls, attribute, value) for attribute in fields]
    return stated


def _check(where: str, cls: type, attribute: attrs.Attribute, documented: str) -> str | None:
    real = _real(cls, attribute)
    if documented == "required":
        return None if real is REQUIRED else f"{where}: documented as required, defaults to {real!r}"
    if real is REQUIRED:
        return f"{where}: documented default {documented!r}, but the field is required"
    return None if _same(_literal(documented), real) else f"{where}: documented {documented!r}, the field's is {real!r}"


def test_the_plan_format_table_states_the_fields_defaults():
    layout = yaml_fields(model.Plan)
    problems, checked = [], 0
    for key, default, kind in _table((DOCS / "plan-format.md").read_text(), "## Top level"):
        key = key.strip("`")
        if key in LOADER_KEYS or "see below" in default:
            continue
        assert key in layout, f"plan-format.md, top level: `{key}` is no field of Plan"
        documented = default or ("required" if "required" in kind else "")
        assert documented, f"plan-format.md, top level: `{key}` has neither a default nor 'required'"
        problems.append(_check(f"plan-format.md, top level {key}", model.Plan, layout[key], documented))
        checked += 1
    assert checked >= 8
    assert [p for p in problems if p] == []


def test_the_plan_format_elements_state_the_fields_defaults():
    stated = _prose_defaults()
    assert {where.split(", ")[1].split(".")[0] for where, *_ in stated} == set(ELEMENTS)
    assert len(stated) >= 25
    problems = [_check(*item) for item in stated]
    assert [p for p in problems if p] == []


def test_the_compile_table_states_the_defaults_segments_run_with():
    fields = {attribute.name: attribute for attribute in attrs.fields(model.Compile)}
    rows = [row for row in _table((DOCS / "compile.md").read_text(), "# ") if
            row[0].startswith("`")]
    assert {row[0].strip("`") for row in rows} == set(fields)
    problems = [_check(f"compile.md {key}", model.Compile, fields[key.strip("`")], default)
                for key, default, _ in rows]
    assert [p for p in problems if p] == []


def _capture_phrases() -> list[tuple[str, str, str]]:
    """(page, key, value) for each default another page states for a capture setting."""
    found = []
    for page in PROSE:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for pattern in (r"`capture\.(\w+)` \(default ([^\s,;:)]+)", r"`capture\.(\w+)` times \((\S+) unless"):
            found += [(page.name, key, value) for key, value in re.findall(pattern, text)]
        for block in re.findall(r"these defaults:\n(.*?)(?:\n\n(?![-*] )|\Z)", text, re.S):
            found += [(page.name, key, value) for key, value in re.findall(r"\(`(\w+): ([^`]+)`\)", block)]
    return found


def test_other_pages_state_the_capture_defaults():
    layout = yaml_fields(model.CaptureSettings)
    phrases = _capture_phrases()
    assert {(page, key) for page, key, _ in phrases} >= {("engine.md", "warmup_iters"),
                                                          ("channels.md", "barrier_timeout_s")}
    problems = [_check(f"{page}, capture.{key}", model.CaptureSettings, layout[key], value)
                for page, key, value in phrases]
    assert [p for p in problems if p] == []


@pytest.mark.parametrize("phrase, expected", [
    ("bool, default false: one specialization", "false"),
    ("`real`, `prepare` or `placeholder`; default `real`", "real"),
    ("int >= 1, default 2: without a warmup", "2"),
    ("`default`, `max-autotune-no-cudagraphs`", None),
    ("the name; default: the list symbol's sizes, else `[1]`; or a mapping", "[1]"),
])
def test_a_stated_default_is_read_as_written(phrase, expected):
    assert _stated(phrase) == expected
