"""docs/own-model.md runs as written: its blocks, in order, in one folder.

A block that starts with ``# file: NAME`` is written to that file; the other Python
blocks run in one namespace, from that folder; the YAML fragment must load into the
page's plan; each shell line is a ``graphflow`` command whose exit status is 0 unless
its comment says ``exits N``.
"""

from __future__ import annotations

import pathlib
import re
import shlex
import sys

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "own-model.md"
BLOCKS = re.findall(r"```(python|yaml|sh)\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_runs_as_written(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    from graphflow import loads_plan, validate
    from graphflow.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict = {}
    plan_text = None
    for index, (language, text) in enumerate(BLOCKS):
        named = re.match(r"# file: (\S+)\n", text)
        if named:
            (tmp_path / named.group(1)).write_text(text)
            plan_text = text if language == "yaml" else plan_text
        elif language == "python":
            exec(compile(text, f"{PAGE.name} block {index}", "exec"), namespace)
        elif language == "yaml":
            assert validate(loads_plan(plan_text + text)).diagnostics == ()
        else:
            for line in filter(None, (line.strip() for line in text.splitlines())):
                command, _, comment = line.partition("#")
                expected = int(re.search(r"exits (\d)", comment).group(1)) if "exits" in comment else 0
                argv = shlex.split(command)
                assert argv[0] == "graphflow"
                assert main(argv[1:]) == expected, (line, capsys.readouterr())
    assert [language for language, _ in BLOCKS].count("python") >= 5
    sys.modules.pop("tinylm", None)
