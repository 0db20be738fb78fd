"""Compiled segments on the CPU: the compile settings of a plan (YAML, Python, decorators,
rules), and the engine compiling graph segments with torch.compile before capture.

The CPU backend compiles what the plan compiles (dynamo traces the same way on every
device); most tests use dynamo's ``eager`` backend, which traces and guards like
inductor without generating code, so they run in seconds. One test runs inductor
itself (C++ code on the CPU). CUDA capture of compiled segments is in
tests/cuda/test_cuda_compiled.py.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import attrs
import pytest
import torch
import yaml
from torch import nn

import graphflow
from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.model.compiled import CompileFallbackWarning
from graphflow.errors import CaptureError, FieldError, FieldValueError, PlanError
from graphflow.events import EventKind, Phase
from graphflow.engine.jit import JitRegistry
from graphflow.plan.loader import dump_plan, loads_plan
from graphflow.plan import (COMPILE_DEFAULTS, Buffer, BufferRole, CaptureSettings, Compile, Mode, Plan, Segment,
                            SegmentKind, Stream)
from graphflow.runtime import Runner
from graphflow.plan.rules import validate

ROOT = pathlib.Path(__file__).resolve().parents[1]
HIDDEN = 8


# -- the plan field --------------------------------------------------------------------------------

PLAN = """\
graphflow: 1
name: compiled
streams: {s0: {device: "cuda:0"}}
buffers:
  x: {shape: [B, 8], dtype: float32, device: "cuda:0", role: input}
  y: {shape: [B, 8], dtype: float32, device: "cuda:0"}
  z: {shape: [B, 8], dtype: float32, device: "cuda:0", role: output}
segments:
  - {name: a, kind: graph, call: a, stream: s0, reads: [x], writes: [y],
     compile: {mode: max-autotune-no-cudagraphs, options: {coordinate_descent_tuning: true}}}
  - {name: b, kind: graph, call: b, stream: s0, reads: [y], writes: [z], compile: false}
capture:
  sizes: [1, 2]
  verify: {atol: 0.001}
  compile: {backend: inductor, strict: true}
