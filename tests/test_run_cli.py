"""``graphflow run``: end to end on the CPU backend, its report, and every exit status."""

from __future__ import annotations

import io
import json
import re

import pytest

import torch

from graphflow.cli import main
from graphflow.events import Event, EventKind, Phase
from graphflow.plan import Descriptor, Mode
from graphflow.view.progress import ProgressDisplay
from graphflow.units import format_bytes
from tests.torch_loads import before_torch

TOY = "plans/toy.yaml"
#: ``graphflow run``'s first line on the toy plan.
STARTING = "run: plans/toy.yaml (toy-piecewise): loading torch, then building the model"


def run(capsys, *argv):
    status = main(["run", *argv])
    out, err = capsys.readouterr()
    return status, out, err


class TestFirstLine:
    """A command says what it starts before the seconds of loading torch and the model
    (13 s before any line, on a busy 2-core machine), terminal or not."""

    def test_run_says_what_it_runs_before_torch_loads(self):
        assert before_torch("graphflow", "run", TOY, "--steps", "0") == [STARTING]

    def test_as_json_it_is_a_json_line(self):
        (line,) = before_torch("graphflow", "run", TOY, "--steps", "0", "--json")
        assert json.loads(line) == {"event": "starting", "plan": "toy-piecewise", "file": TOY, "message": STARTING}

    def test_quiet_says_nothing(self):
        assert before_torch("graphflow", "run", TOY, "--steps", "0", "--quiet") == []


class TestOnce:
    def test_the_backend_is_built_once_and_the_plan_validated_once(self, monkeypatch, capsys, tmp_path):
        """Building a backend loads its runtime (CUDA's context) and validating a 61-layer
        plan takes tens of milliseconds: a run does each once, the command line's early
        checks and the pipeline sharing them."""
        from graphflow.engine.backend import BACKENDS, BackendKind, CpuBackend
        from graphflow.plan import rules

        built, reports = [], []

        class Counted(CpuBackend):
            def __init__(self):
                built.append(self)
                super().__init__()

        class Report(rules.Report):
            def __init__(self, *args, **kwargs):
                reports.append(args)
                super().__init__(*args, **kwargs)

        monkeypatch.setitem(BACKENDS, BackendKind.CPU, Counted)
        monkeypatch.setattr(rules, "Report", Report)
        status, out, err = run(capsys, TOY, "--backend", "cpu", "--steps", "0", "--quiet",
                               "--report", str(tmp_path / "report.json"))
        assert status == 0, err
        assert (len(built), len(reports)) == (1, 1)


