"""Lazy capture on the CPU backend: an engine that serves at once while a thread captures.

The CPU backend replays regions eagerly, so these tests check the orchestration — what
is served before and after each descriptor is switched in, the order of demand, that the
capture thread leaves the buffers the serving side uses as it found them, rollback of one
failed descriptor, and stopping — not CUDA's concurrency, which tests/cuda checks.
"""

from __future__ import annotations

import threading
import time

import attrs
import pytest
import torch

from graphflow.engine import RunOptions, background, run_pipeline
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.plan import Descriptor, Mode
from graphflow.runtime import FallbackReason, Runner
from plans.toy_model import build_toy, toy_plan

P = Mode.PIECEWISE
SIZES = (1, 2, 4, 8)


def eager_reference(runner, batch: int, x: torch.Tensor) -> torch.Tensor:
    """The plan's step run eagerly at the size the runner serves ``batch`` with, on the same
    padded inputs: what a verified replay must equal bit for bit."""
    engine = runner.engine
    descriptor = runner.descriptor_for(batch)
    size = descriptor.size if descriptor is not None else batch
    views = engine.buffers.views(size)
    views["x"].zero_()
    views["x"][:batch].copy_(x)
    for call in engine.eager_calls(size):
        call()
    return views["logits"][:batch].clone()


class Gate:
    """A listener that holds the capture thread at its first PHASE_BEGIN of ``phase``
    (before it takes the engine's lock)."""

    segment_events = False

    def __init__(self, phase: Phase):
        self.phase = phase
        self.reached, self.release = threading.Event(), threading.Event()
        self.foreground = threading.get_ident()

    def on_event(self, event):
        if (event.kind is EventKind.PHASE_BEGIN and event.phase is self.phase
                and threading.get_ident() != self.foreground and not self.reached.is_set()):
            self.reached.set()
            assert self.release.wait(30)


