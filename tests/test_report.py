"""The capture report (``graphflow.view.report``): collected from the pipeline's events, written as JSON or drawn."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from graphflow.engine import RunOptions, run_pipeline
from graphflow.events import Event, EventKind, Phase
from graphflow.plan.loader import load_plan
from graphflow.plan import Descriptor, Mode
from graphflow.view.report import CaptureReport, report_format, write_report

TOY = "plans/toy.yaml"
P8, P2, F8 = Descriptor(Mode.PIECEWISE, 8), Descriptor(Mode.PIECEWISE, 2), Descriptor(Mode.FULL, 8)


def feed(report: CaptureReport, *events: Event) -> CaptureReport:
    for event in events:
        report.on_event(event)
    return report


def end(phase: Phase, descriptor, seconds: float, pool: int | None = None) -> Event:
    return Event(EventKind.DESCRIPTOR_END, phase=phase, descriptor=descriptor, elapsed_s=seconds, pool_bytes=pool)


class TestCollect:
    def test_rows_per_descriptor_in_capture_order_with_pool_growth(self):
        report = feed(
            CaptureReport("p", "cuda"), Event(EventKind.PIPELINE_BEGIN),
            end(Phase.WARMUP, P8, 0.5), end(Phase.WARMUP, P2, 0.25), end(Phase.WARMUP, F8, 0.75),
            Event(EventKind.PHASE_END, phase=Phase.WARMUP, elapsed_s=1.5),
            end(Phase.CAPTURE, P8, 0.125, 1000), end(Phase.CAPTURE, P2, 0.0625, 1000), end(Phase.CAPTURE, F8, 0.5, 1600),
            Event(EventKind.PHASE_END, phase=Phase.CAPTURE, elapsed_s=0.75),
            end(Phase.VERIFY, P8, 0.03125), Event(EventKind.PIPELINE_END),
        )
        document = report.document()
        assert [(r["mode"], r["size"], r["warmup_s"], r["capture_s"], r["verify_s"], r["pool_bytes"],
                 r["pool_growth_bytes"]) for r in document["descriptors"]] == [
            ("PIECEWISE", 8, 0.5, 0.125, 0.03125, 1000, 1000),
            ("PIECEWISE", 2, 0.25, 0.0625, None, 1000, 0),
            ("FULL", 8, 0.75, 0.5, None, 1600, 600),
        ]
        assert document["totals"] == {"descriptors": 3, "warmup_s": 1.5, "capture_s": 0.6875, "verify_s": 0.03125,
                                      "pool_bytes": 1600, "phases_s": 2.25, "warmed_up": 3, "verified": 1}
        assert document["phases"] == [{"phase": "warmup", "seconds": 1.5}, {"phase": "capture", "seconds": 0.75}]
        assert (document["plan"], document["backend"], document["ok"], document["error"]) == ("p", "cuda", True, None)

    def test_a_rollback_is_reported_with_where_it_happened(self):
        report = feed(CaptureReport("p"), Event(EventKind.PIPELINE_BEGIN), end(Phase.WARMUP, P8, 0.5),
                      Event(EventKind.ROLLBACK, phase=Phase.CAPTURE, descriptor=P2, error="RuntimeError: boom"))
        document = report.document()
        assert document["ok"] is False
        assert document["error"] == {"message": "RuntimeError: boom", "phase": "capture", "descriptor": "PIECEWISE(B=2)"}
        assert document["totals"]["capture_s"] is None and document["totals"]["pool_bytes"] is None

    def test_a_real_capture_on_the_cpu_backend(self):
        plan = load_plan(TOY)
        report = CaptureReport(plan.name, "cpu")
        with run_pipeline(plan, RunOptions(backend="cpu"), listeners=[report]):
            pass
        document = report.document()
        assert [(r["mode"], r["size"]) for r in document["descriptors"]] == [
            (d.mode.value, d.size) for d in plan.descriptors()]
        for row in document["descriptors"]:
            assert row["warmup_s"] > 0 and row["capture_s"] > 0 and row["verify_s"] > 0
            assert row["pool_bytes"] is None  # the CPU backend has no capture pool to measure
        assert [p["phase"] for p in document["phases"]] == ["allocate", "warmup", "prewarm", "capture", "verify",
                                                            "commit"]
        assert document["totals"]["warmup_s"] == pytest.approx(sum(r["warmup_s"] for r in document["descriptors"]))


def document(rows: int = 3, ok: bool = True) -> dict:
    report = CaptureReport("dsv4-test", "cuda")
    report.on_event(Event(EventKind.PIPELINE_BEGIN))
    for i in range(rows):
        d = Descriptor(Mode.PIECEWISE, 8 * (rows - i))
        report.on_event(end(Phase.WARMUP, d, 0.01 * (i + 1)))
        report.on_event(end(Phase.CAPTURE, d, 0.002 * (i + 1), 2**20 * (i + 1)))
    report.on_event(Event(EventKind.PIPELINE_END) if ok else
                    Event(EventKind.ROLLBACK, phase=Phase.VERIFY, error="CaptureError: mismatch"))
    return report.document()


class TestWrite:
    def test_json_round_trips(self, tmp_path):
        doc = document()
        write_report(doc, tmp_path / "r.json")
        assert json.loads((tmp_path / "r.json").read_text()) == doc

    def test_svg_draws_every_descriptor_and_the_totals(self, tmp_path):
        write_report(document(), tmp_path / "r.svg")
        text = "".join(ET.parse(tmp_path / "r.svg").getroot().itertext())
        for size in (8, 16, 24):
            assert f"PIECEWISE(B={size})" in text
        assert "capture report: dsv4-test" in text and "pool 3.0 MiB" in text

    def test_many_descriptors_are_summed_into_the_last_row(self, tmp_path):
        from PIL import Image

        write_report(document(rows=134), tmp_path / "r.png")
        width, height = Image.open(tmp_path / "r.png").size
        assert width <= 1200 and height <= 1300
        write_report(document(rows=134), tmp_path / "r.svg")
        text = "".join(ET.parse(tmp_path / "r.svg").getroot().itertext())
        assert "75 more" in text and "59 shown, 75 summed in the last row" in text

    def test_rows_follow_the_drawn_panels_and_the_figure_says_so(self, tmp_path):
        # Verify has no panel: a slow verify must not lift a row the bars show as cheap.
        report = feed(CaptureReport("p", "cuda"), Event(EventKind.PIPELINE_BEGIN),
                      end(Phase.WARMUP, P8, 0.1), end(Phase.CAPTURE, P8, 0.1), end(Phase.VERIFY, P8, 5.0),
                      end(Phase.WARMUP, P2, 0.3), end(Phase.CAPTURE, P2, 0.2), end(Phase.VERIFY, P2, 0.0),
                      end(Phase.WARMUP, F8, 0.2), end(Phase.CAPTURE, F8, 0.2), Event(EventKind.PIPELINE_END))
        write_report(report.document(), tmp_path / "r.svg")
        text = "".join(ET.parse(tmp_path / "r.svg").getroot().itertext())
        assert "3 descriptors, sorted by warmup + capture time, the most first" in text
        drawn = [text.index(label) for label in ("PIECEWISE(B=2)", "FULL(B=8)", "PIECEWISE(B=8)")]
        assert drawn == sorted(drawn)

    def test_a_failed_capture_says_so(self, tmp_path):
        write_report(document(ok=False), tmp_path / "r.svg")
        assert "rolled back [phase=verify]: CaptureError: mismatch" in (tmp_path / "r.svg").read_text()

    @pytest.mark.parametrize("name", ["r.txt", "r"])
    def test_other_extensions_are_refused(self, name):
        with pytest.raises(ValueError, match=r"a report is written as \.json, \.png or \.svg"):
            report_format(name)