class TestSuccess:
    def test_toy_plan_end_to_end_with_the_text_report(self, capsys):
        status, out, err = run(capsys, TOY, "--steps", "2")
        assert status == 0
        lines = out.splitlines()
        assert lines[0] == "plan toy-piecewise (plans/toy.yaml), backend cpu"
        assert lines[1] == ("  no CUDA graph was captured: the CPU backend runs every phase and replays each "
                            "region eagerly")
        assert lines[2] == "  device cuda:0 mapped to cpu"
        assert lines[4].split() == ["phase", "outcome", "seconds"]
        assert [line.split()[:2] for line in lines[6:12]] == [
            ["allocate", "passed"], ["warmup", "passed"], ["prewarm", "skipped"], ["capture", "passed"],
            ["verify", "passed"], ["commit", "passed"]]
        # No graph exists on the CPU backend: no graph count, no pool, no speed-up column.
        assert lines[13] == "static buffers 9.0 KiB"
        assert lines[15].split() == ["descriptor", "verify", "eager", "ms", "replay", "ms", "note"]
        rows = [line.split(None, 4) for line in lines[17:21]]
        assert [row[:2] for row in rows] == [["PIECEWISE(B=8)", "bit-exact"], ["PIECEWISE(B=4)", "bit-exact"],
                                             ["PIECEWISE(B=2)", "bit-exact"], ["PIECEWISE(B=1)", "bit-exact"]]
        # --steps given: the smallest, median and largest size are timed, each saying it is no graph's.
        assert [row[2:] for row in rows if row[2] != "-"] == [
            row[2:4] + ["no graph: the CPU backend replays the calls"] for row in (rows[0], rows[1], rows[3])]
        assert rows[2][2:] == ["-", "-"]
        # Where the time outside capture went: before it (the plan, torch, the backend) and timing after it.
        assert re.fullmatch(r"capture \d+\.\d\d s; total \d+\.\d\d s, reading the plan and timing included: "
                            r"before capture \d+\.\d\d s \(the plan \d+\.\d\d s, loading torch \d+\.\d\d s, "
                            r"the backend \d+\.\d\d s\), timing \d+\.\d\d s", lines[-2])
        assert lines[-1].startswith("ok: toy-piecewise: 4 descriptors, no graph captured (CPU backend: regions "
                                    "replayed eagerly), in ")
        assert lines[-1].endswith(" s on cpu; verify 4/4 bit-exact against the eager step")
        assert "Traceback" not in err

    def test_json_report(self, capsys):
        status, out, _ = run(capsys, "plans/toy_full.yaml", "--json", "--steps", "2", "--no-detectors")
        assert status == 0
        doc = json.loads(out)
        assert (doc["ok"], doc["backend"], doc["graphs_captured"], doc["graphs"]) == (True, "cpu", False, 0)
        assert doc["remapped"] == {"cuda:0": "cpu"}
        assert [p["phase"] for p in doc["phases"]] == ["allocate", "warmup", "prewarm", "capture", "verify", "commit"]
        assert [(d["mode"], d["size"]) for d in doc["descriptors"]] == [
            ("PIECEWISE", 8), ("PIECEWISE", 4), ("PIECEWISE", 2), ("PIECEWISE", 1),
            ("FULL", 8), ("FULL", 4), ("FULL", 2), ("FULL", 1)]
        assert all(d["verify"]["bit_exact"] for d in doc["descriptors"])
        # The sample: the smallest, median and largest size of each mode.
        assert [(d["mode"], d["size"]) for d in doc["descriptors"] if d["eager_ms"] and d["graph_ms"]] == [
            ("PIECEWISE", 8), ("PIECEWISE", 4), ("PIECEWISE", 1), ("FULL", 8), ("FULL", 4), ("FULL", 1)]
        # The total's time outside capture, said: before it and timing after it, each within the total.
        setup = doc["setup"]
        assert set(setup) == {"plan_s", "torch_s", "backend_s"} and all(v >= 0 for v in setup.values())
        assert sum(setup.values()) <= doc["setup_s"]
        assert doc["timing_s"] > 0
        assert doc["setup_s"] + doc["capture_s"] + doc["timing_s"] <= doc["total_s"]

    def test_json_progress_lines_on_stderr(self, capsys):
        status, out, err = run(capsys, "plans/toy_full.yaml", "--json", "--steps", "1", "--no-detectors")
        assert status == 0 and json.loads(out)["ok"]
        lines = [json.loads(line) for line in err.splitlines()]
        assert [line["event"] for line in lines[:4]] == ["starting", "allocate_begin", "allocate_end",
                                                         "descriptor_begin"]
        assert lines[3]["descriptor"] == "PIECEWISE(B=8)" and (lines[3]["index"], lines[3]["total"]) == (1, 8)
        timed = [line for line in lines if line["event"] == "timed"]
        assert [(t["descriptor"], t["index"], t["total"]) for t in timed] == [
            ("PIECEWISE(B=1)", 1, 6), ("PIECEWISE(B=4)", 2, 6), ("PIECEWISE(B=8)", 3, 6), ("FULL(B=1)", 4, 6),
            ("FULL(B=4)", 5, 6), ("FULL(B=8)", 6, 6)]
        assert all(t["elapsed_s"] >= 0 and t["estimate_s"] >= 0 and "no graph" in t["message"] for t in timed)

    def test_the_cpu_backend_times_nothing_unless_asked(self, capsys):
        status, out, err = run(capsys, TOY, "--json", "--no-detectors")
        doc = json.loads(out)
        assert status == 0 and doc["graphs"] == 0 and doc["graphs_captured"] is False
        assert all(d["eager_ms"] is None for d in doc["descriptors"])
        assert "timing" not in err

    def test_time_all_times_every_descriptor(self, capsys):
        status, out, _ = run(capsys, TOY, "--json", "--time-all", "--no-detectors")
        assert status == 0
        assert all(d["eager_ms"] > 0 for d in json.loads(out)["descriptors"])

    def test_eager_runs_keep_to_the_budget_unless_steps_says(self, capsys, monkeypatch):
        # A budget no step fits: by default each eager step is timed once, and the report
        # says so; --steps 2 runs every step twice whatever the budget.
        from graphflow.cli import capture_report

        monkeypatch.setattr(capture_report, "EAGER_BUDGET_S", 0.0)
        status, out, err = run(capsys, TOY, "--time-all", "--no-detectors")
        assert status == 0
        assert "timing: 4 descriptors, 3 replays each and up to 3 eager steps within 0 s" in err
        assert ("timed: each eager time the median of 1 run(s), each replayed one of 3 (an eager step is run again "
                "only while its runs stay within 0 s; --steps N runs every step N times)") in out
        status, out, _ = run(capsys, TOY, "--json", "--steps", "2", "--no-detectors")
        timed = [d for d in json.loads(out)["descriptors"] if d["eager_ms"] is not None]
        assert status == 0 and timed and {(d["eager_runs"], d["graph_runs"]) for d in timed} == {(2, 2)}

    def test_heartbeat_lines_when_stderr_is_not_a_terminal(self, capsys, monkeypatch):
        """A factory slower than the heartbeat: the interval made small, the factory a little slower."""
        import functools
        import time as clock

        import graphflow.view.progress as progress

        monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
        monkeypatch.syspath_prepend("plans")
        import toy_model as toy

        build = toy.build_toy

        @functools.wraps(build)
        def slow(*args, **kwargs):
            clock.sleep(0.4)
            return build(*args, **kwargs)

        monkeypatch.setattr(toy, "build_toy", slow)
        status, _, err = run(capsys, TOY, "--no-detectors")
        assert status == 0
        lines = err.splitlines()
        assert lines[:2] == [STARTING, "allocate: building the model, streams and static buffers"]
        assert re.fullmatch(r"allocate: still building the model, streams and static buffers, \d+\.\d s", lines[2])
        assert any(line.startswith("allocate: done in ") for line in lines[3:])

    def test_quiet_prints_only_the_result_line(self, capsys):
        status, out, err = run(capsys, TOY, "--quiet", "--steps", "0", "--no-detectors")
        assert status == 0
        assert len(out.splitlines()) == 1 and out.startswith("ok: toy-piecewise: 4 descriptors")
        assert err == ""

    def test_sizes_and_no_verify(self, capsys):
        status, out, _ = run(capsys, TOY, "--sizes", "1,2", "--no-verify", "--json", "--steps", "0",
                             "--no-detectors")
        doc = json.loads(out)
        assert status == 0
        assert [(d["size"], d["verify"], d["eager_ms"]) for d in doc["descriptors"]] == [(2, None, None),
                                                                                       (1, None, None)]
        assert doc["phases"][4] == {"phase": "verify", "outcome": "skipped", "seconds": doc["phases"][4]["seconds"]}
        assert doc["result"].endswith("; not verified")


