"""The capture report: where a capture's time and memory went, per descriptor, as JSON or a picture.

``graphflow run`` prints phase totals; when a capture of 134 descriptors takes 40 s, the
question is which descriptors cost it. ``CaptureReport`` is a pipeline listener
(``graphflow.events``) that collects, from each ``DESCRIPTOR_END``, the seconds that
descriptor spent in warmup, capture and verify and the capture pool's size after it,
and from each ``PHASE_END`` the phase's seconds. ``document()`` returns them as one
plain JSON document, which ``write_report`` writes as JSON (``.json``) or draws
(``.png``, ``.svg``, with matplotlib from the ``draw`` extra). ``draw_report`` takes
only the document, so a report saved as JSON, or built by another runner, draws the
same way. The document (``"graphflow_report": 1``)::

    {"graphflow_report": 1, "plan": "dsv4-61l-decode", "backend": "cuda", "rank": 0,
     "ok": true, "error": null,           # a failed capture: {"message", "phase", "descriptor"} of the rollback
     "descriptors": [                     # in capture order: PIECEWISE then FULL, largest first
       {"mode": "PIECEWISE", "size": 512,
        "warmup_s": 0.081, "capture_s": 0.125, "verify_s": 0.040,   # null: the phase did not run it
        "warmup_skipped": false,          # true: straight to capture (capture.warmup auto)
        "pool_bytes": 1048576,            # the pool after capturing it (null: not measurable, CPU)
        "pool_growth_bytes": 1048576}],   # what capturing it added to the pool
     "phases": [{"phase": "warmup", "seconds": 5.2}, ...],
     "totals": {"descriptors": 67, "warmup_s": 5.2, "capture_s": 8.3, "verify_s": 2.1,
                "pool_bytes": 1048576, "phases_s": 16.0,
                "warmed_up": 7, "verified": 5}}   # descriptors that warmed up, and that verify compared

This module imports neither torch nor matplotlib at import time.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

from graphflow.events import Event, EventKind, Phase

__all__ = ["CaptureReport", "REPORT_FORMATS", "draw_report", "report_format", "write_report"]

#: What ``write_report`` writes, by the file's extension.
REPORT_FORMATS = ("json", "png", "svg")
_TIMED = {Phase.WARMUP: "warmup_s", Phase.CAPTURE: "capture_s", Phase.VERIFY: "verify_s"}
#: Rows drawn at most; the rest are summed into one row, so a picture stays on a screen.
_MAX_ROWS = 60


class CaptureReport:
    """A pipeline listener collecting per-descriptor times and pool sizes (see the module docstring)."""

    #: It reads descriptor and phase events only (``graphflow.engine.context``).
    segment_events = False

    def __init__(self, plan: str, backend: str | None = None):
        self.plan = plan
        self.backend = backend
        self.rank = 0
        self.rows: dict[tuple[str, int], dict[str, Any]] = {}
        self.phases: list[dict[str, Any]] = []
        self.started = False
        self.ok: bool | None = None
        self.error: dict[str, Any] | None = None

    def on_event(self, event: Event) -> None:
        kind = event.kind
        if kind is EventKind.PIPELINE_BEGIN:
            self.started, self.rank = True, event.rank
        elif kind is EventKind.DESCRIPTOR_END and event.phase in _TIMED and event.descriptor is not None:
            row = self._row(event.descriptor)
            row[_TIMED[event.phase]] = event.elapsed_s
            if event.phase is Phase.CAPTURE:
                row["pool_bytes"] = event.pool_bytes
        elif kind is EventKind.DESCRIPTOR_SKIPPED and event.phase is Phase.WARMUP and event.descriptor is not None:
            self._row(event.descriptor)["warmup_skipped"] = True
        elif kind is EventKind.PHASE_END and event.phase is not None:
            # A phase runs once per descriptor (warmup, capture, verify): one row, summed.
            row = next((p for p in self.phases if p["phase"] == event.phase.value), None)
            if row is None:
                self.phases.append({"phase": event.phase.value, "seconds": event.elapsed_s})
            else:
                row["seconds"] += event.elapsed_s
        elif kind is EventKind.PIPELINE_END:
            self.ok = True
        elif kind is EventKind.ROLLBACK:
            self.ok = False
            self.error = {"message": event.error, "phase": event.phase.value if event.phase else None,
                          "descriptor": None if event.descriptor is None else str(event.descriptor)}

    def _row(self, descriptor) -> dict[str, Any]:
        mode = getattr(getattr(descriptor, "mode", None), "value", None) or str(descriptor)
        size = getattr(descriptor, "size", 0)
        key = (mode, size)
        if key not in self.rows:
            self.rows[key] = {"mode": mode, "size": size, "warmup_s": None, "capture_s": None, "verify_s": None,
                              "pool_bytes": None, "pool_growth_bytes": None, "warmup_skipped": False}
        return self.rows[key]

    def document(self) -> dict[str, Any]:
        rows = [dict(r) for r in self.rows.values()]
        previous = 0
        for row in rows:  # in capture order: the shared pool only grows
            if row["pool_bytes"] is not None:
                row["pool_growth_bytes"] = row["pool_bytes"] - previous
                previous = row["pool_bytes"]

        def total(key: str) -> float | None:
            values = [r[key] for r in rows if r[key] is not None]
            return sum(values) if values else None

        pools = [r["pool_bytes"] for r in rows if r["pool_bytes"] is not None]
        return {
            "graphflow_report": 1, "plan": self.plan, "backend": self.backend, "rank": self.rank,
            "ok": bool(self.ok), "error": self.error, "descriptors": rows, "phases": list(self.phases),
            "totals": {"descriptors": len(rows), "warmup_s": total("warmup_s"), "capture_s": total("capture_s"),
                       "verify_s": total("verify_s"), "pool_bytes": pools[-1] if pools else None,
                       "phases_s": sum(p["seconds"] for p in self.phases),
                       "warmed_up": sum(r["warmup_s"] is not None for r in rows),
                       "verified": sum(r["verify_s"] is not None for r in rows)},
        }


def report_format(path: str | os.PathLike) -> str:
    """The format a report path asks for, by its extension; ValueError naming the choices otherwise."""
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix not in REPORT_FORMATS:
        raise ValueError(f"{path}: a report is written as .json, .png or .svg (got {Path(path).suffix or 'no suffix'})")
    if suffix != "json" and importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{path}: drawing a report needs matplotlib: pip install 'graphflow[draw]' (or write .json)")
    return suffix


def write_report(document: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``document`` to ``path`` as JSON or a picture, by the extension (``report_format``)."""
    fmt = report_format(path)
    if fmt == "json":
        Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    else:
        draw_report(document, path, fmt)


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    if value < 1e-3:
        return f"{value * 1e6:.0f} µs"
    if value < 1:
        return f"{value * 1e3:.1f} ms"
    return f"{value:.2f} s"