"""


class TestPlanField:
    def test_a_segment_inherits_the_plan_setting_field_by_field(self):
        plan = loads_plan(PLAN)
        a, b = plan.segments
        setting = plan.compile_of(a)
        assert setting == Compile(enabled=True, backend="inductor", mode="max-autotune-no-cudagraphs", dynamic=False,
                                  fullgraph=False, strict=True, options={"coordinate_descent_tuning": True})
        assert plan.compile_of(b) is None  # compile: false takes it out

    def test_short_forms(self):
        assert Segment("a", SegmentKind.GRAPH, "a", compile="eager").compile == Compile(backend="eager")
        assert Segment("a", SegmentKind.GRAPH, "a", compile=False).compile == Compile(enabled=False)
        assert CaptureSettings(compile=True).compile == Compile(enabled=True)
        plan = Plan("p", segments=[Segment("a", SegmentKind.GRAPH, "a")], capture=CaptureSettings(compile=True))
        assert plan.compile_of(plan.segments[0]) == COMPILE_DEFAULTS

    def test_nothing_compiles_without_a_setting_and_eager_segments_never(self):
        plan = Plan("p", segments=[Segment("a", SegmentKind.GRAPH, "a"), Segment("b", SegmentKind.EAGER, "b")])
        assert [plan.compile_of(s) for s in plan.segments] == [None, None]
        plan = attrs.evolve(plan, capture=CaptureSettings(compile="inductor"))
        assert plan.compile_of(plan.segments[0]) is not None and plan.compile_of(plan.segments[1]) is None

    def test_round_trip(self):
        plan = loads_plan(PLAN)
        assert loads_plan(dump_plan(plan)) == plan
        assert "compile: {backend: inductor, strict: true}" in dump_plan(plan)

    @pytest.mark.parametrize("bad, line, message", [
        ("compile: indctor", 15, "expected one of inductor, aot_eager, eager, got str 'indctor' (did you mean "
                                 "'inductor'?)"),
        ("compile: 3", 15, "expected a compile setting"),
        ("compile: {mode: fast}", 15, "expected one of default, reduce-overhead, max-autotune"),
        ("compile: {modes: default}", 15, "unknown key 'modes' (did you mean 'mode'?)"),
    ])
    def test_refused_values_name_the_line(self, bad, line, message):
        text = PLAN.replace("compile: {backend: inductor, strict: true}", bad)
        with pytest.raises(PlanError) as info:
            loads_plan(text, "plans/c.yaml")
        assert (info.value.file, info.value.line) == ("plans/c.yaml", line)
        assert info.value.message.startswith(message), info.value.message

    def test_python_construction_names_the_inner_field(self):
        with pytest.raises(FieldValueError, match=r"'compile.mode' must be one of default"):
            Segment("a", SegmentKind.GRAPH, "a", compile={"mode": "fast"})
        with pytest.raises(FieldValueError, match=r"'compile key' must be one of enabled, backend"):
            Segment("a", SegmentKind.GRAPH, "a", compile={"bogus": 1})
        with pytest.raises(FieldError, match=r"'compile' must be a compile setting"):
            CaptureSettings(compile=3)

    def test_the_schema_states_the_same(self):
        jsonschema = pytest.importorskip("jsonschema")
        schema = json.loads((ROOT / "graphflow" / "plan" / "schema" / "plan.schema.json").read_text())
        jsonschema.validate(yaml.safe_load(PLAN), schema)
        for bad in ({"mode": "fast"}, {"modes": "default"}, 3):
            document = yaml.safe_load(PLAN)
            document["capture"]["compile"] = bad
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(document, schema)


class TestRules:
    def codes(self, text: str) -> list[str]:
        return [d.code for d in validate(loads_plan(text)).diagnostics]

    def test_the_example_is_clean(self):
        assert self.codes(PLAN) == []

    def test_compile_on_an_eager_segment(self):
        text = PLAN.replace("kind: graph, call: b, stream: s0, reads: [y], writes: [z], compile: false",
                            "kind: eager, call: b, reads: [y], writes: [z], compile: inductor")
        diagnostic = next(d for d in validate(loads_plan(text, "p.yaml")).diagnostics if d.code == "GF701")
        assert (diagnostic.element, diagnostic.origin.line) == ("segment b", 11)

    @pytest.mark.parametrize("setting", ["{mode: reduce-overhead}", "{mode: max-autotune}",
                                         "{options: {triton.cudagraphs: true}}"])
    def test_inductors_own_cuda_graphs_are_refused(self, setting):
        text = PLAN.replace("compile: {backend: inductor, strict: true}", f"compile: {setting}")
        report = validate(loads_plan(text))
        assert report.codes() == ("GF702",) and not report.ok
        assert "captures inductor's own CUDA graphs" in report.diagnostics[0].message

    def test_bit_exact_verify_of_compiled_segments_is_a_warning(self):
        report = validate(loads_plan(PLAN.replace("verify: {atol: 0.001}", "verify: {atol: 0}")))
        assert report.codes() == ("GF703",) and report.ok
        assert "1 compiled graph segment(s) (a)" in report.diagnostics[0].message


class TestDecorators:
    def test_segment_and_step_arguments_give_the_yaml_plan(self):
        class Block(nn.Module):
            x = graphflow.buffer(shape=("B", 8), dtype="float32", device="cuda:0", role="input")
            y = graphflow.buffer(shape=("B", 8), dtype="float32", device="cuda:0")
            z = graphflow.buffer(shape=("B", 8), dtype="float32", device="cuda:0", role="output")
            s0 = graphflow.stream(device="cuda:0")

            @graphflow.segment("a", reads=["x"], writes=["y"], stream="s0",
                               compile={"mode": "max-autotune-no-cudagraphs",
                                        "options": {"coordinate_descent_tuning": True}})
            def a(self, x, y):
                y.copy_(x)

            @graphflow.segment("b", reads=["y"], writes=["z"], stream="s0", compile=False)
            def b(self, y, z):
                z.copy_(y)

            @graphflow.step(name="compiled", sizes=(1, 2), atol=1e-3, compile={"backend": "inductor", "strict": True})
            def step(self, x, y, z):
                self.a(x, y)
                self.b(y, z)

        built = graphflow.plan_from_module(Block())
        assert graphflow.plan.decorators.normalized(built) == graphflow.plan.decorators.normalized(loads_plan(PLAN))

    def test_a_bad_setting_names_the_method(self):
        class Bad(nn.Module):
            x = graphflow.buffer(shape=("B", 8), dtype="float32", device="cuda:0", role="input")
            s0 = graphflow.stream(device="cuda:0")

            @graphflow.segment("a", reads=["x"], writes=["x"], stream="s0", compile="turbo")
            def a(self, x):
                x.add_(1)

            @graphflow.step(sizes=(1,))
            def step(self, x):
                self.a(x)

        with pytest.raises(PlanError, match=r"Bad\.a.*'compile.backend' must be one of inductor"):
            graphflow.plan_from_module(Bad())


# -- the engine ---------------------------------------------------------------------------------------


class Probe(nn.Module):
    """Segments that trace cleanly, break dynamo's graph, or behave differently compiled."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5, requires_grad=False)
        self.factor = 2  # an int attribute: dynamo specializes the compiled code on its value

    def scaled(self, x, y):
        y.copy_(torch.tanh(x @ self.w) * self.factor)

    def broken(self, x, y):
        y.copy_(torch.sin(x))
        torch._dynamo.graph_break()
        y.add_(1.0)

    def marked(self, x, y):
        y.copy_(torch.cos(x))
        if torch.compiler.is_compiling():  # what only compiled code does: verify must see it
            y.add_(1e-3)

    def item(self, x, y):
        y.copy_(x * float(x.abs().sum().item() > 0))


