"""Lazy capture on the CPU backend: an engine that serves at once while a thread captures.

The CPU backend replays regions eagerly, so these tests check the orchestration — what
is served before and after each descriptor is switched in, the order of demand, turns
between steps and recordings, that the capture thread leaves the buffers the serving side
uses as it found them, each descriptor checked on its first batch, rollback of one failed
descriptor, retries, stopping, and the process left as it was found — not CUDA's
concurrency, which tests/cuda checks.
"""

from __future__ import annotations

import gc
import threading
import time

import attrs
import pytest
import torch

from graphflow.engine import RunOptions, background, run_pipeline
from graphflow.engine.lazy import TRIES
from graphflow.errors import CaptureError
from graphflow.events import EventKind, Phase
from graphflow.plan import Descriptor, Mode
from graphflow.runtime import Runner
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
    """A listener that holds the capture thread at its ``nth`` PHASE_BEGIN of ``phase``
    (before it takes the engine's lock). The default holds the first capture beside
    serving: the thread captures the largest descriptor before the engine is returned."""

    segment_events = False

    def __init__(self, phase: Phase, nth: int = 2):
        self.phase, self.nth = phase, nth
        self.reached, self.release = threading.Event(), threading.Event()
        self.foreground = threading.get_ident()

    def on_event(self, event):
        if (event.kind is EventKind.PHASE_BEGIN and event.phase is self.phase
                and threading.get_ident() != self.foreground and not self.reached.is_set()):
            self.nth -= 1
            if self.nth == 0:
                self.reached.set()
                assert self.release.wait(30)


