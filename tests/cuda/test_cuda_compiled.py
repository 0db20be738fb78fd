"""Compiled segments on a real GPU: inductor's kernels captured in graphflow's graphs,
a recompile inside capture refused by the tripwire, and rollback leaving nothing.

Run on the device with ``scripts/gpu_check.sh``; skipped where torch sees no GPU.
"""

from __future__ import annotations

import attrs
import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.model.compiled import CompiledSegment
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.integrations.dsv4.plans import plan_variant
from graphflow.plan import Mode
from graphflow.runtime import Runner
from plans.toy_model import build_toy, toy_plan
from tests.cuda.test_cuda_engine import TrackingBackend, assert_clean, baseline, gc_calls  # noqa: F401 - a fixture
from tests.test_compiled import Probe, probe_plan

pytestmark = pytest.mark.cuda

F, P = Mode.FULL, Mode.PIECEWISE


def compiled_toy(*, modes=(F, P), sizes=(1, 2, 4), atol=1e-4, compile="inductor"):
    plan = toy_plan(2, full=True, modes=modes, sizes=sizes, atol=atol, rtol=atol)
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, compile=compile))


def test_inductor_segments_are_captured_and_replay_matches_the_uncompiled_model():
    plan = compiled_toy()
    model = build_toy(2, device="cuda")
    with run_pipeline(plan, RunOptions(backend="cuda"), model=model) as engine:
        report = engine.report
        assert report.graphs > 0 and report.compile is not None and report.compile.fell_back == ()
        first = report.compile.segments[0]
        assert first.compiles == 3 and first.graphs == 3  # one specialization per size, compiled in warmup
        assert all(r.against == ("the uncompiled eager step",) for r in report.verify)
        runner = Runner(engine)
        for batch in (1, 3, 4):
            x = torch.randn(batch, 32, device="cuda")
            (graph,) = runner.run(x)
            graph = graph.clone()
            logits = torch.empty(batch, 64, device="cuda")
            with torch.no_grad():
                model.step(x.clone(), logits, full=True)
            torch.testing.assert_close(graph, logits, atol=1e-4, rtol=1e-4)


def test_replay_runs_no_python_of_the_compiled_segments(monkeypatch):
    plan = compiled_toy(modes=(F,), sizes=(2,))
    with run_pipeline(plan, RunOptions(backend="cuda"), model=build_toy(2, device="cuda")) as engine:
        calls = []
        original = CompiledSegment.__call__
        monkeypatch.setattr(CompiledSegment, "__call__", lambda self, *args: (calls.append(1), original(self, *args)))
        Runner(engine).run(torch.randn(2, 32, device="cuda"))
        assert calls == []


def test_a_recompile_inside_capture_is_refused_and_rolled_back(gc_calls):
    model = Probe().cuda()

    class ChangeBeforeCapture:
        def on_event(self, event):
            if event.kind is EventKind.PHASE_BEGIN and event.phase is Phase.CAPTURE:
                model.factor = 3  # the compiled code's guard on it fails: dynamo would recompile in capture

    plan = probe_plan("scaled", "marked", compile="inductor", sizes=(2,), device="cuda:0")
    backend = TrackingBackend()
    before = baseline()
    with pytest.raises(CaptureError) as info:
        run_pipeline(plan, RunOptions(backend="cuda"), backend=backend, model=model,
                     listeners=[ChangeBeforeCapture()])
    error = info.value
    assert (error.phase, error.segment) == ("capture", "s0")
    assert "torch.compile recompile" in error.message and "inside the capture of segment s0" in error.message
    del model, info, error
    assert_clean(backend, before, gc_calls)


def test_a_failure_after_compiled_capture_rolls_back_to_the_baseline(gc_calls):
    class FailAtVerify:
        def on_event(self, event):
            if event.kind is EventKind.PHASE_BEGIN and event.phase is Phase.VERIFY:
                raise RuntimeError("injected at verify")

    backend = TrackingBackend()
    before = baseline()
    with pytest.raises(CaptureError, match="injected at verify"):
        run_pipeline(compiled_toy(modes=(F,), sizes=(4, 2)), RunOptions(backend="cuda"), backend=backend,
                     model=build_toy(2, device="cuda"), listeners=[FailAtVerify()])
    assert backend.graphs, "nothing was captured before the failure"
    assert_clean(backend, before, gc_calls)


def test_dsv4_full_plan_compiled_on_its_streams():
    plan = plan_variant("plans/dsv4_mini_full.yaml", sizes=(1, 8), n_layers=2)
    plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, compile="inductor", atol=1e-3, rtol=1e-3))
    with run_pipeline(plan, RunOptions(backend="cuda")) as engine:
        compiled = engine.report.compile
        assert compiled.fell_back == () and sum(s.graphs for s in compiled.segments) > 0
        assert all(s.reused for s in compiled.segments if s.segment.startswith("L1."))  # layers share code
        assert engine.report.graphs == 2
        assert max(r.max_abs_diff for r in engine.report.verify) < 1e-3