def probe_plan(*calls: str, compile=None, segment_compile=None, sizes=(2, 1), atol=1e-3, modes=(Mode.FULL,),
               device="cuda:0"):
    """x -> b1 -> b2 ... one graph segment per call, each reading the previous buffer."""
    names = ["x"] + [f"b{i}" for i in range(1, len(calls) + 1)]
    buffers = [Buffer("x", ("B", HIDDEN), "float32", device, role=BufferRole.INPUT)]
    buffers += [Buffer(n, ("B", HIDDEN), "float32", device, role=BufferRole.OUTPUT if n == names[-1] else
                       BufferRole.INTERNAL) for n in names[1:]]
    segments = [Segment(f"s{i}", SegmentKind.GRAPH, call, reads=[names[i]], writes=[names[i + 1]], stream="s0",
                        compile=(segment_compile or {}).get(i)) for i, call in enumerate(calls)]
    return Plan("probe", buffers=buffers, streams=[Stream("s0", device)], segments=segments,
                capture=CaptureSettings(modes=modes, sizes=sizes, compile=compile, atol=atol, rtol=atol))


def run(plan, model=None, **options):
    return run_pipeline(plan, RunOptions(backend="cpu", **options), model=model if model is not None else Probe())


class TestCompiledCapture:
    def test_each_size_compiles_in_warmup_and_replay_matches_the_uncompiled_step(self):
        plan = probe_plan("scaled", "marked", compile="eager", sizes=(1, 2, 4))
        with run(plan) as engine:
            report = engine.report.compile
            first, second = report.segments
            assert (first.compiles, first.graphs, len(first.recompiles)) == (3, 3, 2)  # one per size
            assert "size mismatch" in first.recompiles[0]
            assert first.fallback is None and first.seconds > 0
            assert [r.against for r in engine.report.verify] == [("the uncompiled eager step",)] * 3
            # The compiled segment adds 1e-3 to b2: verify compared with the model's own code.
            assert all(not r.bit_exact and r.max_abs_diff == pytest.approx(1e-3, rel=1e-3)
                       for r in engine.report.verify)
            x = torch.randn(4, HIDDEN)
            (out,) = Runner(engine).run(x)
            eager = torch.cos(torch.tanh(x @ engine.model.w) * 2)
            torch.testing.assert_close(out, eager + 1e-3)

    def test_verify_fails_beyond_the_tolerance_naming_the_segment(self):
        plan = probe_plan("scaled", "marked", compile="eager", atol=1e-5)
        with pytest.raises(CaptureError) as info:
            run(plan)
        error = info.value
        assert (error.phase, error.segment) == ("verify", "s1")
        assert "differs from the uncompiled eager step in buffer 'b2'" in error.message
        assert "raise capture.verify atol/rtol" in error.hint

    def test_segments_of_one_function_share_its_compiled_code(self):
        plan = probe_plan("scaled", "scaled", "scaled", compile="eager")
        with run(plan) as engine:
            records = engine.report.compile.segments
            assert [r.compiles for r in records] == [2, 0, 0]
            assert [r.shares for r in records] == [None, "s0", "s0"] and records[1].reused
            assert "reuses the code compiled for s0" in records[1].line()
            assert "2 reuse another's code" in engine.report.compile.summary()

    def test_every_size_compiles_past_dynamos_recompile_limit(self):
        sizes = tuple(range(1, 13))  # 12 specializations; dynamo keeps 8 unless told otherwise
        with run(probe_plan("scaled", compile="eager", sizes=sizes)) as engine:
            (record,) = engine.report.compile.segments
            assert (record.compiles, record.fallback) == (12, None)

    def test_a_graph_break_is_reported(self):
        with run(probe_plan("broken", compile="eager")) as engine:
            (record,) = engine.report.compile.segments
            assert record.fallback is None and record.graph_breaks
            assert "graph_break" in record.graph_breaks[0] or "graph break" in record.graph_breaks[0].lower()
            assert record.graphs >= 2  # before and after the break

    def test_a_segment_dynamo_cannot_compile_runs_uncompiled_with_a_warning(self):
        plan = probe_plan("scaled", "broken", compile="eager", segment_compile={1: {"fullgraph": True}})
        with pytest.warns(CompileFallbackWarning, match=r"segment s1: torch.compile \(eager\) cannot compile it"):
            engine = run(plan)
        with engine:
            good, bad = engine.report.compile.segments
            assert good.fallback is None and bad.fallback is not None and not bad.compiled
            assert "uncompiled: s1" in engine.report.compile.summary()
            x = torch.randn(2, HIDDEN)
            (out,) = Runner(engine).run(x)
            torch.testing.assert_close(out, torch.sin(torch.tanh(x @ engine.model.w) * 2) + 1.0)

    def test_strict_fails_and_rolls_back(self):
        plan = probe_plan("scaled", "broken", compile={"backend": "eager", "strict": True},
                          segment_compile={1: {"fullgraph": True}})
        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)
            with pytest.raises(CaptureError) as info:
                run(plan)
        error = info.value
        assert (error.phase, error.segment) == ("warmup", "s1")
        assert "torch.compile (eager) cannot compile segment s1" in error.message
        assert "drop strict" in error.hint

    def test_the_segments_own_error_surfaces_as_it_would_uncompiled(self):
        class Failing(Probe):
            def scaled(self, x, y):
                y.copy_(x @ torch.ones(HIDDEN + 1, HIDDEN))  # a shape error, found while dynamo traces

        with warnings.catch_warnings():
            warnings.simplefilter("error", CompileFallbackWarning)
            with pytest.raises(CaptureError) as info:
                run(probe_plan("scaled", compile="eager"), Failing())
        assert info.value.phase == "warmup" and "mat1 and mat2 shapes cannot be multiplied" in str(info.value)

    def test_a_recompile_inside_capture_is_caught_by_the_tripwire(self):
        model = Probe()

        class ChangeBeforeCapture:
            def on_event(self, event):
                if event.kind is EventKind.PHASE_BEGIN and event.phase is Phase.CAPTURE:
                    model.factor = 3  # the compiled code's guard on it fails: dynamo would recompile

        plan = probe_plan("scaled", compile="eager")
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, RunOptions(backend="cpu"), model=model, listeners=[ChangeBeforeCapture()])
        error = info.value
        assert (error.phase, error.segment) == ("capture", "s0")
        assert "torch.compile recompile" in error.message and "self.factor == 2" in error.message
        assert "inside the capture of segment s0" in error.message
        assert "set compile: false on the segment" in error.hint
        # Rolled back: the compiled code is forgotten with the run.
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        assert _debug_get_cache_entry_list(Probe.scaled.__code__) == []

    def test_the_detectors_watch_the_models_code_of_a_compiled_segment(self):
        with pytest.raises(CaptureError) as info:
            run(probe_plan("item", compile="eager"))
        assert info.value.phase == "warmup" and "[host_sync] s0" in info.value.message

    def test_compile_off_runs_the_plan_uncompiled(self):
        with run(probe_plan("scaled", "marked", compile="eager", atol=0.0), compile=False) as engine:
            assert engine.report.compile is None
            assert all(r.bit_exact and r.against == ("the eager step",) for r in engine.report.verify)

    def test_the_engines_eager_step_is_the_models_own_code(self):
        with run(probe_plan("marked", compile="eager")) as engine:
            assert engine.segments[0][1].fn == engine.model.marked  # not the compiled callable
            views = engine.buffers.views(2)
            for call in engine.eager_calls(2):
                call()
            torch.testing.assert_close(views["b1"], torch.cos(views["x"]))

    def test_close_forgets_the_compiled_code(self):
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        engine = run(probe_plan("scaled", compile="eager"))
        assert _debug_get_cache_entry_list(Probe.scaled.__code__)
        engine.close()
        assert _debug_get_cache_entry_list(Probe.scaled.__code__) == []

    @pytest.mark.slow
    def test_inductor_on_the_cpu(self, tmp_path, monkeypatch):
        """Inductor's generated C++ code, captured (run) by the CPU backend; a second
        pipeline in a fresh cache directory misses, the same directory hits."""
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
        plan = probe_plan("scaled", "marked", compile="inductor", sizes=(2,))
        with run(plan) as engine:
            first = engine.report.compile
            assert first.segments[0].cache_misses > 0 and first.fell_back == ()
            assert all(r.max_abs_diff == pytest.approx(1e-3, rel=1e-2) for r in engine.report.verify)
        with run(plan) as engine:
            assert engine.report.compile.segments[0].cache_hits > 0