class TestFailure:
    def test_unreadable_plan_exits_2_with_file_and_line(self, capsys, tmp_path):
        bad = tmp_path / "bad.yaml"
        bad.write_text("graphflow: 1\nname: x\nsegments: [\n")
        status, out, err = run(capsys, str(bad))
        assert status == 2 and out == ""
        assert err.startswith(f"graphflow: {bad}:")

    def test_validation_errors_exit_1_before_any_capture(self, capsys, tmp_path):
        plan = tmp_path / "invalid.yaml"
        plan.write_text(open(TOY).read().replace('reads: ["m{layer}", x]', 'reads: ["m{layer}", y]'))
        status, out, err = run(capsys, str(plan))
        assert status == 1 and out == ""
        assert "'y'" in err
        assert err.splitlines()[-1].startswith(f"graphflow: {plan}: ")

    def test_capture_failure_exits_1_with_the_rolled_back_error(self, capsys, tmp_path, monkeypatch):
        monkeypatch.syspath_prepend("plans")  # toy_model, which the plan copied to tmp_path names
        plan = tmp_path / "broken.yaml"
        plan.write_text(open(TOY).read().replace('call: "layers.{layer}.post"', 'call: head'))
        status, out, err = run(capsys, str(plan), "--no-detectors")
        assert status == 1 and out == ""
        progress, error = err.splitlines()[-2:]
        assert progress.startswith("warmup: failed, rolled back (RuntimeError: The size of tensor a (32) must match")
        assert error.startswith("graphflow: capture failed, rolled back: [phase=warmup descriptor=PIECEWISE(B=8) "
                                "segment=L0.post rank=0] RuntimeError: The size of tensor a (32) must match")
        assert re.search(r"— the step fails when run eagerly: fix the segment, or run it without graphflow to "
                         r"debug \(at plans/toy_model\.py:\d+\)$", error)  # the model's line that raised
        assert "Traceback" not in err

    def test_lazy_is_ready_before_the_descriptors_are_captured_and_reports_them_all(self, capsys):
        status, out, err = run(capsys, TOY, "--lazy", "--json", "--steps", "0")
        doc = json.loads(out)
        assert status == 0 and doc["ok"]
        assert 0 < doc["ready_s"] <= doc["capture_s"]
        assert [(d["size"], d["verify"]["bit_exact"]) for d in doc["descriptors"]] == [(8, True), (4, True),
                                                                                        (2, True), (1, True)]
        assert {p["phase"]: p["outcome"] for p in doc["phases"]}["capture"] == "passed"

    def test_lazy_progress_shows_the_background_capture(self, capsys):
        status, out, err = run(capsys, TOY, "--lazy", "--steps", "0")
        assert status == 0
        lines = err.splitlines()
        assert lines[0] == STARTING and lines[3] == "warmup: PIECEWISE(B=8) started (1/4), 0.0 s"
        assert lines[4].startswith("capture: PIECEWISE(B=8) started (1/4)"), "the largest, before ready"
        assert re.fullmatch(r"ready in \d+\.\d\d s: serving on 1 descriptor\(s\) while 3 more are captured in the "
                            r"background", lines[5])
        assert lines[-1].startswith("captured 4 PIECEWISE descriptors (16 regions) in ")
        assert re.search(r"^ready \d+\.\d\d s \(serving on the largest descriptor\), all descriptors live after ",
                         out, re.M)

    def test_lazy_exits_1_naming_a_descriptor_that_failed_in_the_background(self, capsys, tmp_path, monkeypatch):
        import functools
        import threading

        monkeypatch.syspath_prepend("plans")  # the module the plan names, as the CLI imports it
        import toy_model as toy

        build = toy.build_toy

        @functools.wraps(build)  # the plan's model keeps its signature: it is offered what it takes
        def failing_at_two(*args, **kwargs):
            model = build(*args, **kwargs)
            head = model.head

            def head_at_two(x, logits):
                if x.shape[0] == 2 and threading.current_thread().name == "graphflow-background-capture":
                    raise RuntimeError("head breaks at B=2")
                head(x, logits)

            model.head = head_at_two
            return model

        monkeypatch.setattr(toy, "build_toy", failing_at_two)
        status, out, err = run(capsys, TOY, "--lazy", "--no-detectors")
        assert status == 1 and out == ""
        assert err.splitlines()[-1].startswith("graphflow: capture failed, rolled back: [phase=capture "
                                               "descriptor=PIECEWISE(B=2) segment=head rank=0] RuntimeError: head "
                                               "breaks at B=2")

    def test_lazy_under_torchrun_exits_2(self, capsys, monkeypatch):
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        status, _, err = run(capsys, TOY, "--lazy")
        assert status == 2 and "--lazy serves one process" in err

    def test_capture_failure_as_json(self, capsys, tmp_path):
        plan = tmp_path / "missing_call.yaml"
        plan.write_text(open(TOY).read().replace('call: head', 'call: tail'))
        status, out, err = run(capsys, str(plan), "--json")
        doc = json.loads(out)
        assert status == 2  # a call the model does not have: the plan is wrong, as for one that cannot be read
        assert doc["ok"] is False
        assert (doc["error"]["phase"], doc["error"]["segment"]) == ("allocate", "head")

    @pytest.mark.parametrize("argv,message", [
        (["--sizes", "1,x"], "graphflow: --sizes: expected comma-separated integers (got '1,x')"),
        (["--sizes", "3"], "graphflow: sizes [3] are not among the plan's sizes [1, 2, 4, 8]"),
        (["--disable-check", "hostsync"], "graphflow: --disable-check: unknown check 'hostsync': the checks are "),
    ])
    def test_bad_arguments_exit_2(self, capsys, argv, message):
        status, _, err = run(capsys, TOY, *argv)
        assert status == 2 and err.splitlines()[-1].startswith(message)

    def test_cuda_backend_without_a_gpu_exits_2(self, capsys):
        import torch

        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        status, _, err = run(capsys, TOY, "--backend", "cuda")
        assert status == 2
        assert err == (f"{STARTING}\ngraphflow: --backend cuda: the cuda backend needs a CUDA GPU, and torch sees none "
                       "— use the cpu backend (--backend cpu) or auto (--backend auto)\n")


