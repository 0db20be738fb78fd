"""Streams are lent to a run and given back: N runs in one process take one run's streams.

cuBLAS keeps a workspace per stream it ran on, so a run that takes new streams leaves
device memory behind for the life of the process (tests/cuda/test_cuda_cycles.py counts
it on a GPU). Here, on the CPU, the wiring: every stream a run takes goes back to the
pool when the run closes or rolls back, in any phase, and the next run takes the same
ones. A test backend lends streams from a ``StreamPool`` of its own, exactly as the CUDA
backend lends from the process's.
"""

from __future__ import annotations

import attrs
import pytest

from graphflow.engine import CpuBackend, RunOptions, run_pipeline
from graphflow.engine.streams import StreamPool
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.plan import SegmentKind
from plans.toy_model import build_toy, toy_plan


class _Stream:
    def __init__(self, device):
        self.device = device


class LendingBackend(CpuBackend):
    """The CPU backend, lending its streams from a pool as the CUDA backend does."""

    def __init__(self, pool: StreamPool):
        super().__init__()
        self.pool = pool
        self.out: list[object] = []  # lent and not given back

    def new_stream(self, device):
        stream = self.pool.take(device)
        self.out.append(stream)
        return stream

    def release_stream(self, stream):
        self.out.remove(stream)
        self.pool.give(stream)


def two_stream_plan():
    """The toy plan with its eager breaks on no named stream: they get the device's
    default stream, a second one."""
    plan = toy_plan(2)
    segments = [attrs.evolve(s, stream=None) if s.kind is SegmentKind.EAGER else s for s in plan.segments]
    return attrs.evolve(plan, segments=segments)


class Fault:
    """A listener that raises when a phase begins."""

    def __init__(self, phase: Phase):
        self.phase = phase

    def on_event(self, event):
        if event.phase is self.phase and event.kind.name == "PHASE_BEGIN":
            raise RuntimeError(f"injected at {self.phase.value}")


def test_the_pool_lends_a_free_stream_before_making_one():
    pool = StreamPool(_Stream)
    a, b = pool.take("cuda:0"), pool.take("cuda:0")
    assert a is not b and pool.made == 2  # both lent at once: two streams
    pool.give(b)
    pool.give(a)
    assert pool.take("cuda:0") is a and pool.take("cuda:0") is b  # given back in reverse: same order again
    assert pool.made == 2
    assert pool.take("cuda:1").device == "cuda:1" and pool.made == 3  # per device


def test_runs_one_after_another_take_one_runs_streams():
    pool = StreamPool(_Stream)
    backend = LendingBackend(pool)
    plan = two_stream_plan()
    for _ in range(5):
        engine = run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=build_toy(2))
        assert len(backend.out) == 2
        engine.close()
        assert backend.out == []
    assert pool.made == 2


@pytest.mark.parametrize("phase", [Phase.WARMUP, Phase.PREWARM, Phase.CAPTURE, Phase.VERIFY, Phase.COMMIT])
def test_a_rollback_gives_the_streams_back(phase):
    pool = StreamPool(_Stream)
    backend = LendingBackend(pool)
    plan = two_stream_plan()
    for _ in range(3):
        with pytest.raises(CaptureError, match=f"injected at {phase.value}"):
            run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=build_toy(2),
                         listeners=[Fault(phase)])
        assert backend.out == []
    engine = run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=build_toy(2))
    engine.close()
    assert pool.made == 2 and backend.out == []


def test_a_lazy_engine_gives_its_streams_back_at_close():
    pool = StreamPool(_Stream)
    backend = LendingBackend(pool)
    plan = two_stream_plan()
    for _ in range(3):
        engine = run_pipeline(plan, RunOptions(detectors=False, lazy=True), backend=backend, model=build_toy(2))
        engine.background.wait(60)
        engine.close()
        assert backend.out == []
    assert pool.made == 2


def test_engines_alive_at_once_hold_streams_of_their_own():
    pool = StreamPool(_Stream)
    backend = LendingBackend(pool)
    plan = two_stream_plan()
    first = run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=build_toy(2))
    second = run_pipeline(plan, RunOptions(detectors=False), backend=backend, model=build_toy(2))
    assert len(backend.out) == 4 and len({id(s) for s in backend.out}) == 4
    first.close()
    second.close()
    assert pool.made == 4 and backend.out == []