#: What the rows are sorted by, as the figure states it.
ORDER = "sorted by warmup + capture time, the most first"


def _ordered(descriptors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows in the order drawn: by the time the panels show (warmup and capture), so the
    order can be read off the bars; verify has no panel and would make it look unsorted.
    Capture order breaks ties."""
    return sorted(descriptors, key=lambda r: -((r["warmup_s"] or 0) + (r["capture_s"] or 0)))


def draw_report(document: dict[str, Any], path: str | os.PathLike, fmt: str) -> None:
    """Bars per descriptor: warmup time, capture time, pool growth; totals on top."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    from graphflow.units import format_bytes

    rows = _ordered(document["descriptors"])
    tail = None
    if len(rows) > _MAX_ROWS:
        rest = rows[_MAX_ROWS - 1:]
        summed = {"mode": f"{len(rest)} more", "size": None}
        for key in ("warmup_s", "capture_s", "verify_s", "pool_growth_bytes"):
            values = [r[key] for r in rest if r[key] is not None]
            summed[key] = sum(values) if values else None
        rows = rows[:_MAX_ROWS - 1] + [summed]
        tail = len(rows) - 1
    labels = [r["mode"] if r["size"] is None else f"{r['mode']}(B={r['size']})" for r in rows]
    totals = document["totals"]
    panels = [("warmup", "warmup_s", "#4C72B0", _seconds), ("capture", "capture_s", "#DD8452", _seconds),
              ("pool growth", "pool_growth_bytes", "#55A868", format_bytes)]
    row_h = 0.2 if len(rows) <= 24 else 0.16
    header_h = 1.05
    height = header_h + max(len(rows), 3) * row_h + 0.55
    width = 11.0
    error = document.get("error") or {}
    where = " ".join(f"{k}={error[k]}" for k in ("phase", "descriptor") if error.get(k))
    message = error.get("message") or "unknown error"
    message = message if len(message) <= 90 else message[:88] + "…"
    status = "captured" if document.get("ok") else f"rolled back [{where}]: {message}"
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "graphflow"}):
        fig = Figure(figsize=(width, height), dpi=100)
        fig.text(0.15 / width, 1 - 0.3 / height, f"capture report: {document['plan']}", fontsize=13,
                 fontweight="bold", va="center")
        shown = f"{len(rows) - 1} shown, {len(document['descriptors']) - len(rows) + 1} summed in the last row" \
            if tail is not None else "all shown"
        summary = (f"backend {document.get('backend') or '?'}, rank {document.get('rank', 0)}: {status}; "
                   f"{totals['descriptors']} descriptors, {ORDER} ({shown})")
        fig.text(0.15 / width, 1 - 0.55 / height, summary, fontsize=8.5, va="center", color="#333333")
        phases = ", ".join(f"{p['phase']} {_seconds(p['seconds'])}" for p in document.get("phases", ()))
        fig.text(0.15 / width, 1 - 0.75 / height,
                 f"warmup {_seconds(totals['warmup_s'])}, capture {_seconds(totals['capture_s'])}, verify "
                 f"{_seconds(totals['verify_s'])}, pool {format_bytes(totals['pool_bytes'])}"
                 + (f"  (phases: {phases})" if phases else ""), fontsize=8.5, va="center", color="#333333")
        top = 1 - header_h / height
        bottom = 0.4 / height
        left, gap = 1.45 / width, 0.35 / width
        panel_w = (1 - left - 0.2 / width - 2 * gap) / 3
        ys = list(range(len(rows)))
        for k, (title, key, color, fmt_value) in enumerate(panels):
            ax = fig.add_axes((left + k * (panel_w + gap), bottom, panel_w, top - bottom))
            values = [r[key] for r in rows]
            known = [v for i, v in enumerate(values) if v is not None and i != tail]
            peak = max(known, default=0) or 1
            # The summed tail row is drawn to the axis's end at most: it must not squash the others.
            shown = [min(v or 0, peak * 1.3) if i == tail else v or 0 for i, v in enumerate(values)]
            ax.barh(ys, shown, height=0.72, color=color)
            ax.set_ylim(len(rows) - 0.5, -0.5)
            ax.set_yticks(ys)
            ax.set_yticklabels(labels if k == 0 else [""] * len(rows), fontsize=6.5 if len(rows) > 24 else 7.5)
            ax.tick_params(axis="x", labelsize=6.5)
            total = sum(v for v in values if v is not None) if known else None
            ax.set_title(f"{title} (total {fmt_value(total)})" if key != "pool_growth_bytes" else
                         f"{title} (pool {format_bytes(totals['pool_bytes'])})", fontsize=8.5, loc="left")
            for side in ("top", "right"):
                ax.spines[side].set_visible(False)
            if not known:
                ax.text(0.5, 0.5, "not measured" + (" (no capture pool on this backend)" if key ==
                        "pool_growth_bytes" else ""), transform=ax.transAxes, ha="center", va="center",
                        fontsize=8, color="#777777")
                ax.set_xticks([])
                continue
            ax.set_xlim(0, peak * 1.35)
            ax.xaxis.set_major_locator(MaxNLocator(4))
            for y, v, bar in zip(ys, values, shown):
                if v is not None and (len(rows) <= 40 or y == tail):
                    text = fmt_value(v) + (" in all" if y == tail else "")
                    inside = bar > peak * 1.0
                    ax.text(bar - peak * 0.02 if inside else bar + peak * 0.02, y, text, va="center",
                            ha="right" if inside else "left", fontsize=6, color="white" if inside else "#333333")
            if key.endswith("_s"):
                ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _seconds(v) if v else "0"))
            else:
                ax.xaxis.set_major_formatter(FuncFormatter(
                    lambda v, _: format_bytes(int(v)) if v and not math.isnan(v) else "0"))
        metadata = {"Date": None} if fmt == "svg" else {}
        fig.savefig(path, format=fmt, metadata=metadata)
