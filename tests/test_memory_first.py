"""The memory check from the plan alone: a plan too large for the device is refused in
allocate before the model is built, by ``run_pipeline`` and so by ``graphflow run``.

Building the 61-layer model takes minutes on a host; these tests prove the refusal
comes first by the factory never being called. The backend here reports a small free
figure, so the refusal does not depend on the machine the tests run on.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

from graphflow.cli import main
from graphflow.engine import RunOptions, memory, run_pipeline
from graphflow.engine.backend import BACKENDS, BackendKind, CpuBackend
from graphflow.errors import CaptureError
from graphflow.integrations import dsv4
from graphflow.plan.loader import load_plan
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream

PLAN = "plans/dsv4_61l_decode.yaml"
ROOT = pathlib.Path(__file__).resolve().parents[1]
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
        monkeypatch.setattr(memory, "host_available", lambda: SmallHost.free)
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
        monkeypatch.setattr(memory, "host_available", lambda: SmallHost.free)
        status = main(["run", PLAN, "--backend", "cpu", "--no-verify", "--quiet"])
        out, err = capsys.readouterr()
        assert (status, out, builds) == (1, "", [])
        (line,) = err.splitlines()
        assert ("the plan needs 10.6 GiB on the host (10.6 GiB of static buffers) but 4.0 GiB is free: 6.6 GiB "
                "short.") in line


    def test_on_the_host_the_refusal_comes_before_torch_is_imported(self, tmp_path):
        """``graphflow run`` on the CPU backend checks the plan before it loads torch
        (which alone takes a second or two): a plan no machine can hold, in a fresh
        interpreter, is refused with torch never imported and the factory never loaded."""
        plan = tmp_path / "huge.yaml"
        plan.write_text("graphflow: 1\nname: huge\nmodel: plans.toy_model:build_toy\nsymbols: {B: [1, 2]}\n"
                        "streams: {s0: {device: cuda:0}}\n"
                        "buffers:\n  x: {shape: [B, 34359738368], dtype: float32, device: cuda:0, role: input}\n"
                        "  y: {shape: [B, 8], dtype: float32, device: cuda:0, role: output}\n"
                        "segments:\n  - {name: f, kind: graph, call: f, reads: [x], writes: [y], stream: s0}\n"
                        "capture: {modes: [FULL], sizes: B}\n")
        code = ("import sys; from graphflow.cli import main; status = main(['run', sys.argv[1], '--backend', 'cpu']); "
                "assert 'torch' not in sys.modules, 'torch was imported'; sys.exit(status)")
        done = subprocess.run([sys.executable, "-c", code, str(plan)], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 1, done.stderr
        assert "[phase=allocate rank=0] the plan needs 512.0 GiB on the host" in done.stderr
        assert "Traceback" not in done.stderr


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
