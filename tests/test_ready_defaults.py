"""Time to ready by doing less, safely: verify a sample, warm up only where it is needed,
and forecast the capture pool before capturing (issue "Time-to-ready: faster than a
hand-written loop, with verification on").

``RunOptions.verify`` is a ``Verify`` (SAMPLE by default: each mode's first, last and a
few between, plus what the detectors watch); ``capture.warmup: auto`` warms up only the
descriptors that verify, are watched or come first in their mode, unless the plan does
per-size work at warmup (``per_size_warmup``); a skipped warmup is said, not silent.
"""

from __future__ import annotations

import contextlib
import io
import json

import attrs
import pytest
from hypothesis import given, settings

from graphflow.cli import main
from graphflow.engine import CpuBackend, RunOptions, Verify, run_pipeline
from graphflow.engine.backend import PoolProbe
from graphflow.engine.context import SAMPLE_BETWEEN, per_size_warmup, sample
from graphflow.engine.options import Watch
from graphflow.events import EventKind, Phase
from graphflow.plan import CaptureSettings, Compile, Descriptor, Mode, Warmup
from graphflow.plan.loader import dump_plan, loads_plan
from plans.toy_model import build_toy, toy_plan
from tests.strategies import valid_plans

P, F = Mode.PIECEWISE, Mode.FULL
SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)


class Events:
    """A listener keeping each warmup, skipped warmup, capture and verify, by descriptor."""

    segment_events = False

    def __init__(self):
        self.done: dict[Phase, list[Descriptor]] = {Phase.WARMUP: [], Phase.CAPTURE: [], Phase.VERIFY: []}
        self.skipped: list[Descriptor] = []

    def on_event(self, event):
        if event.kind is EventKind.DESCRIPTOR_END and event.phase in self.done:
            self.done[event.phase].append(event.descriptor)
        elif event.kind is EventKind.DESCRIPTOR_SKIPPED:
            assert event.phase is Phase.WARMUP
            self.skipped.append(event.descriptor)


def captured(plan, listener=None, **options):
    options.setdefault("backend", "cpu")
    listener = listener or Events()
    engine = run_pipeline(plan, RunOptions(**options), model=build_toy(plan.model_args["layers"]),
                          listeners=[listener])
    return engine, listener


def descriptors(mode, sizes):
    return [Descriptor(mode, s) for s in sorted(sizes, reverse=True)]


class TestVerifyOption:
    def test_a_bool_converts_and_only_off_is_false(self):
        assert RunOptions().verify is Verify.SAMPLE
        assert RunOptions(verify=True).verify is Verify.SAMPLE
        assert RunOptions(verify=False).verify is Verify.OFF
        assert RunOptions(verify="all").verify is Verify.ALL
        assert [bool(v) for v in Verify] == [True, True, False]
        with pytest.raises(ValueError):
            RunOptions(verify="some")

    def test_the_sample_is_first_last_and_evenly_spaced_between_per_mode(self):
        full = descriptors(F, range(1, 68))
        chosen = sample(tuple(descriptors(P, (1, 2)) + full))
        assert chosen == {Descriptor(P, 2), Descriptor(P, 1), full[0], full[16], full[33], full[50], full[66]}
        assert len(chosen & set(full)) == SAMPLE_BETWEEN + 2
        assert sample(tuple(descriptors(P, (4,)))) == {Descriptor(P, 4)}
        few = tuple(descriptors(P, (1, 2, 3, 4, 5)))
        assert sample(few) == set(few)  # five or fewer: every one

    def test_sample_verifies_the_sample_and_what_the_detectors_watch(self):
        plan = toy_plan(2, sizes=SIZES)
        engine, events = captured(plan, detectors=Watch.ALL)
        with engine:
            assert set(events.done[Phase.VERIFY]) == set(plan.descriptors())  # every one watched
        engine, events = captured(plan, detectors=False)
        with engine:
            assert set(events.done[Phase.VERIFY]) == sample(plan.descriptors())
            assert len(engine.report.verify) == SAMPLE_BETWEEN + 2

    def test_verify_all_verifies_every_descriptor_and_off_none(self):
        plan = toy_plan(2, sizes=SIZES)
        engine, events = captured(plan, verify="all", detectors=False)
        with engine:
            assert events.done[Phase.VERIFY] == list(plan.descriptors())
            assert all(r.bit_exact for r in engine.report.verify)
        engine, events = captured(plan, verify=False, detectors=False)
        with engine:
            assert events.done[Phase.VERIFY] == [] and engine.report.verify == ()