class TestProgressDisplay:
    def _events(self):
        """Two descriptors, each warmed, captured (one region each) and verified."""
        events = [Event(EventKind.PIPELINE_BEGIN, total=2), Event(EventKind.PHASE_BEGIN, phase=Phase.ALLOCATE),
                  Event(EventKind.PHASE_END, phase=Phase.ALLOCATE, elapsed_s=0.5)]
        for index, size in enumerate((2, 1), 1):
            d = Descriptor(Mode.PIECEWISE, size)
            for phase in (Phase.WARMUP, Phase.CAPTURE, Phase.VERIFY):
                events.append(Event(EventKind.DESCRIPTOR_BEGIN, phase=phase, descriptor=d, index=index, total=2))
                if phase is Phase.CAPTURE:
                    events.append(Event(EventKind.REGION_END, phase=phase, descriptor=d, region="target:a"))
                events.append(Event(EventKind.DESCRIPTOR_END, phase=phase, descriptor=d, index=index, total=2,
                                    elapsed_s=0.125, pool_bytes=2048 if phase is Phase.CAPTURE else None))
        events.append(Event(EventKind.PIPELINE_END, total=2, pool_bytes=2048))
        return events

    def test_plain_lines_per_descriptor_when_not_a_terminal(self):
        out = io.StringIO()
        display = ProgressDisplay(file=out, force_terminal=False, interval_s=0)
        for event in self._events():
            display.on_event(event)
        lines = out.getvalue().splitlines()
        assert lines[:2] == ["allocate: building the model, streams and static buffers", "allocate: done in 0.50 s"]
        assert re.fullmatch(r"warmup: PIECEWISE\(B=2\) started \(1/2\), \d+\.\d s", lines[2])
        assert re.fullmatch(r"captured 1/2: PIECEWISE\(B=2\), 1 graph, \d+\.\d s, pool 2\.0 KiB, about \d+ s left",
                            lines[3])
        assert re.fullmatch(r"warmup: PIECEWISE\(B=1\) started \(2/2\), \d+\.\d s, about \d+ s left", lines[4])
        assert re.fullmatch(r"captured 2/2: PIECEWISE\(B=1\), 2 graphs, \d+\.\d s, pool 2\.0 KiB", lines[5])
        assert lines[6] == "captured 2 PIECEWISE descriptors (2 graphs) in 0.8 s, pool 2.0 KiB"

    def test_lines_are_throttled_but_the_last_descriptor_always_says_so(self):
        out = io.StringIO()
        display = ProgressDisplay(file=out, force_terminal=False, interval_s=3600)
        for event in self._events():
            display.on_event(event)
        assert [line.split(":")[0] for line in out.getvalue().splitlines()] == [
            "allocate", "allocate", "warmup", "captured 2/2", "captured 2 PIECEWISE descriptors (2 graphs) in 0.8 s, pool 2.0 KiB"]

    def test_the_cpu_backend_says_regions_and_no_pool(self):
        out = io.StringIO()
        display = ProgressDisplay(file=out, force_terminal=False, graphs=False)
        for event in self._events():
            display.on_event(event)
        assert out.getvalue().splitlines()[-1] == "captured 2 PIECEWISE descriptors (2 regions) in 0.8 s"

    def test_live_bar_on_a_terminal(self):
        out = io.StringIO()
        display = ProgressDisplay(file=out, force_terminal=True)
        for event in self._events():
            display.on_event(event)
        text = out.getvalue()
        assert "capture" in text and "2/2" in text and "2.0 KiB" in text

    def test_quiet_draws_nothing(self):
        out = io.StringIO()
        display = ProgressDisplay(file=out, quiet=True, force_terminal=True)
        for event in self._events():
            display.on_event(event)
        assert out.getvalue() == ""

    def test_rollback_is_reported(self):
        out = io.StringIO()
        ProgressDisplay(file=out, force_terminal=False).on_event(
            Event(EventKind.ROLLBACK, phase=Phase.VERIFY, error="CaptureError: mismatch"))
        assert out.getvalue() == "verify: failed, rolled back (CaptureError: mismatch)\n"

    @pytest.mark.parametrize("n,text", [(None, "n/a"), (512, "512 B"), (2048, "2.0 KiB"), (3 << 30, "3.0 GiB")])
    def test_sizes_in_binary_units_and_an_unknown_pool_as_n_a(self, n, text):
        assert format_bytes(n) == text