class TestLazy:
    def test_serves_at_once_eagerly_then_switches_each_descriptor_in_as_it_verifies(self):
        gate = Gate(Phase.WARMUP)
        engine = run_pipeline(toy_plan(3, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        try:
            assert engine.programs == {} and engine.report.graphs == 0
            assert gate.reached.wait(30), "the capture thread started"
            runner = Runner(engine)
            x = torch.randn(3, 32)
            (out,) = runner.run(x)  # nothing captured yet: eager, and counted as such
            assert runner.descriptor_for(3) is None
            assert runner.fallbacks[FallbackReason.NOT_CAPTURED_YET] == 1
            want = torch.empty(3, 64)
            build_toy(3).step(x.clone(), want)
            assert torch.equal(out, want), "eager serving is the model's own step"
            gate.release.set()
            assert engine.background.wait(60)
            assert sorted(engine.programs) == sorted(Descriptor(P, s) for s in SIZES)
            assert all(r.bit_exact for r in engine.background.verified) and engine.background.failures == {}
            report = engine.report  # once done, it reads as a foreground run's
            assert sorted(report.descriptors) == sorted(engine.programs) and len(report.verify) == len(SIZES)
            assert report.phase(Phase.CAPTURE).outcome.value == "passed" and report.graphs == 4 * len(SIZES)  # 3 layers: 4 regions
            for batch in (1, 3, 8):
                x = torch.randn(batch, 32)
                (out,) = runner.run(x)
                assert runner.descriptor_for(batch) == Descriptor(P, {1: 1, 3: 4, 8: 8}[batch])
                assert torch.equal(out.clone(), eager_reference(runner, batch, x))
        finally:
            gate.release.set()
            engine.close()

    def test_a_batch_asked_for_is_captured_before_the_plans_order(self):
        gate = Gate(Phase.WARMUP)
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True, verify=False),
                              listeners=[gate])
        try:
            assert gate.reached.wait(30)  # busy with the largest, chosen before anything was asked
            engine.live.asked(1)
            gate.release.set()
            assert engine.background.wait(60)
            order = [t.descriptor.size for t in engine.background.times if t.phase is Phase.CAPTURE]
            assert order == [8, 1, 4, 2]
        finally:
            gate.release.set()
            engine.close()

    def test_the_first_batch_seen_comes_first_then_the_largest_then_demand(self):
        """Once the largest is live every batch replays a graph, padded up: no eager step
        competes with the capture for the host."""
        started, release = threading.Event(), threading.Event()

        class Hold:
            segment_events = False

            def on_event(self, event):
                if event.kind is EventKind.PIPELINE_BEGIN and threading.current_thread().name.startswith("graphflow"):
                    started.set()
                    assert release.wait(30)

        engine = run_pipeline(toy_plan(2, sizes=(1, 2, 4, 8, 16)), RunOptions(backend="cpu", lazy=True, verify=False),
                              listeners=[Hold()])
        try:
            assert started.wait(30)  # the thread has chosen nothing yet
            for batch in (2, 1, 3):
                engine.live.asked(batch)
            release.set()
            assert engine.background.wait(60)
            order = [t.descriptor.size for t in engine.background.times if t.phase is Phase.CAPTURE]
            assert order == [2, 16, 1, 4, 8]
        finally:
            release.set()
            engine.close()

    def test_the_engines_first_step_goes_before_the_threads_first_phase_and_picks_its_descriptor(self, monkeypatch):
        monkeypatch.setattr(background, "FIRST_STEP_S", 30.0)  # however slow the machine, the step comes first
        began = []

        class Phases:
            segment_events = False

            def on_event(self, event):
                if event.kind is EventKind.PHASE_BEGIN and threading.current_thread() is not threading.main_thread():
                    began.append(time.perf_counter())

        ended = []
        step = Runner._step
        # When the step itself ends, inside the runner (the thread may start before ``run`` returns).
        monkeypatch.setattr(Runner, "_step",
                            lambda self, inputs: (step(self, inputs), ended.append(time.perf_counter()))[0])
        engine = run_pipeline(toy_plan(2, sizes=(1, 2, 4, 8)), RunOptions(backend="cpu", lazy=True),
                              listeners=[Phases()])
        try:
            runner = Runner(engine)
            runner.run(torch.randn(3, 32))
            assert engine.background.wait(60)
            assert began and min(began) > ended[0]
            order = [t.descriptor.size for t in engine.background.times if t.phase is Phase.CAPTURE]
            assert order[:2] == [4, 8], "the first batch's descriptor, then the largest"
        finally:
            engine.close()

    def test_with_no_step_served_the_thread_starts_after_its_wait_for_one(self, monkeypatch):
        monkeypatch.setattr(background, "FIRST_STEP_S", 0.2)
        engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu", lazy=True))
        try:
            assert engine.background.wait(60) and engine.background.failures == {}
            assert len(engine.programs) == 2
            assert engine.background.finished_at - engine.background.started_at >= 0.2
        finally:
            engine.close()

    def test_a_step_waiting_or_running_goes_before_the_threads_next_phase(self, monkeypatch):
        monkeypatch.setattr(background, "SERVING_FIRST_S", 5.0)
        gate = Gate(Phase.CAPTURE)
        ended = []

        class Ends:
            segment_events = False

            def on_event(self, event):
                if event.kind is EventKind.PHASE_END and threading.current_thread() is not threading.main_thread():
                    ended.append(event.phase)

        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate, Ends()])
        try:
            assert gate.reached.wait(30)  # capturing the first descriptor, which takes no lock
            with engine.live.serving():
                gate.release.set()
                time.sleep(0.3)
                assert Phase.VERIFY not in ended, "the thread waits for the step before it verifies"
            assert engine.background.wait(60)
            assert ended.count(Phase.VERIFY) == len(SIZES)
        finally:
            gate.release.set()
            engine.close()

    def test_a_step_that_never_ends_delays_the_thread_by_its_bound_only(self, monkeypatch):
        monkeypatch.setattr(background, "SERVING_FIRST_S", 0.2)
        monkeypatch.setattr(background, "FIRST_STEP_S", 0.0)
        gate = Gate(Phase.WARMUP)  # the thread would otherwise be done before the step below begins
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        try:
            assert gate.reached.wait(30)
            with engine.live.serving():  # a step in flight the whole time, as back-to-back serving is
                released = time.perf_counter()
                gate.release.set()
                assert engine.background.wait(60), "the thread waits for a gap between steps forever"
            phases = 2 * len(SIZES)  # each descriptor's warmup and verify take the lock
            assert engine.background.finished_at - released >= phases * 0.2 * 0.9
        finally:
            gate.release.set()
            engine.close()

    def test_the_capture_thread_gives_back_the_buffers_serving_uses(self):
        gate = Gate(Phase.VERIFY)
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        try:
            runner = Runner(engine)
            (out,) = runner.run(torch.full((8, 32), 0.5))
            served = out.clone()
            assert gate.reached.wait(30)
            gate.release.set()
            assert engine.background.wait(60)
            assert torch.equal(out, served), "the outputs the last step returned are still there"
        finally:
            gate.release.set()
            engine.close()

    # The capture thread calls head at B=2 in warmup, in capture (the CPU backend runs
    # the region) and in verify: fail at the first or, once its graphs exist, the last.
    @pytest.mark.parametrize(("call", "phase"), [(1, "warmup"), (3, "verify")])
    def test_a_descriptor_that_fails_is_rolled_back_alone_and_its_batches_served_by_a_larger_one(self, call, phase):
        model = build_toy(2)
        head = model.head
        fail = threading.Event()
        calls = []

        def head_failing_at_two(x, logits):
            if x.shape[0] == 2 and threading.current_thread().name == "graphflow-background-capture":
                calls.append(1)
                if len(calls) == call:
                    fail.set()
                    raise RuntimeError("capture of B=2 broke")
            head(x, logits)

        model.head = head_failing_at_two
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True, detectors=False),
                              model=model)
        try:
            assert engine.background.wait(60) and fail.is_set()
            (failed,) = engine.background.failures
            error = engine.background.failures[failed]
            assert failed == Descriptor(P, 2) and isinstance(error, CaptureError)
            assert error.phase == phase and "capture of B=2 broke" in error.message
            assert sorted(d.size for d in engine.programs) == [1, 4, 8]
            assert sorted(d.size for d in engine.report.descriptors) == [1, 4, 8]
            assert engine.report.graphs == 3 * 3  # B=2's regions were destroyed: 3 regions of 3 descriptors
            runner = Runner(engine)
            runner.run(torch.randn(2, 32))
            assert runner.descriptor_for(2) == Descriptor(P, 4)
        finally:
            engine.close()

    def test_close_stops_the_capture_thread(self):
        gate = Gate(Phase.WARMUP)
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        assert gate.reached.wait(30)
        closing = threading.Thread(target=engine.close)
        closing.start()
        gate.release.set()
        closing.join(60)
        assert not closing.is_alive() and len(engine.background.times) < 3 * len(SIZES)
        assert engine.programs == {}

    def test_the_engine_is_set_once_and_what_the_thread_switches_in_is_its_live_switchs(self):
        engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu", lazy=True))
        try:
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                engine.live = None
            assert engine.background.wait(60) and engine.live.done
            assert engine.programs is engine.live.programs and engine.live.version == 2
            assert engine.report is engine.live.report and len(engine.report.descriptors) == 2
        finally:
            engine.close()
        assert engine.programs == {}
        foreground = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu"))
        foreground.close()
        assert foreground.live is None and foreground.background is None

    def test_lazy_capture_refuses_several_ranks_or_channels(self):
        plan = toy_plan(2, sizes=SIZES)
        with pytest.raises(ValueError, match="lazy .* serves one rank of a plan without channels"):
            run_pipeline(plan, RunOptions(backend="cpu", lazy=True), rank=0, world_size=2)


def test_the_capture_thread_runs_without_autograd_like_the_foreground():
    """Grad mode is per thread: a model whose parameters require grad (any model not
    frozen by hand, as a Hugging Face one is loaded) must capture in the background as
    in the foreground, where ``out=`` writes into the static buffers are refused under
    autograd."""
    model = build_toy(2).requires_grad_(True)
    engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu", lazy=True), model=model)
    try:
        assert engine.background.wait(60)
        assert engine.background.failures == {}
        assert sorted(d.size for d in engine.programs) == [1, 2]
    finally:
        engine.close()
