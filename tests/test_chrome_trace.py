"""``graphflow trace export``: per-rank traces as a Chrome trace (Perfetto, chrome://tracing).

The traces are written by the real ``TraceLog`` and ``Tracer``, the way a capture writes
them; the output is checked against the Trace Event Format (a JSON schema of the fields
this exporter uses, one process per rank, spans nested as a timeline needs) and the
divergence mark against ``diff_traces``. The three-rank gloo run in test_multirank.py
checks the same on traces of a real divergence.
"""

from __future__ import annotations

import json

import pytest

from graphflow.dist.chrome_trace import chrome_trace
from graphflow.cli import main
from graphflow.dist.trace import TraceLog, Tracer, diff_traces, read_trace

# The GPU machine lacks jsonschema: skip this CPU-only module there instead of failing collection.
jsonschema = pytest.importorskip("jsonschema")

#: The Trace Event Format's JSON object form, for the event types the exporter writes.
SCHEMA = {
    "type": "object",
    "required": ["traceEvents"],
    "properties": {
        "traceEvents": {"type": "array", "items": {"$ref": "#/$defs/event"}},
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
    },
    "$defs": {
        "event": {
            "type": "object",
            "required": ["name", "ph", "ts", "pid", "tid"],
            "properties": {
                "name": {"type": "string"},
                "cat": {"type": "string"},
                "ph": {"enum": ["X", "i", "M"]},
                "ts": {"type": "number", "minimum": 0},
                "dur": {"type": "number", "minimum": 0},
                "pid": {"type": "integer"},
                "tid": {"type": "integer"},
                "s": {"enum": ["g", "p", "t"]},
                "args": {"type": "object"},
                "cname": {"type": "string"},
            },
            "allOf": [
                {"if": {"properties": {"ph": {"const": "X"}}}, "then": {"required": ["dur"]}},
                {"if": {"properties": {"ph": {"const": "i"}}}, "then": {"required": ["s"]}},
                {"if": {"properties": {"ph": {"const": "M"}}},
                 "then": {"required": ["args"],
                          "properties": {"name": {"enum": ["process_name", "process_sort_index", "thread_name",
                                                           "thread_sort_index"]}}}},
            ],
        }
    },
}

SIZES = (4, 2)


def pipeline(log: TraceLog, *, diverge_at: int | None = None, stop_at: int | None = None) -> None:
    """A capture's events: warmup and capture of two descriptors, a collective per descriptor.

    ``diverge_at`` makes that descriptor's collective take another channel (a rank that
    routed differently); ``stop_at`` stops writing before that descriptor's capture (a
    rank that hung there).
    """
    log.record({"event": "pipeline_begin"})
    for phase in ("warmup", "capture"):
        log.record({"event": "phase_begin", "phase": phase})
        for size in SIZES:
            if phase == "capture" and size == stop_at:
                return
            descriptor = f"PIECEWISE(B={size})"
            log.record({"event": "descriptor_begin", "phase": phase, "descriptor": descriptor})
            if phase == "capture":
                log.record({"event": "region_begin", "phase": phase, "descriptor": descriptor, "region": "t:a..b"})
            channel = "ep_ar" if size == diverge_at and phase == "warmup" else "tp_ar"
            log.record({"event": "collective", "op": "all_reduce", "phase": phase, "descriptor": descriptor,
                        "segment": "b", "channel": channel, "group": "tp", "path": "eager_warmup"
                        if phase == "warmup" else "captured", "shape": [size, 8]})
            if phase == "capture":
                log.record({"event": "region_end", "phase": phase, "descriptor": descriptor, "region": "t:a..b"})
            log.record({"event": "descriptor_end", "phase": phase, "descriptor": descriptor})
        log.record({"event": "phase_end", "phase": phase})
    log.record({"event": "pipeline_end"})


def write(tmp_path, *, diverge: dict | None = None, stop: dict | None = None, ranks: int = 3):
    diverge, stop = diverge or {}, stop or {}
    for rank in range(ranks):
        tracer = Tracer(tmp_path, rank)
        pipeline(TraceLog(rank, tracer), diverge_at=diverge.get(rank), stop_at=stop.get(rank))
        tracer.close()
    return [read_trace(tmp_path / f"rank{r}.jsonl") for r in range(ranks)]


