"""Per-rank traces: numbering, running hashes per scope, the file format, and ``trace diff``."""

from __future__ import annotations

import json

import pytest

from graphflow.cli import main
from graphflow.dist.trace import (TRACE_ENV, TraceLog, TraceReadError, Tracer, comparable, describe, diff_traces,
                             read_trace)


def _collective(channel="tp_ar", shape=(2, 4), path="captured", **extra):
    return {"event": "collective", "phase": "capture", "descriptor": "PIECEWISE(B=2)", "channel": channel,
            "op": "all_reduce", "shape": list(shape), "path": path, "capturing": False, **extra}


class TestTraceLog:
    def test_events_are_numbered_per_rank_from_zero(self):
        log = TraceLog(rank=3)
        first = log.record({"event": "phase_begin", "phase": "warmup"})
        second = log.record(_collective())
        assert (first["rank"], first["n"], second["n"], log.counter) == (3, 0, 1, 2)

    def test_equal_events_on_two_ranks_give_equal_digests(self):
        a, b = TraceLog(rank=0), TraceLog(rank=1)
        for log in (a, b):
            log.record({"event": "phase_begin", "phase": "warmup"})
            log.record(_collective())
        assert a.state().digest == b.state().digest
        assert a.state().count == 2

    def test_one_differing_field_changes_the_digest(self):
        a, b = TraceLog(rank=0), TraceLog(rank=1)
        a.record(_collective(shape=(2, 4)))
        b.record(_collective(shape=(4, 4)))
        assert a.state().digest != b.state().digest

    def test_scopes_hash_only_their_own_events(self):
        log = TraceLog(rank=0)
        log.record({"event": "phase_begin"}, scopes=("world",))
        log.record(_collective(), scopes=("ranks:0-1",))
        assert log.state("world").count == 1
        assert log.state("ranks:0-1").count == 1
        assert log.state("world").digest != log.state("ranks:0-1").digest

    def test_window_keeps_the_last_events_with_their_scope_index(self):
        log = TraceLog(rank=0, window=2)
        for i in range(5):
            log.record({"event": "x", "i": i})
        assert [(i, e["i"]) for i, e in log.state().window] == [(3, 3), (4, 4)]


class TestTracer:
    def test_directory_path_writes_one_file_per_rank(self, tmp_path):
        tracers = [Tracer(tmp_path, rank) for rank in (0, 1)]
        for rank, tracer in enumerate(tracers):
            TraceLog(rank, tracer).record(_collective())
            tracer.close()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
        event = read_trace(tmp_path / "rank1.jsonl")[0]
        assert event["rank"] == 1 and event["channel"] == "tp_ar" and "ts" in event

    def test_jsonl_path_is_the_file_itself(self, tmp_path):
        tracer = Tracer(tmp_path / "sub" / "mine.jsonl", 5)
        tracer.write({"event": "x"})
        tracer.close()
        assert read_trace(tmp_path / "sub" / "mine.jsonl") == [{"event": "x", "ts": pytest.approx(0, abs=1e12)}]

    def test_writing_after_close_appends(self, tmp_path):
        tracer = Tracer(tmp_path, 0)
        tracer.write({"event": "a"})
        tracer.close()
        tracer.write({"event": "b"})
        tracer.close()
        assert [e["event"] for e in read_trace(tmp_path / "rank0.jsonl")] == ["a", "b"]

    def test_file_opens_only_at_the_first_event(self, tmp_path):
        Tracer(tmp_path / "t", 0).close()
        assert not (tmp_path / "t").exists()

    def test_env_variable_turns_tracing_on(self, tmp_path):
        tracer = Tracer.from_env(2, {TRACE_ENV: str(tmp_path)})
        assert tracer.path == tmp_path / "rank2.jsonl"

    @pytest.mark.parametrize("env", [{}, {TRACE_ENV: ""}])
    def test_env_variable_unset_or_empty_means_off(self, env):
        assert Tracer.from_env(0, env) is None


class TestReadTrace:
    def test_missing_file_names_the_file(self, tmp_path):
        with pytest.raises(TraceReadError, match=r"nope\.jsonl: cannot read"):
            read_trace(tmp_path / "nope.jsonl")

    def test_bad_line_names_file_and_line(self, tmp_path):
        path = tmp_path / "rank0.jsonl"
        path.write_text('{"event": "x"}\n{not json\n')
        with pytest.raises(TraceReadError, match=r"rank0\.jsonl:2: not a JSON trace event"):
            read_trace(path)

    def test_non_object_line_is_rejected(self, tmp_path):
        path = tmp_path / "rank0.jsonl"
        path.write_text("[1, 2]\n")
        with pytest.raises(TraceReadError, match=r":1: not a JSON trace event: expected an object"):
            read_trace(path)


