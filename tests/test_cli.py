"""The ``graphflow`` command line: validate, show and rules.

End-to-end checks run ``python -m graphflow`` in a subprocess from the checkout (exit
statuses, stderr, what gets imported); the rest call ``graphflow.cli.main`` in process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from graphflow.cli import main
from graphflow.plan.loader import load_plan
from graphflow.plan.rules import RULES, validate

ROOT = Path(__file__).resolve().parent.parent

#: The brief's example plan: 4 layers of graph pre-attention, eager attention, graph
#: post-attention with an all-reduce, then a head; 6 descriptor sizes.
CLEAN = (ROOT / "tests" / "data" / "brief_example.yaml").read_text()

#: The head has no stream (an error, line 25) and a channel nobody uses (a warning, line 16).
BROKEN = CLEAN.replace(
    "writes: [logits], stream: s0}", "writes: [logits]}"
).replace(
    "warmup: real}\n", "warmup: real}\n  spare: {kind: all_gather, group: tp, id: 2, family: target, warmup: real}\n"
)

#: Only the unused channel: a warning, which leaves the plan clean.
WARNED = CLEAN.replace(
    "warmup: real}\n", "warmup: real}\n  spare: {kind: all_gather, group: tp, id: 2, family: target, warmup: real}\n"
)

UNREADABLE = "graphflow: 1\nname: x\nbuffers: [\n"


@pytest.fixture
def plans(tmp_path, monkeypatch):
    """The plans above as files in the working directory, so output paths are short."""
    monkeypatch.chdir(tmp_path)
    for name, text in (("clean.yaml", CLEAN), ("broken.yaml", BROKEN), ("warned.yaml", WARNED),
                       ("unreadable.yaml", UNREADABLE)):
        (tmp_path / name).write_text(text)
    return tmp_path


def graphflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


class TestValidateExitStatus:
    def test_clean_plan_exits_0(self, plans, capsys):
        assert main(["validate", "clean.yaml"]) == 0
        assert capsys.readouterr().out == "clean.yaml: 0 errors, 0 warnings (13 segments, 6 descriptors)\n"

    def test_warnings_alone_exit_0(self, plans, capsys):
        assert main(["validate", "warned.yaml"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("warned.yaml:16: GF506 warning channel spare: ")
        assert out[-1] == "warned.yaml: 0 errors, 1 warning (13 segments, 6 descriptors)"

    def test_an_error_exits_1(self, plans, capsys):
        assert main(["validate", "broken.yaml"]) == 1
        out = capsys.readouterr().out.splitlines()
        assert [line.split()[1] for line in out[:-1]] == ["GF506", "GF401"]
        assert out[-1] == "broken.yaml: 1 error, 1 warning (13 segments, 6 descriptors)"

    def test_unreadable_plan_exits_2_with_one_line_on_stderr(self, plans):
        proc = graphflow("-m", "graphflow", "validate", "unreadable.yaml", cwd=plans)
        assert proc.returncode == 2
        assert proc.stdout == ""
        assert proc.stderr.count("\n") == 1
        assert proc.stderr.startswith("graphflow: unreadable.yaml:4: YAML syntax error")
        assert "Traceback" not in proc.stderr

    def test_missing_file_exits_2(self, plans):
        proc = graphflow("-m", "graphflow", "validate", "nowhere.yaml", cwd=plans)
        assert proc.returncode == 2
        assert proc.stderr == "graphflow: nowhere.yaml: cannot read plan file: No such file or directory\n"

    def test_worst_plan_decides_and_every_plan_is_reported(self, plans, capsys):
        assert main(["validate", "clean.yaml", "broken.yaml", "unreadable.yaml"]) == 2
        captured = capsys.readouterr()
        summaries = [line for line in captured.out.splitlines() if re.match(r"^\S+\.yaml: \d+ error", line)]
        assert [line.split(":")[0] for line in summaries] == ["clean.yaml", "broken.yaml"]
        assert captured.err.startswith("graphflow: unreadable.yaml:4: ")

    def test_errors_without_unreadable_plans_exit_1(self, plans):
        assert main(["validate", "clean.yaml", "broken.yaml"]) == 1


class TestValidateOutput:
    def test_diagnostic_lines_are_the_diagnostics(self, plans, capsys):
        main(["validate", "broken.yaml"])
        out = capsys.readouterr().out.splitlines()
        expected = [str(d) for d in validate(load_plan("broken.yaml")).diagnostics]
        assert out[:-1] == expected

    def test_diagnostic_line_format(self, plans, capsys):
        main(["validate", "broken.yaml"])
        line = capsys.readouterr().out.splitlines()[1]
        assert line.startswith("broken.yaml:25: GF401 error segment head: graph segment head has no stream — ")

    def test_disable_skips_a_rule(self, plans, capsys):
        assert main(["validate", "--disable", "GF401", "broken.yaml"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert [line.split()[1] for line in out[:-1]] == ["GF506"]

    def test_disable_takes_repeats_and_commas(self, plans, capsys):
        assert main(["validate", "--disable", "GF401,GF506", "broken.yaml"]) == 0
        assert main(["validate", "--disable", "GF401", "--disable", "GF506", "broken.yaml"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out == ["broken.yaml: 0 errors, 0 warnings (13 segments, 6 descriptors)"] * 2

    def test_unknown_disable_code_exits_2(self, plans, capsys):
        assert main(["validate", "--disable", "GF999", "clean.yaml"]) == 2
        assert capsys.readouterr().err == "graphflow: --disable: unknown rule code GF999 (see 'graphflow rules')\n"


    def test_a_retired_code_says_what_checks_it_now(self, plans, capsys):
        assert main(["validate", "--disable", "GF606", "clean.yaml"]) == 2
        assert capsys.readouterr().err == (
            "graphflow: --disable: GF606 is retired (bad capture settings: warmup_iters >= 1, verify tolerances "
            ">= 0 and a positive barrier_timeout_s are now checked when the plan is read or built "
            "(CaptureSettings))\n")


class TestValidateDeviceMemory:
    # The clean plan's static buffers: 32 rows x (x 2048 + 4 x (q 2048 + kv 4096 + o 2048) + logits 128000)
    STATIC = 32 * (2048 + 4 * (2048 + 4096 + 2048) + 128000)

    @pytest.mark.parametrize("amount", [str(STATIC), "0.005GiB", "0.006GB", "5 MiB", "5mib"])
    def test_buffers_within_the_memory_are_clean(self, plans, capsys, amount):
        assert main(["validate", "--device-memory", amount, "clean.yaml"]) == 0
        assert capsys.readouterr().out == "clean.yaml: 0 errors, 0 warnings (13 segments, 6 descriptors)\n"

    def test_buffers_above_it_are_a_warning_naming_the_largest(self, plans, capsys):
        assert main(["validate", "--device-memory", "4MB", "clean.yaml"]) == 0
        warning, summary = capsys.readouterr().out.splitlines()
        assert warning == (f"clean.yaml:2: GF303 warning plan: static buffers on cuda:0 take 5.0 MiB "
                           f"({self.STATIC:,} bytes), more than its 3.8 MiB (4,000,000 bytes) of memory; the "
                           "largest: logits (3.9 MiB), kv{0..3} (512.0 KiB in 4 buffers), q{0..3} (256.0 KiB in 4 "
                           "buffers) — lower the largest sizes or capacities, or spread the buffers over more GPUs")
        assert summary == "clean.yaml: 0 errors, 1 warning (13 segments, 6 descriptors)"

    def test_buffers_no_gpu_holds_are_an_error_without_any_figure(self, plans, capsys):
        (plans / "huge.yaml").write_text(CLEAN.replace("symbols: {B: [1, 2, 4, 8, 16, 32]}",
                                                       "symbols: {B: [1, 2, 4, 8, 16, 32, 1000000000]}"))
        assert main(["validate", "huge.yaml"]) == 1
        error = capsys.readouterr().out.splitlines()[0]
        assert error.startswith("huge.yaml:2: GF304 error plan: static buffers on cuda:0 take 148.1 TiB ")
        assert "more than any GPU holds (over 1.0 TiB); the largest: logits (116.4 TiB), kv{0..3} " in error

    @pytest.mark.parametrize("amount", ["80XB", "GiB", "-1GiB", "0"])
    def test_a_bad_amount_exits_2_without_a_traceback(self, plans, amount):
        proc = graphflow("-m", "graphflow", "validate", "--device-memory", amount, "clean.yaml", cwd=plans)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr
        assert "argument --device-memory: expected " in proc.stderr


class TestValidateJson:
    def test_one_document_listing_every_plan(self, plans, capsys):
        assert main(["validate", "--json", "clean.yaml", "broken.yaml", "unreadable.yaml", "nowhere.yaml"]) == 2
        captured = capsys.readouterr()
        assert captured.err == ""
        documents = json.loads(captured.out)
        assert [(d["file"], d["status"], d["ok"]) for d in documents] == [
            ("clean.yaml", "ok", True),
            ("broken.yaml", "errors", False),
            ("unreadable.yaml", "unreadable", False),
            ("nowhere.yaml", "unreadable", False),
        ]

    def test_plan_report_fields(self, plans, capsys):
        main(["validate", "--json", "broken.yaml"])
        (document,) = json.loads(capsys.readouterr().out)
        assert (document["plan"], document["segments"], document["descriptors"]) == ("dsv4-mini-decode", 13, 6)
        assert (document["errors"], document["warnings"]) == (1, 1)
        head = next(d for d in document["diagnostics"] if d["code"] == "GF401")
        assert head["severity"] == "error"
        assert head["element"] == "segment head"
        assert (head["file"], head["line"]) == ("broken.yaml", 25)
        assert head["fix"]

    def test_read_error_fields(self, plans, capsys):
        main(["validate", "--json", "unreadable.yaml"])
        (document,) = json.loads(capsys.readouterr().out)
        error = document["error"]
        assert (error["file"], error["line"]) == ("unreadable.yaml", 4)
        assert error["text"].startswith("unreadable.yaml:4: YAML syntax error")

    def test_disable_applies(self, plans, capsys):
        main(["validate", "--json", "--disable", "GF506", "broken.yaml"])
        (document,) = json.loads(capsys.readouterr().out)
        assert [d["code"] for d in document["diagnostics"]] == ["GF401"]


class TestValidateImports:
    def test_validate_imports_neither_torch_nor_matplotlib(self, plans):
        proc = graphflow("-X", "importtime", "-m", "graphflow", "validate", "clean.yaml", cwd=plans)
        assert proc.returncode == 0, proc.stderr
        modules = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                   if line.startswith("import time:")}
        assert "graphflow.plan.rules" in modules  # the probe sees graphflow's own imports
        heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "matplotlib"))
        assert heavy == []


class TestShowText:
    def test_summary_numbers(self, plans, capsys):
        assert main(["show", "clean.yaml"]) == 0
        out = capsys.readouterr().out
        assert "plan dsv4-mini-decode\n" in out
        assert "descriptors: PIECEWISE x 6 sizes 1..32 (B = 1, 2, 4, 8, 16, 32)" in out
        assert "13 segments: 9 graph, 4 eager" in out
        assert "5 regions (target 5): 5 graphs per descriptor, 30 graphs over 6 sizes" in out
        assert "  target#1: L0.post, L1.pre\n" in out
        assert "  tp_ar: all_reduce group=tp id=1 warmup=real, used by 4 segments" in out
        # per batch row: x 2048 + 4 x (q 2048 + kv 4096 + o 2048) + logits 128000 = 162816 bytes
        assert "static memory, allocated once at B=32 (capacities included): 5.0 MiB (5,210,112 bytes)" in out
        assert re.search(r"^logits +1 +\[B, 32000\] .* 125\.0 KiB +3\.9 MiB$", out, re.M)  # B=1, allocated

    def test_buffer_rows(self, plans, capsys):
        main(["show", "clean.yaml"])
        rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
                if re.match(r"^(x|kv\{0\.\.3\}|logits)\s", line)}
        assert rows["x"][-4:] == ["2.0", "KiB", "64.0", "KiB"]
        assert rows["kv{0..3}"][1] == "4"
        assert rows["kv{0..3}"][-4:] == ["16.0", "KiB", "512.0", "KiB"]
        assert rows["logits"][-4:] == ["125.0", "KiB", "3.9", "MiB"]

    def test_piped_output_is_plain(self, plans):
        proc = graphflow("-m", "graphflow", "show", "clean.yaml", cwd=plans)
        assert proc.returncode == 0
        assert "\x1b[" not in proc.stdout
        assert "q{0..3}" in proc.stdout

    def test_terminal_output_uses_rich_tables(self, plans, capsys, monkeypatch):
        monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
        assert main(["show", "clean.yaml"]) == 0
        out = capsys.readouterr().out
        assert "\x1b[" in out
        assert "q{0..3}" in out and "5,210,112" in out

    def test_text_to_a_file(self, plans, capsys):
        assert main(["show", "clean.yaml", "-o", "summary.txt"]) == 0
        assert capsys.readouterr().out == ""
        assert "static memory, allocated once at B=32" in (plans / "summary.txt").read_text()

    def test_unreadable_plan_exits_2(self, plans, capsys):
        assert main(["show", "unreadable.yaml"]) == 2
        assert capsys.readouterr().err.startswith("graphflow: unreadable.yaml:4: ")


class TestShowDot:
    def test_clusters_nodes_and_edges(self, plans, capsys):
        assert main(["show", "clean.yaml", "--format", "dot"]) == 0
        dot = capsys.readouterr().out
        assert dot.startswith('digraph "dsv4-mini-decode" {')
        assert dot.count("subgraph cluster_") == 5
        assert re.search(r'subgraph cluster_target_4 \{\n.*\n    "L3\.post" \[.*\n    "head" \[', dot)
        assert re.search(r'^  "L2\.attn" \[.*shape=octagon', dot, re.M)
        assert '"L0.pre" -> "L0.attn" [style=solid, label="q0@1, kv0@1"];' in dot
        assert dot.rstrip().endswith("}")

    def test_dot_format_from_the_output_extension(self, plans):
        assert main(["show", "clean.yaml", "-o", "plan.dot"]) == 0
        assert (plans / "plan.dot").read_text().startswith("digraph ")


class TestShowPicture:
    def test_png_is_written(self, plans):
        proc = graphflow("-m", "graphflow", "show", "clean.yaml", "--format", "png", "-o", "plan.png", cwd=plans)
        assert proc.returncode == 0, proc.stderr
        data = (plans / "plan.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) > 10_000

    def test_svg_is_written(self, plans):
        assert main(["show", "clean.yaml", "-o", "plan.svg"]) == 0
        root = ET.parse(plans / "plan.svg").getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        assert len(list(root.iter())) > 100

    @pytest.mark.parametrize("fmt", ["png", "svg"])
    def test_picture_needs_an_output_file(self, plans, capsys, fmt):
        assert main(["show", "clean.yaml", "--format", fmt]) == 2
        assert capsys.readouterr().err == f"graphflow: show --format {fmt} needs -o FILE\n"

    def test_unwritable_output_exits_2(self, plans, capsys):
        assert main(["show", "clean.yaml", "-o", "no/such/dir/plan.png"]) == 2
        assert capsys.readouterr().err.startswith("graphflow: no/such/dir/plan.png: cannot write: ")

    def test_the_picture_says_where_it_went_and_what_it_collapsed(self, plans, capsys):
        from PIL import Image

        assert main(["show", "clean.yaml", "--format", "picture"]) == 0
        first, note = capsys.readouterr().out.splitlines()
        width, height = Image.open(plans / "dsv4-mini-decode.png").size
        assert first.startswith(f"wrote dsv4-mini-decode.png ({width} x {height} px, ")
        assert note == "  L{0..3}: 4 copies of one for_each block, drawn once (×4); --expand or --layers N-M draws them apart"

    def test_a_picture_larger_than_a_screen_is_svg(self, plans, capsys):
        plan = ROOT / "plans" / "dsv4_61l_decode.yaml"
        assert main(["show", str(plan), "--format", "picture", "--expand", "-o", "layers"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("wrote layers.svg (")
        assert "of 61 copies drawn apart" in out
        assert ET.parse(plans / "layers.svg").getroot().tag == "{http://www.w3.org/2000/svg}svg"

    def test_layers_are_drawn_apart(self, plans, capsys):
        assert main(["show", "clean.yaml", "-o", "plan.svg", "--layers", "1-2"]) == 0
        out = capsys.readouterr().out
        assert "  L0: " not in out and "L{0..3}" not in out
        assert "L1.attn" in (plans / "plan.svg").read_text()

    def test_malformed_layers_exit_2(self, plans, capsys):
        assert main(["show", "clean.yaml", "-o", "plan.svg", "--layers", "3-1"]) == 2
        assert capsys.readouterr().err == "graphflow: --layers '3-1': range 3-1 runs backwards\n"

    def test_picture_options_need_a_picture(self, plans, capsys):
        assert main(["show", "clean.yaml", "--expand"]) == 2
        assert "add --format png, svg or picture" in capsys.readouterr().err


class TestRules:
    def test_lists_every_rule(self, capsys):
        assert main(["rules"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [line.split()[:2] for line in lines] == [[r.code, r.severity.value] for r in RULES]
        assert lines[0].endswith(RULES[0].title)

    def test_json(self, capsys):
        assert main(["rules", "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)
        assert [(r["code"], r["severity"], r["title"]) for r in rows] == [
            (r.code, r.severity.value, r.title) for r in RULES
        ]
        assert all(r["doc"] for r in rows)


def test_the_synopsis_names_every_command_and_action():
    """docs/cli.md opens with one line per command (and per action of trace and vllm), so a
    reader finds every command there, as ``graphflow --help`` lists them."""
    import argparse

    from graphflow.cli import build_parser

    synopsis = (ROOT / "docs" / "cli.md").read_text().split("```")[1]
    said = {" ".join(line.split()[1:3]) if line.split()[1] in ("trace", "vllm") else line.split()[1]
            for line in synopsis.strip().splitlines()}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    expected = set()
    for name, parser in commands.items():
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        expected |= {f"{name} {action}" for action in actions[0].choices} if actions else {name}
    assert said == expected
