"""Regenerate the pictures docs/cli.md shows, from the bundled plans and an example's, into docs/pictures/.

Each DAG picture is what ``graphflow show PLAN -o FILE.svg`` draws (``--expand`` where
the name says so); the capture report is drawn from ``docs/pictures/capture-report.json``,
the report of a real run (``graphflow run PLAN --report capture-report.json``), kept in
the repository so the picture does not change with each machine's timings.
``--refresh-report`` first rewrites that JSON from a CPU run of ``plans/toy.yaml``
(seconds); a report from a GPU run can be copied there instead.

``docs/pictures/SOURCES`` records a hash of what the pictures are made from (the plans,
the drawing code, this script, the report JSON); ``tests/test_docs_pictures.py`` fails
when it no longer matches, or when a picture drawn again says something else.

Run from the repository root: ``python scripts/make_pictures.py [--refresh-report]``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "pictures"
REPORT = OUT / "capture-report.json"
SOURCES = OUT / "SOURCES"

#: (picture file, plan, picture options): what docs/cli.md shows.
PICTURES = (
    ("toy.svg", "plans/toy.yaml", {}),
    ("toy-expanded.svg", "plans/toy.yaml", {"expand": True}),
    ("dsv4-mini-piecewise.svg", "plans/dsv4_mini_piecewise.yaml", {}),
    ("dsv4-mini-full.svg", "plans/dsv4_mini_full.yaml", {}),
    ("dsv4-mini-piecewise-expanded.svg", "plans/dsv4_mini_piecewise.yaml", {"expand": True}),
    ("dsv4-61l-decode.svg", "plans/dsv4_61l_decode.yaml", {}),
    ("dsv4-tp-piecewise.svg", "plans/dsv4_tp_piecewise.yaml", {}),
    ("hf-llama-decode.svg", "examples/hf_llama/decode.yaml", {}),
)
REPORT_PICTURE = "capture-report.svg"
#: The drawing code, besides the plans. (What the plan model, loader or schedule change in a
#: picture, tests/test_docs_pictures.py finds by drawing each again and comparing its text.)
CODE = ("graphflow/view/picture.py", "graphflow/view/style.py", "graphflow/view/report.py", "scripts/make_pictures.py")


def sources_hash() -> str:
    """A hash of every input: plans, code and the report JSON, by path and content."""
    digest = hashlib.sha256()
    paths = sorted({*CODE, *(plan for _, plan, _ in PICTURES), str(REPORT.relative_to(ROOT))})
    for path in paths:
        digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes() + b"\0")
    return digest.hexdigest()


def refresh_report() -> None:
    from graphflow.engine import RunOptions, run_pipeline
    from graphflow.plan.loader import load_plan
    from graphflow.view.report import CaptureReport, write_report

    plan = load_plan(ROOT / "plans" / "toy.yaml")
    report = CaptureReport(plan.name, "cpu")
    with run_pipeline(plan, RunOptions(backend="cpu"), listeners=[report]):
        pass
    write_report(report.document(), REPORT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refresh-report", action="store_true",
                        help="rewrite docs/pictures/capture-report.json from a CPU run of plans/toy.yaml first")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import json

    from graphflow.plan.loader import load_plan
    from graphflow.view.picture import Expand, ImageFormat, draw, layout
    from graphflow.view.report import draw_report

    OUT.mkdir(parents=True, exist_ok=True)
    if args.refresh_report or not REPORT.exists():
        refresh_report()
    for name, plan, options in PICTURES:
        picture = layout(load_plan(ROOT / plan), expand=Expand.ALL if options.get("expand") else Expand.NONE)
        draw(picture, str(OUT / name), ImageFormat.SVG)
        print(f"{OUT / name}: {picture.pixels[0]} x {picture.pixels[1]} px")
    draw_report(json.loads(REPORT.read_text()), OUT / REPORT_PICTURE, "svg")
    print(f"{OUT / REPORT_PICTURE}")
    SOURCES.write_text(sources_hash() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
