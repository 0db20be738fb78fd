"""``graphflow.runtime.time_steps``: each descriptor's step timed eagerly and replayed,
as ``graphflow run`` reports it, without the caller reaching into the engine."""

from __future__ import annotations

import torch

from graphflow.engine import RunOptions, run_pipeline
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