#: A plan with one channel used by both segments of its one region (world size 1: the
#: all-reduce is the identity). The factory is put on ``plans.toy_model`` by the fixture.
CHANNEL_PLAN = """\
graphflow: 1
name: toy-channel
model: "plans.toy_model:channel_model_for_test"
symbols: {B: [1, 2]}
streams:
  s0: {device: "cuda:0"}
buffers:
  x: {shape: [B, 4], dtype: float32, device: "cuda:0", role: input}
  h: {shape: [B, 4], dtype: float32, device: "cuda:0"}
  y: {shape: [B, 4], dtype: float32, device: "cuda:0", role: output}
channels:
  tp_ar: {kind: all_reduce, group: tp, id: 1, family: target, warmup: real}
segments:
  - {name: scale, kind: graph, call: scale, stream: s0, reads: [x], writes: [h], channels: [tp_ar]}
  - {name: shift, kind: graph, call: shift, stream: s0, reads: [h], writes: [y], channels: [tp_ar]}
capture:
  modes: [PIECEWISE]
  sizes: B
  warmup_iters: 1
"""


class ChannelModel:
    """Both segments all-reduce on ``tp_ar`` through the handles the engine offers."""

    def __init__(self, channels):
        self.channels = channels

    def scale(self, x, h):
        torch.mul(x, 2.0, out=h)
        self.channels["tp_ar"].all_reduce(h)

    def shift(self, h, y):
        torch.add(h, 1.0, out=y)
        self.channels["tp_ar"].all_reduce(y)


