"""``graphflow run --report FILE``: the capture report of a run, written also when the capture fails."""

from __future__ import annotations

import json

from graphflow.cli import main

TOY = "plans/toy.yaml"


class TestRunReport:
    def test_run_writes_the_report_it_was_asked_for(self, tmp_path, capsys):
        path = tmp_path / "report.json"
        assert main(["run", TOY, "--quiet", "--steps", "0", "--report", str(path)]) == 0
        doc = json.loads(path.read_text())
        assert doc["plan"] == "toy-piecewise" and doc["backend"] == "cpu" and doc["ok"] is True
        assert [r["size"] for r in doc["descriptors"]] == [8, 4, 2, 1]

    def test_a_failed_run_still_writes_how_far_it_got(self, tmp_path, capsys):
        plan = tmp_path / "broken.yaml"
        plan.write_text(open(TOY).read().replace('call: "layers.{layer}.post"', 'call: head'))
        path = tmp_path / "report.json"
        assert main(["run", str(plan), "--quiet", "--no-detectors", "--report", str(path)]) == 1
        doc = json.loads(path.read_text())
        assert doc["ok"] is False and doc["error"]["phase"] == "warmup"
        assert doc["error"]["message"].startswith("RuntimeError: The size of tensor a (32) must match")

    def test_a_bad_report_name_exits_2_before_any_capture(self, tmp_path, capsys):
        assert main(["run", TOY, "--quiet", "--report", str(tmp_path / "r.txt")]) == 2
        assert capsys.readouterr().err.startswith("graphflow: --report ")
        assert not (tmp_path / "r.txt").exists()