class TestLazy:
    def test_serves_at_once_on_the_largest_graph_then_switches_each_descriptor_in_checked_on_its_first_batch(self):
        gate = Gate(Phase.CAPTURE)
        engine = run_pipeline(toy_plan(3, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        try:
            assert list(engine.programs) == [Descriptor(P, 8)], "the largest is captured before ready"
            assert engine.live.unchecked == {Descriptor(P, 8)}
            runner = Runner(engine)
            x = torch.randn(3, 32)
            (out,) = runner.run(x)  # the largest holds every batch: padded, and checked by this step
            assert gate.reached.wait(30), "the capture thread goes on"
            assert runner.descriptor_for(3) == Descriptor(P, 8)
            assert sum(runner.fallbacks.values()) == 0
            padded, want = torch.zeros(8, 32), torch.empty(8, 64)
            padded[:3] = x
            build_toy(3).step(padded, want)
            assert torch.equal(out, want[:3]), "the checked step serves the model's own step, padded"
            assert [r.descriptor.size for r in engine.background.verified] == [8]
            gate.release.set()
            assert engine.background.wait(60)
            assert sorted(engine.programs) == sorted(Descriptor(P, s) for s in SIZES)
            assert engine.background.failures == {} and len(engine.background.verified) == 1
            assert set(engine.live.unchecked) == set(engine.programs) - {Descriptor(P, 8)}, "no other served a batch"
            report = engine.report  # once done, it reads as a foreground run's
            assert sorted(report.descriptors) == sorted(engine.programs)
            assert report.phase(Phase.CAPTURE).outcome.value == "passed" and report.graphs == 4 * len(SIZES)  # 3 layers: 4 regions
            for batch in (1, 3, 8, 3):
                x = torch.randn(batch, 32)
                (out,) = runner.run(x)
                assert runner.descriptor_for(batch) == Descriptor(P, {1: 1, 3: 4, 8: 8}[batch])
                assert torch.equal(out.clone(), eager_reference(runner, batch, x))
            checked = [r.descriptor.size for r in engine.background.verified]
            assert checked == [8, 1, 4] and all(r.bit_exact for r in engine.background.verified)
            assert engine.live.unchecked == {Descriptor(P, 2)}
            assert [r.descriptor.size for r in engine.report.verify] == [8, 1, 4]
        finally:
            gate.release.set()
            engine.close()

    def test_a_graph_its_first_batch_finds_wrong_is_rolled_back_alone_and_the_eager_step_is_served(self):
        """A head that gives other values at every other call at B=2 only: the replay after
        the eager step differs, which no sample before ready would have seen."""
        model = build_toy(2)
        head = model.head
        calls = []

        def head_wrong_at_two(x, logits):
            head(x, logits)
            if x.shape[0] == 2:
                calls.append(1)
                logits.add_(len(calls) % 2)

        model.head = head_wrong_at_two
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True, detectors=False),
                              model=model)
        try:
            assert engine.background.wait(60)
            runner = Runner(engine)
            x = torch.randn(2, 32)
            calls.clear()
            (out,) = runner.run(x)
            want = torch.empty(2, 64)
            build_toy(2).step(x.clone(), want)  # the model's own step; the eager step was its first call
            assert torch.equal(out, want + 1), "the eager step's values are served"
            bad = Descriptor(P, 2)
            assert bad not in engine.programs and engine.background.states[bad].value == "failed"
            error = engine.background.failures[bad]
            assert isinstance(error, CaptureError) and "PIECEWISE(B=2)" in error.message
            assert "'logits'" in error.message and error.segment == "head"
            runner.run(torch.randn(2, 32))
            assert runner.descriptor_for(2) == Descriptor(P, 4), "its batches go to a larger descriptor"
            assert engine.report.graphs == 3 * 3  # B=2's regions destroyed
        finally:
            engine.close()

    def test_while_the_thread_captures_a_batch_replays_a_checked_graph_and_checks_its_own_after(self):
        """A first-use check is an eager step and a replay, host work that would compete
        with the recordings; while they run, a batch whose own graph waits for its check
        replays the smallest checked graph that holds it, and checks its own once the
        thread is done."""
        # The thread captures 8 (the largest, before ready), 1 (asked), 4, then waits at 2.
        gate = Gate(Phase.CAPTURE, nth=4)
        model = build_toy(2)

        def model_step(x, size):  # the model's own step, on the batch padded to ``size`` rows
            padded, want = torch.zeros(size, 32), torch.empty(size, 64)
            padded[:len(x)] = x
            model.step(padded, want)
            return want[:len(x)]

        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        try:
            runner = Runner(engine)
            x = torch.randn(1, 32)
            (out,) = runner.run(x)  # no checked graph holds 1: the largest, checked now
            assert runner.descriptor_for(1) == Descriptor(P, 8) and torch.equal(out, model_step(x, 8))
            assert [r.descriptor.size for r in engine.background.verified] == [8]
            assert gate.reached.wait(30)
            x = torch.randn(8, 32)
            (out,) = runner.run(x)
            assert runner.descriptor_for(8) == Descriptor(P, 8) and torch.equal(out, model_step(x, 8))
            x = torch.randn(3, 32)
            (out,) = runner.run(x)
            assert runner.descriptor_for(3) == Descriptor(P, 8), "its own graph waits: 8's serves it, padded"
            assert torch.equal(out, model_step(x, 8))
            assert [r.descriptor.size for r in engine.background.verified] == [8]
            assert Descriptor(P, 4) in engine.live.unchecked
            gate.release.set()
            assert engine.background.wait(60)
            (out,) = runner.run(x)
            assert runner.descriptor_for(3) == Descriptor(P, 4) and torch.equal(out, model_step(x, 4))
            assert [r.descriptor.size for r in engine.background.verified] == [8, 4]
        finally:
            gate.release.set()
            engine.close()

    def test_the_largest_comes_before_ready_then_the_first_batch_seen_then_the_most_asked(self):
        """With the largest live every batch replays a graph, padded up: no eager step
        competes with the capture for the host."""
        gate = Gate(Phase.CAPTURE)
        engine = run_pipeline(toy_plan(2, sizes=(1, 2, 4, 8, 16)), RunOptions(backend="cpu", lazy=True, verify=False),
                              listeners=[gate])
        try:
            for batch in (2, 1, 3, 4, 1):  # 2 first; then 1 and 4 twice (3 is held by 4), 1 first
                engine.live.asked(batch)
            gate.release.set()
            assert engine.background.wait(60)
            order = [t.descriptor.size for t in engine.background.times if t.phase is Phase.CAPTURE]
            assert order == [16, 2, 1, 4, 8]
        finally:
            gate.release.set()
            engine.close()

    def test_the_engines_first_step_goes_before_the_threads_next_capture_and_picks_its_descriptor(self, monkeypatch):
        monkeypatch.setattr(background, "FIRST_STEP_S", 30.0)  # however slow the machine, the step comes first
        began = []

        class Phases:
            segment_events = False

            def on_event(self, event):
                # A region's recording begins in the thread's turn (its capture phase may
                # begin before, and wait for the turn).
                if event.kind is EventKind.REGION_BEGIN and threading.current_thread() is not threading.main_thread():
                    began.append(time.perf_counter())

        ended = []
        step = Runner._step
        # When the step itself ends, inside the runner (the thread may start before ``run`` returns).
        monkeypatch.setattr(Runner, "_step",
                            lambda self, inputs, live=None: (step(self, inputs, live), ended.append(time.perf_counter()))[0])
        engine = run_pipeline(toy_plan(2, sizes=(1, 2, 4, 8)), RunOptions(backend="cpu", lazy=True),
                              listeners=[Phases()])
        returned = time.perf_counter()
        try:
            runner = Runner(engine)
            runner.run(torch.randn(3, 32))
            assert engine.background.wait(60)
            beside = [b for b in began if b > returned]
            assert beside and min(beside) > ended[0]
            order = [t.descriptor.size for t in engine.background.times if t.phase is Phase.CAPTURE]
            assert order[:2] == [8, 4], "the largest before ready, then the first batch's descriptor"
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

    def test_no_recording_runs_while_a_step_does(self):
        gate = Gate(Phase.CAPTURE)
        ended = []

        class Ends:
            segment_events = False

            def on_event(self, event):
                if event.kind is EventKind.PHASE_END and threading.current_thread() is not threading.main_thread():
                    ended.append(event.phase)

        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate, Ends()])
        try:
            assert ended.count(Phase.CAPTURE) == 1, "the largest, before ready"
            engine.live.asked(1)
            assert gate.reached.wait(30)  # at its next capture phase, before its turn
            with engine.live.step():
                gate.release.set()
                time.sleep(0.3)
                assert ended.count(Phase.CAPTURE) == 1, "the recording waits for the step"
            assert engine.background.wait(60)
            assert ended.count(Phase.CAPTURE) == len(SIZES)
        finally:
            gate.release.set()
            engine.close()

    def test_the_capture_thread_gives_back_the_buffers_serving_uses(self):
        gate = Gate(Phase.CAPTURE)
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        try:
            runner = Runner(engine)
            (out,) = runner.run(torch.full((8, 32), 0.5))
            served = out.clone()
            before = {n: t.clone() for n, t in engine.buffers.tensors.items()
                      if engine.plan.buffer(n).role.value in ("input", "state", "output")}
            assert gate.reached.wait(30)
            gate.release.set()
            assert engine.background.wait(60)  # the CPU backend's captures ran the model on the buffers
            assert torch.equal(out, served), "the outputs the last step returned are still there"
            assert all(torch.equal(engine.buffers.tensors[n], t) for n, t in before.items())
        finally:
            gate.release.set()
            engine.close()

    @pytest.mark.parametrize("failing", [1, TRIES])
    def test_a_descriptor_whose_capture_fails_is_tried_again_then_rolled_back_alone(self, failing):
        model = build_toy(2)
        head = model.head
        calls = []

        def head_failing_at_two(x, logits):
            if x.shape[0] == 2 and threading.current_thread().name == "graphflow-background-capture":
                calls.append(1)
                if len(calls) <= failing:
                    raise RuntimeError("capture of B=2 broke")
            head(x, logits)

        model.head = head_failing_at_two
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True, detectors=False),
                              model=model)
        try:
            assert engine.background.wait(60)
            bad = Descriptor(P, 2)
            assert engine.background.core.tries == {bad: failing}
            runner = Runner(engine)
            runner.run(torch.randn(2, 32))
            if failing < TRIES:
                assert engine.background.failures == {} and bad in engine.programs
                assert runner.descriptor_for(2) == bad
                return
            error = engine.background.failures[bad]
            assert isinstance(error, CaptureError) and error.phase == "capture"
            assert "capture of B=2 broke" in error.message and error.segment == "head"
            assert sorted(d.size for d in engine.programs) == [1, 4, 8]
            assert sorted(d.size for d in engine.report.descriptors) == [1, 4, 8]
            assert engine.report.graphs == 3 * 3  # B=2's regions were destroyed: 3 regions of 3 descriptors
            assert runner.descriptor_for(2) == Descriptor(P, 4)
        finally:
            engine.close()

    def test_close_stops_the_capture_thread(self):
        gate = Gate(Phase.CAPTURE)
        engine = run_pipeline(toy_plan(2, sizes=SIZES), RunOptions(backend="cpu", lazy=True), listeners=[gate])
        engine.live.asked(1)
        assert gate.reached.wait(30)
        closing = threading.Thread(target=engine.close)
        closing.start()
        gate.release.set()
        closing.join(60)
        assert not closing.is_alive()
        assert len([t for t in engine.background.times if t.phase is Phase.CAPTURE]) < len(SIZES)
        assert engine.programs == {}

    def test_the_engine_is_set_once_and_what_the_thread_switches_in_is_its_live_switchs(self):
        engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu", lazy=True))
        try:
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                engine.live = None
            assert engine.background.wait(60) and engine.live.done
            assert engine.programs is engine.live.programs and engine.live.version == 3  # two switch-ins, the end
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