def spans(document, pid):
    return [e for e in document["traceEvents"] if e["ph"] == "X" and e["pid"] == pid]


def process_names(document):
    return {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}


class TestFormat:
    def test_matches_the_trace_event_format_and_survives_json(self, tmp_path):
        document = chrome_trace(write(tmp_path, diverge={1: 2}))
        jsonschema.validate(json.loads(json.dumps(document)), SCHEMA)

    def test_one_process_per_rank_each_named_once(self, tmp_path):
        document = chrome_trace(write(tmp_path))
        assert {e["pid"] for e in document["traceEvents"]} == {0, 1, 2}
        names = [e for e in document["traceEvents"] if e["name"] == "process_name"]
        assert sorted((e["pid"], e["args"]["name"]) for e in names) == [(0, "rank 0"), (1, "rank 1"), (2, "rank 2")]
        threads = [e for e in document["traceEvents"] if e["name"] == "thread_name"]
        assert [e["args"]["name"] for e in threads] == ["capture pipeline"] * 3

    def test_phases_descriptors_and_regions_are_nested_spans(self, tmp_path):
        traces = write(tmp_path, ranks=1)
        document = chrome_trace(traces)
        found = spans(document, 0)
        assert [(e["cat"], e["name"]) for e in found] == [
            ("pipeline", "pipeline"), ("phase", "warmup"), ("descriptor", "PIECEWISE(B=4)"),
            ("descriptor", "PIECEWISE(B=2)"), ("phase", "capture"), ("descriptor", "PIECEWISE(B=4)"),
            ("region", "t:a..b"), ("descriptor", "PIECEWISE(B=2)"), ("region", "t:a..b")]
        stack = []
        for span in found:  # sorted by start: each lies inside the last open one that has not ended
            while stack and span["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()
            if stack:
                assert span["ts"] + span["dur"] <= stack[-1]["ts"] + stack[-1]["dur"]
            stack.append(span)

    def test_times_are_microseconds_from_the_first_event(self, tmp_path):
        traces = write(tmp_path, ranks=2)
        document = chrome_trace(traces)
        start = min(e["ts"] for t in traces for e in t)
        warmup_begin = next(e for e in traces[1] if e["event"] == "phase_begin")
        warmup_end = next(e for e in traces[1] if e["event"] == "phase_end")
        (warmup,) = [e for e in spans(document, 1) if e["name"] == "warmup"]
        assert warmup["ts"] == pytest.approx((warmup_begin["ts"] - start) * 1e6, abs=0.01)
        assert warmup["dur"] == pytest.approx((warmup_end["ts"] - warmup_begin["ts"]) * 1e6, abs=0.01)

    def test_collectives_are_instants_with_their_counter_and_path(self, tmp_path):
        traces = write(tmp_path, ranks=1)
        document = chrome_trace(traces)
        instants = [e for e in document["traceEvents"] if e.get("cat") == "collective"]
        assert [(e["name"], e["s"], e["args"]["path"]) for e in instants] == [
            ("all_reduce tp_ar", "t", "eager_warmup")] * 2 + [("all_reduce tp_ar", "t", "captured")] * 2
        assert [e["args"]["n"] for e in instants] == [e["n"] for e in traces[0] if e["event"] == "collective"]


class TestDivergence:
    def test_the_mark_sits_on_the_event_trace_diff_names(self, tmp_path):
        traces = write(tmp_path, diverge={1: 2})
        found = diff_traces(traces)
        assert found.differing == (1,)
        document = chrome_trace(traces)
        start = min(e["ts"] for t in traces for e in t)
        marks = {e["pid"]: e for e in document["traceEvents"] if e.get("cat") == "divergence" and e["s"] == "t"}
        assert set(marks) == {0, 1, 2}
        assert marks[1]["name"] == "first divergence" and marks[1]["args"]["n"] == found.index
        event = traces[1][found.index]
        assert event["channel"] == "ep_ar"
        assert marks[1]["ts"] == pytest.approx((event["ts"] - start) * 1e6, abs=0.01)
        assert marks[1]["args"]["this rank"].startswith(f"#{found.index} collective")
        for pid in (0, 2):
            assert marks[pid]["args"]["n"] == found.index
            assert marks[pid]["ts"] == pytest.approx((traces[pid][found.index]["ts"] - start) * 1e6, abs=0.01)
        (line,) = [e for e in document["traceEvents"] if e.get("cat") == "divergence" and e["s"] == "g"]
        assert line["name"] == f"ranks diverge at event #{found.index} (rank 1)"
        assert document["otherData"]["first_divergence"]["ranks"] == [1]

    def test_the_rank_that_diverged_says_so_in_its_name(self, tmp_path):
        traces = write(tmp_path, diverge={1: 2})
        names = process_names(chrome_trace(traces))
        assert names == {0: "rank 0", 1: f"rank 1 — diverged at event #{diff_traces(traces).index}", 2: "rank 2"}

    def test_a_rank_that_stopped_is_stalled_and_its_spans_end_with_it(self, tmp_path):
        traces = write(tmp_path, stop={2: 2})
        document = chrome_trace(traces)
        found = diff_traces(traces)
        assert found.differing == (2,) and found.events[2] is None
        last = traces[2][-1]
        assert process_names(document)[2] == f"rank 2 — stalled: trace ends at #{last['n']} descriptor_end (capture)"
        (capture,) = [e for e in spans(document, 2) if e["name"] == "capture"]
        assert "incomplete" in capture["args"]
        start = min(e["ts"] for t in traces for e in t)
        assert capture["ts"] + capture["dur"] == pytest.approx((last["ts"] - start) * 1e6, abs=0.01)
        (mark,) = [e for e in document["traceEvents"] if e.get("cat") == "divergence" and e["pid"] == 2
                   and e["s"] == "t"]
        assert mark["args"]["what"] == f"rank 2's trace ends before event #{found.index}"

    def test_a_single_trace_that_stops_is_stalled(self, tmp_path):
        traces = write(tmp_path, stop={0: 2}, ranks=1)
        assert process_names(chrome_trace(traces))[0] == (
            f"rank 0 — stalled: trace ends at #{traces[0][-1]['n']} descriptor_end (capture)")

    def test_agreeing_ranks_have_no_mark(self, tmp_path):
        document = chrome_trace(write(tmp_path))
        assert not [e for e in document["traceEvents"] if e.get("cat") == "divergence"]
        assert "first_divergence" not in document["otherData"]


class TestCommand:
    def test_writes_the_file_and_says_where_ranks_diverge(self, tmp_path, capsys):
        traces = write(tmp_path / "tr", diverge={1: 2})
        out = tmp_path / "trace.json"
        assert main(["trace", "export", "--format", "chrome", str(tmp_path / "tr"), "-o", str(out)]) == 0
        lines = capsys.readouterr().out.splitlines()
        n = diff_traces(traces).index
        assert lines[0] == f"wrote {out}: 3 rank(s), {sum(map(len, traces))} events; ranks diverge at event {n} (rank 1)"
        assert "ui.perfetto.dev" in lines[1]
        jsonschema.validate(json.loads(out.read_text()), SCHEMA)

    def test_without_a_file_it_prints_the_json(self, tmp_path, capsys):
        write(tmp_path, ranks=2)
        assert main(["trace", "export", str(tmp_path / "rank0.jsonl"), str(tmp_path / "rank1.jsonl")]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["otherData"]["traces"] == [str(tmp_path / "rank0.jsonl"), str(tmp_path / "rank1.jsonl")]

    def test_an_unreadable_trace_exits_2(self, tmp_path, capsys):
        (tmp_path / "rank0.jsonl").write_text("{not json\n")
        assert main(["trace", "export", str(tmp_path)]) == 2
        assert capsys.readouterr().err.startswith("graphflow trace export: ")

    def test_an_unwritable_file_exits_2(self, tmp_path, capsys):
        write(tmp_path, ranks=1)
        assert main(["trace", "export", str(tmp_path), "-o", str(tmp_path / "no" / "such" / "t.json")]) == 2
        assert "cannot write" in capsys.readouterr().err