class TestWarmupSetting:
    def test_it_defaults_to_auto_and_round_trips_through_yaml(self):
        assert CaptureSettings().warmup is Warmup.AUTO
        plan = toy_plan(1)
        each = attrs.evolve(plan, capture=attrs.evolve(plan.capture, warmup="each"))
        assert each.capture.warmup is Warmup.EACH
        assert loads_plan(dump_plan(each)) == each
        assert "warmup:" not in dump_plan(plan).split("warmup_iters")[1]  # the default is not written
        with pytest.raises(Exception, match="warmup"):
            CaptureSettings(warmup="some")

    @settings(max_examples=60, deadline=None)
    @given(valid_plans())
    def test_per_size_warmup_is_needed_exactly_where_warmup_does_per_size_work(self, plan):
        segments = plan.segments
        compiled = any(plan.compile_of(s) is not None for s in segments)
        needs = (compiled or any(s.breaks for s in segments) or bool(plan.channels) or plan.world_size > 1
                 or any(s.kernels for s in segments))
        assert (per_size_warmup(plan, segments, compiled=True, jit=False) is not None) == needs
        # RunOptions(compile=False) runs nothing compiled: compiling is no reason then.
        uncompiled = (needs and not compiled) or (compiled and (any(s.breaks for s in segments) or plan.channels
                                                               or plan.world_size > 1
                                                               or any(s.kernels for s in segments)))
        assert (per_size_warmup(plan, segments, compiled=False, jit=False) is not None) == bool(uncompiled)
        # A JIT kernel the first warmup launched, or several ranks, or the plan asking: always.
        assert per_size_warmup(plan, segments, compiled=False, jit=True) is not None
        assert per_size_warmup(plan, segments, compiled=False, jit=False, world_size=2) is not None
        each = attrs.evolve(plan, capture=attrs.evolve(plan.capture, warmup=Warmup.EACH))
        assert per_size_warmup(each, segments, compiled=False, jit=False) == "capture.warmup is each"

    def test_auto_warms_the_first_of_each_mode_and_captures_every_descriptor(self):
        plan = toy_plan(2, sizes=SIZES, modes=(P, F), full=True)
        engine, events = captured(plan, verify=False, detectors=False)
        with engine:
            firsts = [Descriptor(P, 32), Descriptor(F, 32)]
            assert events.done[Phase.WARMUP] == firsts
            assert events.done[Phase.CAPTURE] == list(plan.descriptors())
            assert set(events.skipped) == set(plan.descriptors()) - set(firsts)
            report = engine.report
            assert report.warmups_skipped == len(plan.descriptors()) - 2
            skipped = [t for t in report.times if t.skipped]
            assert {t.descriptor for t in skipped} == set(events.skipped)
            assert all(t.phase is Phase.WARMUP and t.seconds == 0.0 for t in skipped)
            assert set(engine.programs) == set(plan.descriptors())

    def test_auto_warms_what_verify_compares_and_the_detectors_watch(self):
        plan = toy_plan(2, sizes=SIZES)
        engine, events = captured(plan)  # the defaults: verify a sample, watch the first
        with engine:
            assert set(events.done[Phase.WARMUP]) == sample(plan.descriptors())
            assert events.done[Phase.CAPTURE] == list(plan.descriptors())
            assert all(r.bit_exact for r in engine.report.verify)
        engine, events = captured(plan, verify="all", detectors=False)
        with engine:
            assert events.done[Phase.WARMUP] == list(plan.descriptors()) and events.skipped == []

    def test_each_warms_every_descriptor(self):
        plan = toy_plan(2, sizes=SIZES)
        plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, warmup=Warmup.EACH))
        engine, events = captured(plan, verify=False, detectors=False)
        with engine:
            assert events.done[Phase.WARMUP] == list(plan.descriptors()) and events.skipped == []
            assert engine.report.warmups_skipped == 0

    def test_a_compiled_plan_warms_each_unless_the_run_compiles_nothing(self):
        plan = toy_plan(1, sizes=(1, 2, 4, 8))
        plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, compile=Compile(backend="eager")))
        engine, events = captured(plan, verify=False, detectors=False)
        with engine:
            assert events.done[Phase.WARMUP] == list(plan.descriptors())
        engine, events = captured(plan, verify=False, detectors=False, compile=False)
        with engine:
            assert events.done[Phase.WARMUP] == [Descriptor(P, 8)]

    def test_a_lazy_engines_thread_warms_up_once_before_serving_and_checks_each_on_first_use(self):
        """A lazy engine verifies nothing before ready (each descriptor is checked on its
        first batch): its thread warms up nothing but its own first step, before the
        engine is returned, and every descriptor goes straight to capture."""
        plan = toy_plan(2, sizes=SIZES)
        engine, _ = captured(plan, lazy=True, detectors=False)
        with engine:
            assert engine.background.wait(60) and not engine.background.failures
            thread = engine.background.times
            warmed = [t.descriptor for t in thread if t.phase is Phase.WARMUP and not t.skipped]
            assert warmed == [plan.descriptors()[0]]
            assert {t.descriptor for t in thread if t.skipped} == set(plan.descriptors())
            assert set(engine.programs) == set(plan.descriptors()) == engine.live.unchecked