def _frozen(obj: object) -> bool:
    """Whether the collector's permanent generation holds ``obj`` (``gc.freeze``)."""
    return not any(o is obj for o in gc.get_objects())


@pytest.mark.parametrize("lazy", [True, False])
def test_the_process_is_left_as_it_was_found(lazy):
    """A server freezes its heap after start-up (vLLM does): a capture, lazy or not, leaves
    it frozen; the caller's backend gets its capture error mode back, its thread its grad
    mode and its current stream."""
    from graphflow.engine import CpuBackend

    heap = [{"server": "state"}]
    gc.freeze()
    try:
        assert _frozen(heap)
        backend = CpuBackend()
        mode = backend.capture_error_mode
        engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(lazy=lazy), backend=backend)
        Runner(engine).run(torch.randn(2, 32))
        if lazy:
            assert engine.background.wait(60)
        engine.close()
        assert _frozen(heap), "the caller's frozen heap was unfrozen"
        assert backend.capture_error_mode == mode and torch.is_grad_enabled()
    finally:
        gc.unfreeze()


def test_a_process_with_nothing_frozen_has_nothing_frozen_after_a_lazy_run():
    assert gc.get_freeze_count() == 0
    engine = run_pipeline(toy_plan(2, sizes=(1, 2)), RunOptions(backend="cpu", lazy=True))
    engine.background.wait(60)
    engine.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("plan", ["plans/dsv4_61l_full.yaml", "plans/dsv4_61l_decode.yaml"])
def test_the_lazy_server_loop_serves_fresh_inputs_and_every_descriptor_goes_live(plan):
    """The loop tests/cuda/test_cuda_lazy_server.py runs ten times per plan in fresh
    processes on the GPU, here on the 61-layer plans' structure at the mini widths."""
    from tests.lazy_server import serve

    result = serve(plan, smoke=True, after=10, check_every=4, first_checks=2, timeout_s=120, seed=0)
    assert result["failures"] == {} and result["live"] == result["descriptors"]
    assert result["checked"] > 0 and result["differed"] == 0 and result["first_use_bit_exact"]
