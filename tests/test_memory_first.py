"""The memory check from the plan alone: a plan too large for the device is refused in
allocate before the model is built, by ``run_pipeline`` and so by ``graphflow run``.

Building the 61-layer model takes minutes on a host; these tests prove the refusal
comes first by the factory never being called. The backend here reports a small free
figure, so the refusal does not depend on the machine the tests run on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphflow.cli import main
from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.backend import BACKENDS, BackendKind, CpuBackend
from graphflow.errors import CaptureError
from graphflow.integrations import dsv4
from graphflow.plan.loader import load_plan
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream

PLAN = "plans/dsv4_61l_decode.yaml"
GiB = 1 << 30


class SmallHost(CpuBackend):
    """A host with 4 GiB free: less than the 61-layer plan's static buffers (10.6 GiB)."""

    free = 4 * GiB

    def free_memory(self, device: torch.device) -> int | None:
        return self.free


@pytest.fixture
def builds(monkeypatch) -> list[dict]:
    """The keyword arguments of every call of the plans' factory (dsv4's ``build_model``)."""
    calls: list[dict] = []

    def build_model(**kwargs):
        calls.append(kwargs)
        raise AssertionError("the model was built")

    monkeypatch.setattr(dsv4, "build_model", build_model)
    return calls


class TestCli:
    def test_a_61_layer_plan_too_large_for_the_host_is_refused_before_the_model_is_built(
            self, builds, monkeypatch, capsys):
        monkeypatch.setitem(BACKENDS, BackendKind.CPU, SmallHost)
        status = main(["run", PLAN, "--backend", "cpu", "--steps", "0"])
        out, err = capsys.readouterr()
        assert status == 1
        assert builds == []
        assert out == "" and "Traceback" not in err
        (line,) = [line for line in err.splitlines() if line.startswith("graphflow:")]
        assert line.startswith("graphflow: capture failed, rolled back: [phase=allocate rank=0] the plan needs "
                               "40.2 GiB on the host (10.6 GiB of static buffers + 29.7 GiB for verify's copies) "
                               "but 4.0 GiB is free: 36.2 GiB short. The largest buffers: kv_cache{0..60} "
                               "(7.6 GiB in 61 buffers), comp_cache{0..60} (1.9 GiB in 61 buffers), q{0..60} ")
        assert "--sizes" in line and "a device with more memory" in line
        assert "no-verify" not in line and "verify=False" not in line  # turning verify off is no remedy

    def test_without_verify_the_static_buffers_alone_are_refused(self, builds, monkeypatch, capsys):
        monkeypatch.setitem(BACKENDS, BackendKind.CPU, SmallHost)
        status = main(["run", PLAN, "--backend", "cpu", "--no-verify", "--quiet"])
        out, err = capsys.readouterr()
        assert (status, out, builds) == (1, "", [])
        (line,) = err.splitlines()
        assert ("the plan needs 10.6 GiB on the host (10.6 GiB of static buffers) but 4.0 GiB is free: 6.6 GiB "
                "short.") in line


class TestPipeline:
    def test_run_pipeline_raises_in_allocate_with_nothing_built(self, builds):
        backend = SmallHost()
        with pytest.raises(CaptureError) as info:
            run_pipeline(load_plan(PLAN), RunOptions(backend="cpu"), backend=backend)
        error = info.value
        assert (error.phase, error.descriptor, error.segment, error.undo_error) == ("allocate", None, None, None)
        assert builds == []
        assert " short. The largest buffers: kv_cache{0..60} " in error.message
        assert backend.remapped == {"cuda:0": "cpu"}  # the plan's devices as the backend maps them: one host

    def test_a_plan_that_fits_builds_the_model(self, builds):
        backend = SmallHost()
        backend.free = 64 * GiB
        with pytest.raises(CaptureError) as info:
            run_pipeline(load_plan(PLAN), RunOptions(backend="cpu"), backend=backend)
        assert info.value.phase == "allocate" and "the model was built" in info.value.message
        assert len(builds) == 1


class Cache(nn.Module):
    """A model holding its own cache, which the plan adopts."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1024, 256))

    def step(self, x, y):
        self.cache[0, :8].add_(x.sum())
        torch.add(x, 1, out=y)


def cache_plan(**changes) -> Plan:
    buffers = (Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
               Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT),
               Buffer("cache", (1024, 256), "float32", "cuda:0", role=BufferRole.STATE, adopt="cache"))
    segment = Segment("step", SegmentKind.GRAPH, "step", stream="s0", reads=("x", "cache"), writes=("y", "cache"))
    return Plan("cached", buffers=buffers, streams=(Stream("s0", "cuda:0"),), segments=(segment,),
                capture=CaptureSettings(modes=(Mode.PIECEWISE,), sizes=(2,)), **changes)


class TestAdoptedBuffers:
    """An adopted buffer the model already holds is memory taken, not memory needed."""

    OPTIONS = RunOptions(backend="cpu", verify=False, detectors=False)

    def test_a_given_model_s_adopted_buffers_are_left_to_the_late_check(self):
        backend = SmallHost()
        backend.free = 1 << 19  # room for x and y, not for the 1 MiB cache: the model holds it
        with run_pipeline(cache_plan(), self.OPTIONS, backend=backend, model=Cache()) as engine:
            assert engine.buffers.tensors["y"].shape == (2, 8)

    def test_without_a_model_they_are_counted_before_the_factory_is_called(self, builds):
        backend = SmallHost()
        backend.free = 1 << 19
        with pytest.raises(CaptureError) as info:
            run_pipeline(cache_plan(model="graphflow.integrations.dsv4:build_model"), self.OPTIONS, backend=backend)
        assert info.value.phase == "allocate" and builds == []
        assert info.value.message.startswith("the plan needs 1.0 MiB on the host (1.0 MiB of static buffers) but "
                                             "512.0 KiB is free")