class TestTripwire:
    def test_installed_with_dynamo_and_removed(self):
        from torch._dynamo.callback import callback_handler

        registry = JitRegistry()
        before = list(callback_handler.start_callbacks)
        with registry.tripwires(capturing=lambda: True):
            assert len(callback_handler.start_callbacks) == len(before) + 1
            compiled = torch.compile(lambda t: t * 3, backend="eager")
            with pytest.raises(Exception) as info:
                compiled(torch.ones(3))
        assert callback_handler.start_callbacks == before
        chain, error = [], info.value
        while error is not None:
            chain.append(error)
            error = error.__cause__ or error.__context__
        refused = next(e for e in chain if isinstance(e, CaptureError))
        assert "torch.compile compile of a frame warmup never ran inside the capture" in refused.message
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))  # removed: compiles again


class TestCli:
    def plan_file(self, tmp_path) -> pathlib.Path:
        document = yaml.safe_load((ROOT / "plans" / "toy_full.yaml").read_text())
        document["model"] = "plans.toy_model:build_toy"  # the copy is not beside toy_model.py
        document["capture"].update(compile="eager", verify={"atol": 1e-5, "rtol": 1e-5}, sizes=[1, 2],
                                   modes=["FULL"])
        document["symbols"] = {"B": [1, 2]}
        path = tmp_path / "toy_compiled.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def test_run_reports_the_compiled_segments(self, tmp_path, capsys):
        from graphflow.cli import main

        assert main(["run", str(self.plan_file(tmp_path)), "--backend", "cpu", "--steps", "1"]) == 0
        text = capsys.readouterr().out
        assert "compile: 10 segment(s) (eager; 6 reuse another's code), 8 compile(s)" in text
        assert "  L0.pre: 2 compile(s), 2 graph(s), 1 recompile(s)" in text
        assert "bit-exact is not expected" in text
        assert "verify 2/2 within atol=1e-05, rtol=1e-05 of the uncompiled eager step" in text

    def test_json_and_no_compile(self, tmp_path, capsys):
        from graphflow.cli import main

        path = str(self.plan_file(tmp_path))
        assert main(["run", path, "--backend", "cpu", "--steps", "0", "--json"]) == 0
        document = json.loads(capsys.readouterr().out)
        segments = {s["segment"]: s for s in document["compile"]["segments"]}
        assert segments["L0.pre"]["compiles"] == 2 and segments["L1.pre"]["reuses"] == "L0.pre"
        assert document["descriptors"][0]["verify"]["against"] == ["the uncompiled eager step"]
        assert main(["run", path, "--backend", "cpu", "--steps", "0", "--json", "--no-compile"]) == 0
        document = json.loads(capsys.readouterr().out)
        assert document["compile"] is None and "2/2 bit-exact" in document["result"]

