"""``graphflow.runtime.time_steps``: each descriptor's step timed eagerly and replayed,
as ``graphflow run`` reports it, without the caller reaching into the engine."""

from __future__ import annotations

import collections
import functools
import time

import torch

from graphflow.engine import CpuBackend, CudaBackend, Engine, RunOptions, run_pipeline
from graphflow.events import Phase
from graphflow.runtime import Runner, StepTiming, time_steps
from plans.toy_model import toy_plan


def test_every_descriptor_is_timed_both_ways_and_serving_goes_on():
    with run_pipeline(toy_plan(2, device="cuda:0"), RunOptions(backend="cpu", detectors=False, sizes=(2, 4))) as engine:
        timings = time_steps(engine, 3)
        assert set(timings) == set(engine.descriptors)
        for descriptor, timed in timings.items():
            assert isinstance(timed, StepTiming) and timed.descriptor == descriptor
            assert timed.eager_s > 0 and timed.replay_s > 0
        runner = Runner(engine)
        x = torch.randn(2, 32)
        (first,) = (o.clone() for o in runner.run(x))
        time_steps(engine, 1)
        assert torch.equal(runner.run(x)[0], first)


def test_no_steps_times_nothing():
    with run_pipeline(toy_plan(1, device="cuda:0"), RunOptions(backend="cpu", detectors=False, sizes=(1,))) as engine:
        assert time_steps(engine, 0) == {}


def _counted(engine, monkeypatch):
    """The engine's eager steps and step programs, each run counted by descriptor size."""
    eager_runs, replays = collections.Counter(), collections.Counter()
    eager_calls = Engine.eager_calls

    def counting_eager(self, size, views=None):
        return (functools.partial(eager_runs.update, (size,)), *eager_calls(self, size, views))

    monkeypatch.setattr(Engine, "eager_calls", counting_eager)
    for descriptor, program in list(engine.programs.items()):
        engine.programs[descriptor] = (functools.partial(replays.update, (descriptor.size,)), *program)
    return eager_runs, replays


def test_a_step_the_pipeline_ran_is_timed_without_an_untimed_run_first(monkeypatch):
    # Every descriptor warmed up and verified (the default sample holds all four): the
    # pipeline ran each eager step and each replay, so timing runs each exactly 3 times.
    with run_pipeline(toy_plan(2, device="cuda:0"), RunOptions(backend="cpu", detectors=False)) as engine:
        assert {t.descriptor for t in engine.report.times if t.phase is Phase.WARMUP and not t.skipped} \
            == {r.descriptor for r in engine.report.verify} == set(engine.descriptors)
        eager_runs, replays = _counted(engine, monkeypatch)
        time_steps(engine, 3)
        assert eager_runs == replays == {1: 3, 2: 3, 4: 3, 8: 3}


def test_a_step_the_pipeline_never_ran_gets_one_untimed_run(monkeypatch):
    # Nothing verified: every replay is new to timing. capture.warmup auto warmed up the
    # largest only: the other eager steps are new too.
    with run_pipeline(toy_plan(2, device="cuda:0"), RunOptions(backend="cpu", detectors=False, verify="off")) as engine:
        assert [t.descriptor.size for t in engine.report.times if t.phase is Phase.WARMUP and not t.skipped] == [8]
        eager_runs, replays = _counted(engine, monkeypatch)
        time_steps(engine, 3)
        assert eager_runs == {8: 3, 4: 4, 2: 4, 1: 4}
        assert replays == {8: 4, 4: 4, 2: 4, 1: 4}


def test_an_eager_step_is_run_again_only_while_its_runs_fit_the_budget(monkeypatch):
    # Paced eager steps against a budget of 0.25 s: a step of 0.3 s is timed once, one of
    # 0.1 s twice (a third would pass the budget), an instant one every time; replays
    # always run every time, and without a budget the eager steps do too.
    pace = {8: 0.3, 4: 0.1, 2: 0.0, 1: 0.0}
    eager_calls = Engine.eager_calls
    monkeypatch.setattr(Engine, "eager_calls", lambda self, size, views=None: (
        functools.partial(time.sleep, pace[size]), *eager_calls(self, size, views)))
    with run_pipeline(toy_plan(2, device="cuda:0"), RunOptions(backend="cpu", detectors=False)) as engine:
        timings = time_steps(engine, 3, eager_budget_s=0.25)
        assert {d.size: (t.eager_runs, t.replay_runs) for d, t in timings.items()} == {
            8: (1, 3), 4: (2, 3), 2: (3, 3), 1: (3, 3)}
        assert timings[engine.descriptors[0]].eager_s >= 0.3
        assert {t.eager_runs for t in time_steps(engine, 2, only=engine.descriptors[:2]).values()} == {2}


def test_time_runs_times_each_call_in_turn_on_the_host():
    order = []
    timed = CpuBackend().time_runs(torch.device("cpu"), (lambda: order.append("a"), lambda: order.append("b")), 3)
    assert order == ["a"] * 3 + ["b"] * 3
    assert [len(t) for t in timed] == [3, 3] and all(s >= 0 for t in timed for s in t)
    assert CpuBackend().time_runs(torch.device("cpu"), (lambda: order.append("c"),), 2) and order[-2:] == ["c", "c"]


def test_time_runs_on_a_gpu_synchronizes_once_before_and_once_after(monkeypatch):
    # The CUDA path with the device's calls replaced: every run between two events, the
    # calls back to back, one synchronize before the first run and one after the last.
    log = []

    class Event:
        clock = 0.0

        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self):
            Event.clock += 1.0
            self.at = Event.clock
            log.append("record")

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3  # milliseconds, as torch's

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(f"sync {device}"))
    device = torch.device("cuda", 0)
    eager, replay = (lambda: log.append("eager")), (lambda: log.append("replay"))
    timed = CudaBackend().time_runs(device, (eager, replay), 2)
    assert log == ["sync cuda:0", *["record", "eager", "record"] * 2, *["record", "replay", "record"] * 2,
                   "sync cuda:0"]
    assert timed == ([1.0, 1.0], [1.0, 1.0])
