"""A trace that cannot be written never undoes a capture: it is marked incomplete instead.

The trace is a record of the capture, not a part of it: a full disk or a dead mount
under the trace file leaves every graph that captured fine in place. The tracer warns
once, naming the file and the error, counts the events it could not write, and at
close ends the file (when it still can) with one record saying so; ``graphflow trace
diff`` then compares an incomplete trace only as far as it was written.
"""

from __future__ import annotations

import errno
import json
import os
import warnings

import pytest

from graphflow.cli import main
from graphflow.engine import RunOptions
from graphflow.session import Session
from graphflow.dist.trace import (INCOMPLETE, TraceLog, Tracer, TraceWriteWarning, diff_traces, incomplete,
                             read_trace)
from plans.toy_model import toy_plan
from tests.disk_full import Failing

CPU = RunOptions(backend="cpu", detectors=False)
FULL_DISK = "/dev/full"


class FullAtTheEnd:
    """The tracer's file, on a disk that is full by the time the pipeline ends: the
    final flush (after ``pipeline_end``) fails, every earlier one reached the disk."""

    def __init__(self, file):
        self.file, self.ended = file, False

    def write(self, data: bytes) -> int:
        self.ended = self.ended or b'"pipeline_end"' in data
        return self.file.write(data)

    def flush(self) -> None:
        if self.ended:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.file.flush()

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.fixture
def filling(monkeypatch):
    """Every tracer's file fills up at its ``after``-th write."""
    def install(after: int) -> None:
        real = Tracer._open
        monkeypatch.setattr(Tracer, "_open", lambda self: Failing(real(self), after))

    return install