class TestDiff:
    def _trace(self, rank, events):
        return [{"rank": rank, "n": i, "ts": 100.0 + rank + i, **e} for i, e in enumerate(events)]

    def test_identical_traces_have_no_difference(self):
        events = [{"event": "phase_begin"}, _collective()]
        assert diff_traces([self._trace(r, events) for r in range(3)]) is None

    def test_rank_and_timestamps_are_ignored(self):
        assert comparable({"rank": 1, "ts": 2.0, "peer": 0, "n": 4}) == {"n": 4}

    def test_first_difference_names_the_minority(self):
        same = [{"event": "phase_begin"}, _collective("tp_ar")]
        odd = [{"event": "phase_begin"}, {"event": "descriptor_end"}]
        found = diff_traces([self._trace(0, odd), self._trace(1, same), self._trace(2, same)])
        assert (found.index, found.differing, found.majority) == (1, (0,), (1, 2))
        assert found.events[0]["event"] == "descriptor_end" and found.events[1]["channel"] == "tp_ar"

    def test_a_trace_that_ends_early_differs(self):
        events = [{"event": "phase_begin"}, _collective()]
        found = diff_traces([self._trace(0, events), self._trace(1, events[:1])])
        assert (found.index, found.events[1], found.differing) == (1, None, (1,))

    def test_describe_names_channel_shape_and_path(self):
        text = describe({"n": 7, **_collective()})
        assert text == ("#7 collective phase=capture descriptor=PIECEWISE(B=2) channel=tp_ar op=all_reduce "
                        "shape=[2, 4] path=captured capturing=False")
        assert describe(None) == "(no event: the trace ends here)"


class TestTraceDiffCommand:
    def _write(self, directory, rank, events):
        directory.mkdir(exist_ok=True)
        lines = [json.dumps({"rank": rank, "n": i, "ts": float(rank), **e}) for i, e in enumerate(events)]
        (directory / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")

    def test_agreeing_traces_exit_0(self, tmp_path, capsys):
        for rank in range(3):
            self._write(tmp_path, rank, [{"event": "phase_begin"}, _collective()])
        assert main(["trace", "diff", str(tmp_path)]) == 0
        assert capsys.readouterr().out == "3 traces agree: 2 events each (rank 0, rank 1, rank 2)\n"

    def test_differing_traces_exit_1_and_show_the_first_difference(self, tmp_path, capsys):
        common = [{"event": "descriptor_begin", "descriptor": "FULL(B=67)"}, _collective("tp_ar", path="placeholder")]
        for rank in (1, 2):
            self._write(tmp_path, rank, [*common, _collective("ep_ar", path="eager_warmup")])
        self._write(tmp_path, 0, [*common, {"event": "descriptor_end", "descriptor": "FULL(B=67)"}])
        files = [str(tmp_path / f"rank{r}.jsonl") for r in range(3)]
        assert main(["trace", "diff", *files]) == 1
        out = capsys.readouterr().out.splitlines()
        assert out[0] == "traces differ at event 2: rank 0 differs from rank 1, rank 2"
        assert ">      2  rank 0  #2 descriptor_end descriptor=FULL(B=67)" in out
        assert any(line.startswith("       2  rank 1  #2 collective") and "channel=ep_ar" in line for line in out)
        assert "       1  all     #1 collective phase=capture descriptor=PIECEWISE(B=2) channel=tp_ar op=all_reduce " \
               "shape=[2, 4] path=placeholder capturing=False" in out

    def test_unreadable_trace_exits_2(self, tmp_path, capsys):
        self._write(tmp_path, 0, [{"event": "x"}])
        assert main(["trace", "diff", str(tmp_path / "rank0.jsonl"), str(tmp_path / "missing.jsonl")]) == 2
        assert "missing.jsonl: cannot read" in capsys.readouterr().err

    def test_one_trace_is_not_enough(self, tmp_path, capsys):
        self._write(tmp_path, 0, [{"event": "x"}])
        assert main(["trace", "diff", str(tmp_path)]) == 2
        assert "at least two traces" in capsys.readouterr().err

    def test_empty_directory_exits_2(self, tmp_path, capsys):
        assert main(["trace", "diff", str(tmp_path)]) == 2
        assert "no .jsonl trace files" in capsys.readouterr().err