class TestPoolForecast:
    def test_the_cpu_backend_cannot_tell_and_says_none(self):
        engine, _ = captured(toy_plan(1, sizes=(1, 2)), detectors=False)
        with engine:
            assert engine.report.pool_probe == {} and engine.report.pool_forecast is None

    def test_the_first_descriptor_of_each_mode_runs_its_step_once_more_in_a_probed_pool(self):
        """The probe opens once per mode, around the last eager step of that mode's first
        (largest) descriptor, one more than its warm runs; the forecast is the largest."""
        backend = Probing()
        plan = toy_plan(1, sizes=(1, 2, 4), modes=(P, F), full=True)
        engine = run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=build_toy(1))
        with engine:
            assert backend.probes == 2
            assert engine.report.pool_probe == {"PIECEWISE": 1000, "FULL": 1001}
            assert engine.report.pool_forecast == 1001

    @pytest.mark.parametrize("mode", [P, F])
    def test_the_probe_measures_what_capture_puts_in_its_pool(self, mode):
        """PIECEWISE: the graph segments allocate in the probe's pool and the eager breaks
        outside it, as at capture; FULL captures every segment."""
        plan = toy_plan(2, modes=(mode,), sizes=(4, 2), full=mode is F)
        backend, seen = Probing(), []

        class Segments:
            def on_event(self, event):
                if event.kind is EventKind.SEGMENT_BEGIN and backend.inside:
                    seen.append((event.segment, backend.routed))

        with run_pipeline(plan, RunOptions(detectors=False, verify=False), backend=backend, model=build_toy(2),
                          listeners=[Segments()]):
            pass
        names = [s.name for s in plan.segments]
        assert [name for name, _ in seen] == names
        eager = {"L0.mix", "L1.mix"} if mode is P else set()
        assert dict(seen) == {name: name not in eager for name in names}

    def test_the_probed_run_is_one_more_warm_run_and_the_last(self):
        """With two warm runs asked for, the first descriptor runs three times, the probe
        around the third and last; the next descriptor runs its two, unprobed."""
        plan = toy_plan(1, modes=(P,), sizes=(4, 2))
        plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, warmup_iters=2))
        backend, log = Probing(), []
        backend.log = log

        class Ends:
            def on_event(self, event):
                if event.kind is EventKind.PHASE_END and event.phase is Phase.WARMUP:
                    log.append("warmup end")

        with run_pipeline(plan, RunOptions(detectors=False, verify="all"), backend=backend, model=build_toy(1),
                          listeners=[Ends()]):
            pass
        first, second = "".join(f"{e}|" for e in log).split("warmup end|")[:2]
        assert first == "run|run|probe|run|probed|"
        assert second == "run|run|"