def capture(trace) -> tuple[Session, object, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        session = Session(toy_plan(2, sizes=(1, 2)), CPU, trace=str(trace))
        engine = session.capture()
        graphs = engine.report.graphs
        session.close()
    return session, graphs, [w for w in caught if issubclass(w.category, TraceWriteWarning)]


@pytest.mark.skipif(not os.path.exists(FULL_DISK), reason="needs Linux's /dev/full")
def test_a_full_disk_under_the_trace_leaves_the_capture_committed(tmp_path):
    link = tmp_path / "rank0.jsonl"
    link.symlink_to(FULL_DISK)
    session, graphs, warned = capture(link)
    assert graphs > 0
    tracer = session.tracer
    assert tracer.incomplete and tracer.lost == session.channels.log.counter
    assert len(warned) == 1, [str(w.message) for w in warned]
    message = str(warned[0].message)
    assert str(link) in message and "No space left on device" in message and "incomplete" in message


def test_the_trace_ends_with_a_record_of_what_it_lost(tmp_path, filling):
    filling(after=3)
    session, graphs, warned = capture(tmp_path)
    assert graphs > 0 and len(warned) == 1
    events = read_trace(tmp_path / "rank0.jsonl")
    record = incomplete(events)
    assert record is not None and events[-1] is record and record["event"] == INCOMPLETE
    written = events[:-1]
    assert [e["n"] for e in written] == list(range(len(written)))  # whole events, in order, none torn
    assert len(written) + record["lost"] == session.channels.log.counter
    assert record["lost"] == session.tracer.lost > 0
    assert "[Errno 28] No space left on device" in record["error"]


def test_a_failed_final_flush_keeps_every_graph_and_every_event_flushed_before(tmp_path, monkeypatch):
    real = Tracer._open
    monkeypatch.setattr(Tracer, "_open", lambda self: FullAtTheEnd(real(self)))
    session, graphs, warned = capture(tmp_path)
    assert graphs > 0 and len(warned) == 1
    events = read_trace(tmp_path / "rank0.jsonl")
    *written, record = events
    assert record["event"] == INCOMPLETE and record["lost"] >= 1
    assert written[-1]["event"] == "phase_end" and written[-1]["phase"] == "commit"
    assert len(written) + record["lost"] == session.channels.log.counter


def test_the_tracer_warns_once_and_counts_every_event_after_the_failure(tmp_path, filling):
    filling(after=2)
    tracer = Tracer(tmp_path, 0)
    log = TraceLog(0, tracer)
    with pytest.warns(TraceWriteWarning, match=r"rank0\.jsonl.*No space left on device") as caught:
        for i in range(5):
            log.record({"event": "x", "i": i})
            tracer.flush()
        tracer.close()
    assert len([w for w in caught if issubclass(w.category, TraceWriteWarning)]) == 1
    events = read_trace(tmp_path / "rank0.jsonl")
    assert [e["i"] for e in events[:-1]] == [0] and events[-1]["lost"] == 4 == tracer.lost


def test_a_trace_that_cannot_be_opened_is_lost_whole(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    tracer = Tracer(blocker / "rank0.jsonl", 0)
    with pytest.warns(TraceWriteWarning, match="not-a-directory"):
        tracer.write({"event": "x"})
        tracer.close()
    assert tracer.lost == 1 and tracer.incomplete


def test_the_vllm_plugins_session_keeps_crossing_boundaries_on_a_full_disk(tmp_path, filling):
    from graphflow.integrations.vllm.plugin import _trace_state
    from graphflow.integrations.vllm.session import CaptureSession

    filling(after=2)
    tracer = Tracer(tmp_path, 0)
    session = CaptureSession(rank=0, world=(0,), log=TraceLog(0, tracer))
    with pytest.warns(TraceWriteWarning, match="No space left on device"):
        for descriptor in ("PIECEWISE(tokens=8)", "FULL(tokens=1)"):
            with session.at(descriptor=descriptor, phase="capture"):
                session.boundary("phase_begin")
                session.boundary("phase_end")
        session.flush()
        tracer.close()
    assert session.failed is None and tracer.lost == 3
    assert _trace_state(tracer) == f"; trace {tracer.path} incomplete, 3 events lost"
    assert [e["event"] for e in read_trace(tracer.path)] == ["phase_begin", INCOMPLETE]


class TestDiff:
    def _trace(self, rank, count, lost=None):
        events = [{"rank": rank, "n": i, "event": "phase_begin", "phase": f"p{i}"} for i in range(count)]
        if lost is not None:
            events.append({"rank": rank, "event": INCOMPLETE, "lost": lost, "error": "[Errno 28] No space left"})
        return events

    def test_an_incomplete_trace_is_compared_only_as_far_as_it_was_written(self):
        assert diff_traces([self._trace(0, 10), self._trace(1, 4, lost=6)]) is None

    def test_a_difference_inside_what_was_written_is_still_found(self):
        odd = self._trace(1, 4, lost=6)
        odd[2]["phase"] = "elsewhere"
        found = diff_traces([self._trace(0, 10), odd])
        assert (found.index, found.differing) == (2, (1,))

    def test_a_complete_trace_that_ends_early_still_differs(self):
        found = diff_traces([self._trace(0, 3), self._trace(1, 6, lost=2), self._trace(2, 6)])
        assert (found.index, found.differing, found.events[0]) == (3, (0,), None)

    def test_trace_diff_says_the_trace_is_incomplete_instead_of_naming_a_divergence(self, tmp_path, capsys):
        for rank, trace in enumerate((self._trace(0, 10), self._trace(1, 4, lost=6))):
            (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in trace))
        assert main(["trace", "diff", str(tmp_path)]) == 2
        out = capsys.readouterr().out
        assert "differ" not in out
        assert out.splitlines()[0] == ("rank 1's trace is incomplete (6 events lost: [Errno 28] No space left): "
                                       "the traces agree on the 4 events every trace holds; after that they "
                                       "cannot be compared")

    def test_export_marks_the_rank_incomplete_not_stalled_or_diverged(self, tmp_path, capsys):
        whole = [*self._trace(0, 10), {"rank": 0, "n": 10, "event": "pipeline_end"}]
        for rank, trace in enumerate((whole, self._trace(1, 4, lost=6))):
            (tmp_path / f"rank{rank}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in trace))
        assert main(["trace", "export", str(tmp_path)]) == 0
        document = json.loads(capsys.readouterr().out)
        names = {e["pid"]: e["args"]["name"] for e in document["traceEvents"] if e["name"] == "process_name"}
        assert names == {0: "rank 0", 1: "rank 1 — trace incomplete: 6 event(s) lost ([Errno 28] No space left)"}
        assert "first_divergence" not in document["otherData"]