@pytest.fixture
def channel_plan(tmp_path, monkeypatch):
    import plans.toy_model

    built = []

    def factory(channels):
        built.append(channels)
        return ChannelModel(channels)

    monkeypatch.setattr(plans.toy_model, "channel_model_for_test", factory, raising=False)
    monkeypatch.delenv("GRAPHFLOW_TRACE", raising=False)
    path = tmp_path / "channel.yaml"
    path.write_text(CHANNEL_PLAN)
    return path, built


class TestTrace:
    def test_trace_dir_gets_rank0_and_two_runs_trace_the_same_events(self, capsys, tmp_path):
        from graphflow.dist.trace import read_trace

        for name in ("a", "b"):
            status, out, _ = run(capsys, TOY, "--trace", str(tmp_path / name), "--json", "--steps", "0",
                                 "--no-detectors")
            assert status == 0
            assert json.loads(out)["trace"] == str(tmp_path / name / "rank0.jsonl")
        events = read_trace(tmp_path / "a" / "rank0.jsonl")
        assert (events[0]["event"], events[-1]["event"]) == ("pipeline_begin", "pipeline_end")
        assert {e["phase"] for e in events if e["event"] == "phase_begin"} == {
            "allocate", "warmup", "prewarm", "capture", "verify", "commit"}
        status = main(["trace", "diff", str(tmp_path / "a" / "rank0.jsonl"), str(tmp_path / "b" / "rank0.jsonl")])
        out, _ = capsys.readouterr()
        assert status == 0
        assert out.startswith(f"2 traces agree: {len(events)} events each")

    def test_the_text_report_names_the_trace_file(self, capsys, tmp_path):
        status, out, _ = run(capsys, TOY, "--trace", str(tmp_path), "--steps", "0", "--no-detectors")
        assert status == 0
        assert f"trace {tmp_path / 'rank0.jsonl'}" in out.splitlines()

    def test_a_channel_plan_traces_each_collective_with_its_segment(self, capsys, tmp_path, channel_plan):
        from graphflow.dist.trace import read_trace

        path, built = channel_plan
        status, out, err = run(capsys, str(path), "--trace", str(tmp_path / "t"), "--quiet", "--steps", "0")
        assert status == 0, err
        assert list(built[0]) == ["tp_ar"]  # the factory got the runtime's handles
        calls = [(e["phase"], e["descriptor"], e["segment"], e["path"])
                 for e in read_trace(tmp_path / "t" / "rank0.jsonl") if e["event"] == "collective"]
        # per descriptor: warmup and capture name the segment (the first descriptor warms up
        # twice: the host-state check reads a second step of a channel plan); the replay in
        # verify is one call per region on the CPU backend, so which segment called cannot be told
        steps = {2: (("warmup", "eager_warmup"),) * 2 + (("capture", "captured"),),
                 1: (("warmup", "eager_warmup"), ("capture", "captured"))}
        assert [c for c in calls if c[0] != "verify"] == [
            (phase, f"PIECEWISE(B={size})", segment, path) for size in (2, 1)
            for phase, path in steps[size] for segment in ("scale", "shift")]
        assert {(c[0], c[3]) for c in calls if c[0] == "verify"} == {("verify", "outside_capture")}

    def test_without_the_flag_a_channel_plan_honours_graphflow_trace(self, capsys, tmp_path, channel_plan,
                                                                      monkeypatch):
        path, built = channel_plan
        monkeypatch.setenv("GRAPHFLOW_TRACE", str(tmp_path / "env"))
        status, out, _ = run(capsys, str(path), "--json", "--steps", "0")
        assert status == 0
        assert json.loads(out)["trace"] == str(tmp_path / "env" / "rank0.jsonl")
        assert (tmp_path / "env" / "rank0.jsonl").stat().st_size > 0

    def test_without_the_flag_or_the_variable_nothing_is_traced(self, capsys, tmp_path, channel_plan):
        path, built = channel_plan
        status, out, _ = run(capsys, str(path), "--json", "--steps", "0")
        assert status == 0
        assert "trace" not in json.loads(out) and list(built[0]) == ["tp_ar"]

    def test_a_trace_dir_that_cannot_be_made_exits_2(self, capsys, tmp_path):
        blocker = tmp_path / "file"
        blocker.write_text("")
        status, out, err = run(capsys, TOY, "--trace", str(blocker / "dir"))
        assert (status, out) == (2, "")
        assert err == f"graphflow: --trace {blocker / 'dir'}: cannot write there: Not a directory\n"