class Probing(CpuBackend):
    """A CPU backend that probes pools: a probe reserves 1000 bytes per step run inside it
    (counted by the step's stream switches), plus 1 per probe before it; ``log`` (when
    given) records each run and each probe's opening and closing."""

    def __init__(self):
        super().__init__()
        self.probes, self.inside, self.steps_inside, self.log = 0, False, 0, None
        self.routed = False  # inside a probe's route(): what runs here is measured

    def probes_pools(self, device):
        return True

    @contextlib.contextmanager
    def pool_probe(self, device):
        probe, self.inside, self.steps_inside = PoolProbe(), True, 0
        probe.route = self._route
        self._note("probe")
        yield probe
        self._note("probed")
        self.inside = False
        probe.bytes = 1000 * self.steps_inside + self.probes
        self.probes += 1

    @contextlib.contextmanager
    def _route(self):
        self.routed = True
        try:
            yield
        finally:
            self.routed = False

    def on_stream(self, stream):
        self.steps_inside += self.inside
        self._note("run")
        return super().on_stream(stream)

    def _note(self, what):
        if self.log is not None:
            self.log.append(what)


class TestCommandLine:
    def run(self, capsys, *argv):
        status = main(["run", *argv])
        out, err = capsys.readouterr()
        return status, out, err

    def plan_file(self, tmp_path):
        path = tmp_path / "toy.yaml"
        path.write_text(dump_plan(toy_plan(2, sizes=SIZES)))
        return str(path)

    @pytest.mark.parametrize("flags, verified", [((), 5), (("--verify", "sample"), 5), (("--verify", "all"), 10),
                                                 (("--verify", "off"), 0), (("--no-verify",), 0)])
    def test_verify_flags(self, capsys, tmp_path, flags, verified):
        status, out, _ = self.run(capsys, self.plan_file(tmp_path), "--backend", "cpu", "--json", "--steps", "0",
                                  "--no-detectors", *flags)
        assert status == 0
        document = json.loads(out)
        assert document["verified"] == verified
        assert sum(row["verify"] is not None for row in document["descriptors"]) == verified
        assert document["pool_forecast_bytes"] is None and document["pool_probe_bytes"] == {}
        # Only what verifies (and the first) warms up; the rest say their warmup was skipped.
        assert document["warmups_skipped"] == len(SIZES) - max(verified, 1)
        for row in document["descriptors"]:
            assert row["warmup_skipped"] == (row["warmup_s"] is None)

    def test_the_report_says_how_many_were_verified_and_warmed(self, capsys, tmp_path):
        status, out, err = self.run(capsys, self.plan_file(tmp_path), "--backend", "cpu", "--steps", "0",
                                    "--no-detectors")
        assert status == 0
        assert "warmed up 5 of 10 descriptors (5 went straight to capture: capture.warmup auto); verified 5 of 10 " \
               "before ready, the other 5 checked against the eager step on their first batch (--verify all: every " \
               "one before ready)" in out
        assert out.splitlines()[-1].endswith("verify 5/5 bit-exact against the eager step (5 of 10 descriptors "
                                             "verified before ready, 5 more checked on their first batch)")
        assert "5 straight to capture without a warmup (capture.warmup auto)" in err

    def test_progress_says_each_skipped_warmup_where_the_descriptor_starts(self):
        from graphflow.view.progress import ProgressDisplay

        text = io.StringIO()
        progress = ProgressDisplay(file=text, force_terminal=False, interval_s=0.0, graphs=False)
        engine, events = captured(toy_plan(2, sizes=(1, 2, 3, 4, 5, 6, 7)), listener=progress, detectors=False,
                                  verify=False)
        progress.close()
        with engine:
            lines = text.getvalue().splitlines()
            assert "warmup: PIECEWISE(B=7) started (1/7), 0." in lines[2]
            starts = [line for line in lines if "capture: PIECEWISE(B=" in line and "started" in line]
            assert len(starts) == 6 and all(", warmup skipped, " in line for line in starts)
            assert lines[-1].endswith("6 straight to capture without a warmup (capture.warmup auto)")