class TestModule:
    DSV4 = "graphflow.integrations.dsv4:build_model"

    def test_a_decorated_models_step_runs_end_to_end(self, capsys):
        status, out, err = run(capsys, "--module", self.DSV4, "--step", "piecewise_step", "--sizes", "1,2",
                               "--backend", "cpu", "--json", "--steps", "0")
        assert status == 0, err
        doc = json.loads(out)
        assert (doc["plan"], doc["file"], doc["ok"]) == ("dsv4-mini-piecewise", self.DSV4, True)
        assert [(d["mode"], d["size"], d["verify"]["bit_exact"]) for d in doc["descriptors"]] == [
            ("PIECEWISE", 2, True), ("PIECEWISE", 1, True)]

    def test_the_text_report_names_the_module(self, capsys):
        status, out, err = run(capsys, "--module", self.DSV4, "--step", "piecewise_step", "--sizes", "1",
                               "--backend", "cpu", "--steps", "0", "--no-verify")
        assert status == 0, err
        assert out.splitlines()[0] == f"plan dsv4-mini-piecewise ({self.DSV4}), backend cpu"

    def test_a_model_with_several_steps_needs_step(self, capsys):
        status, out, err = run(capsys, "--module", self.DSV4, "--sizes", "1")
        assert (status, out) == (2, "")
        assert err == ("graphflow: DSV4Model: declares 2 @graphflow.step methods (piecewise_step, full_step): "
                       "choose one with step= (graphflow CLI: --step)\n")

    @pytest.mark.parametrize("argv", [[], [TOY, "--module", DSV4]])
    def test_exactly_one_plan_source(self, capsys, argv):
        status, out, err = run(capsys, *argv)
        assert (status, out) == (2, "")
        assert err == "graphflow: arguments: give a plan file or --module PKG.MOD:FACTORY (exactly one)\n"
