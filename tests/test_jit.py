"""The JIT registry, its prewarm and its capture checks, on the CPU.

A JIT kernel's launch needs a GPU, so the kernel here is a stand-in: it counts its
compiles, loads and launches and computes on the host. Everything around it is real:
the registry, the events of a real CPU pipeline (run_pipeline on the CPU backend, whose
capture phase runs each region once, so the registry's capture check fires in the same
phase as on CUDA), the channel runtime's prepare path. tests/test_jit_cute.py compiles
real CuTe DSL kernels; tests/cuda/test_cuda_jit.py launches and captures them.
"""

from __future__ import annotations

import pytest
from locus_driver import LocusDriver
import torch

from graphflow.dist.channels import ChannelRuntime
from graphflow.engine import CpuBackend, RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.events import Event, EventKind, Phase
from graphflow.engine.jit import JitKernel, JitRegistry, PrewarmReport, Specialization
from graphflow.plan import (Buffer, BufferRole, CaptureSettings, Channel, ChannelKind, Descriptor, Mode, Plan, Prewarm, Segment,
                            SegmentKind, Stream, WarmupPolicy)

CPU = torch.device("cpu")


class HostKernel(JitKernel):
    """Stands in for a GPU kernel: ``out = 2 * x``, specialized on dtype and row length."""

    kind = "host"

    def __init__(self, name: str = "test.double", *, communicates: bool = False):
        super().__init__(name, communicates=communicates)
        self.compiles: list[Specialization] = []
        self.launches: list[tuple[Specialization, object]] = []
        self.loads: list[Specialization] = []
        self._done: set[Specialization] = set()

    def specialize(self, x, out):
        return {"dtype": str(x.dtype).removeprefix("torch."), "n": x.shape[-1]}

    def arch(self, device):
        return device.type  # a host "kernel" targets the host, whatever CUTE_DSL_ARCH says

    def is_compiled(self, spec):
        return spec in self._done

    def _ready(self, spec, args):
        if spec in self._done:
            return "cached"
        self._done.add(spec)
        self.compiles.append(spec)
        return "compiled"

    def _launch(self, spec, args, stream):
        x, out = args
        out.copy_(2 * x)
        self.launches.append((spec, stream))

    def _load(self, spec, args):
        self.loads.append(spec)


_WALKS: dict[int, LocusDriver] = {}


def events(registry, *kinds_and_fields):
    """The pipeline's events and locus moves, as the engine makes them, for one registry."""
    walk = _WALKS.setdefault(id(registry), LocusDriver())
    for kind, fields in kinds_and_fields:
        registry.on_event(walk.event(kind, **fields))
        walk.after(kind)


@pytest.fixture
def registry():
    return JitRegistry()


@pytest.fixture
def kernel(registry):
    return registry.register(HostKernel())


class TestRegistry:
    def test_a_call_compiles_its_specialization_once_and_launches_every_time(self, registry, kernel):
        x, out = torch.ones(3, 8), torch.empty(3, 8)
        kernel(x, out)
        kernel(x + 1, out)
        kernel(torch.ones(2, 16), torch.empty(2, 16))
        assert torch.equal(out, torch.full((3, 8), 4.0))
        assert [str(s) for s in kernel.compiles] == ["test.double[dtype=float32, n=8, arch=cpu]",
                                                     "test.double[dtype=float32, n=16, arch=cpu]"]
        assert len(kernel.launches) == 3
        assert registry.is_warm(kernel.compiles[0], "cpu")

    def test_names_are_unique_and_lookups_say_what_is_registered(self, registry, kernel):
        with pytest.raises(ValueError, match="already registered"):
            registry.register(HostKernel())
        assert registry.register(kernel) is kernel
        with pytest.raises(KeyError, match=r"registered are \['test.double'\]"):
            registry.kernel("nope")

    def test_an_unregistered_kernel_says_so(self):
        with pytest.raises(RuntimeError, match="not registered"):
            HostKernel()(torch.ones(1), torch.empty(1))

    def test_uses_are_recorded_per_segment_from_the_events_and_reset_per_pipeline(self, registry, kernel):
        x, out = torch.ones(2, 8), torch.empty(2, 8)
        events(registry, (EventKind.PIPELINE_BEGIN, {}), (EventKind.PHASE_BEGIN, {"phase": Phase.WARMUP}),
               (EventKind.SEGMENT_BEGIN, {"segment": "L0.norm"}))
        kernel(x, out)
        events(registry, (EventKind.SEGMENT_END, {"segment": "L0.norm"}))
        kernel(x, out)  # outside any segment: not a use of one
        spec = registry.spec(kernel, (x, out))
        assert registry.uses() == {("L0.norm", "test.double"): frozenset({(spec, CPU)})}
        events(registry, (EventKind.PIPELINE_BEGIN, {}))
        assert registry.uses() == {}


class TestCaptureCheck:
    """A registered kernel's cold launch inside a capture, with a switched predicate."""

    def test_a_cold_specialization_inside_capture_is_a_capture_error_naming_everything(self, registry, kernel):
        events(registry, (EventKind.PIPELINE_BEGIN, {}), (EventKind.PHASE_BEGIN, {"phase": Phase.CAPTURE}),
               (EventKind.DESCRIPTOR_BEGIN, {"descriptor": Descriptor(Mode.PIECEWISE, 4)}),
               (EventKind.REGION_BEGIN, {"region": "target:L3.mix"}), (EventKind.SEGMENT_BEGIN, {"segment": "L3.mix"}))
        assert registry.capturing()
        with pytest.raises(CaptureError) as info:
            kernel(torch.ones(4, 8), torch.empty(4, 8))
        error = info.value
        assert (error.phase, error.segment, error.descriptor) == ("capture", "L3.mix", Descriptor(Mode.PIECEWISE, 4))
        assert str(error).startswith(
            "[phase=capture descriptor=PIECEWISE(B=4) segment=L3.mix] JIT kernel test.double specialization "
            "test.double[dtype=float32, n=8, arch=cpu] would be first compiled on cpu inside the capture of "
            "segment L3.mix — declare prewarm for test.double: list it in the kernels of segment L3.mix")
        assert kernel.compiles == [] and kernel.launches == []  # refused before anything ran

    def test_a_warm_specialization_launches_inside_capture(self, registry, kernel):
        x, out = torch.ones(4, 8), torch.empty(4, 8)
        kernel(x, out)
        with registry.tripwires(capturing=lambda: True):
            kernel(x, out)
        assert len(kernel.launches) == 2

    def test_compiled_but_never_launched_on_this_device_says_launched(self, registry, kernel):
        x, out = torch.ones(4, 8), torch.empty(4, 8)
        kernel._ready(registry.spec(kernel, (x, out)), (x, out))
        with registry.tripwires(capturing=lambda: True), pytest.raises(CaptureError, match="first launched on cpu"):
            kernel(x, out)

    def test_warm_on_one_device_is_cold_on_another(self, registry):
        class OnCuda1(HostKernel):
            def device(self, x, out):
                return torch.device("cuda", 1) if x.shape[0] == 1 else CPU

            def arch(self, device):
                return "sm_90a"

        kernel = registry.register(OnCuda1())
        kernel(torch.ones(2, 8), torch.empty(2, 8))  # warm on cpu
        with registry.tripwires(capturing=lambda: True), pytest.raises(CaptureError) as info:
            kernel(torch.ones(1, 8), torch.empty(1, 8))
        assert "first launched on cuda:1 (it was prewarmed on other devices only)" in str(info.value)

    def test_the_predicate_is_switched_only_while_the_tripwires_are_installed(self, registry, kernel):
        on = [True]
        with registry.tripwires(capturing=lambda: on[0]):
            assert registry.capturing()
            with registry.tripwires(capturing=lambda: False):
                assert not registry.capturing()
            assert registry.capturing()
        assert not registry.capturing()
        kernel(torch.ones(1, 8), torch.empty(1, 8))  # no capture: compiles and launches


class TestPrewarm:
    def warmed_up(self, registry, kernel, shapes=((4, 8), (4, 16))):
        events(registry, (EventKind.PIPELINE_BEGIN, {}), (EventKind.PHASE_BEGIN, {"phase": Phase.WARMUP}))
        for i, shape in enumerate(shapes):
            events(registry, (EventKind.SEGMENT_BEGIN, {"segment": f"L{i}.norm"}))
            kernel(torch.ones(shape), torch.empty(shape))
            events(registry, (EventKind.SEGMENT_END, {"segment": f"L{i}.norm"}))
        events(registry, (EventKind.PHASE_END, {"phase": Phase.WARMUP}),
               (EventKind.PHASE_BEGIN, {"phase": Phase.PREWARM}))

    def test_every_specialization_warmup_launched_is_launched_once_on_every_capture_stream(self, registry, kernel):
        self.warmed_up(registry, kernel)
        stream = object()
        kernel.launches.clear()
        report = registry.prewarm({CPU: stream}, declared={"L0.norm": ["test.double"], "L1.norm": ["test.double"]})
        assert [(str(e.spec), e.device, e.compiled, e.loaded, e.launched) for e in report.entries] == [
            ("test.double[dtype=float32, n=8, arch=cpu]", "cpu", False, False, True),
            ("test.double[dtype=float32, n=16, arch=cpu]", "cpu", False, False, True)]
        assert [s for s, _ in kernel.launches] == list(report.specializations)
        assert all(given is stream for _, given in kernel.launches)  # the capture stream, passed explicitly
        assert (report.launched, report.compiled, report.unseen, report.undeclared) == (2, 0, (), ())
        assert report.summary().startswith("2 JIT specialization(s) on 1 device(s): 0 compiled, 0 loaded from "
                                           "cache, 2 launched")

    def test_scratch_arguments_keep_the_recorded_shape_stride_dtype_and_alignment(self, registry, kernel):
        seen = []
        kernel._launch = lambda spec, args, stream: seen.append(args)
        base = torch.ones(4 * 8 + 1, dtype=torch.float32)
        x = base[1:].view(4, 8)  # 4 bytes past a 64-byte boundary
        events(registry, (EventKind.PIPELINE_BEGIN, {}), (EventKind.SEGMENT_BEGIN, {"segment": "s"}))
        kernel(x, torch.empty(4, 8))
        registry.prewarm({CPU: None})
        (scratch_x, scratch_out), = seen[1:]
        assert scratch_x.shape == (4, 8) and scratch_x.stride() == (8, 1) and scratch_x.dtype == torch.float32
        assert scratch_x.data_ptr() % 8 == 4 and not scratch_x.any()

    def test_kernels_declared_with_examples_are_prewarmed_without_warmup(self, registry):
        class Declared(HostKernel):
            def examples(self, size, device):
                return [(torch.zeros(size, 32, device=device), torch.empty(size, 32, device=device))]

        kernel = registry.register(Declared("test.declared"))
        events(registry, (EventKind.PIPELINE_BEGIN, {}))
        report = registry.prewarm({CPU: None}, sizes=[8, 1], declared={"L0.moe": ["test.declared"]})
        assert [str(s) for s in report.specializations] == ["test.declared[dtype=float32, n=32, arch=cpu]"]
        assert report.compiled == 1 and report.launched == 1  # one spec for every size: rows are dynamic
        assert report.unseen == ()

    def test_declared_but_never_seen_and_seen_but_undeclared_are_reported(self, registry, kernel):
        registry.register(HostKernel("test.other"))
        self.warmed_up(registry, kernel, shapes=((4, 8),))
        report = registry.prewarm({CPU: None}, declared={"L0.norm": ["test.other"], "L9.head": ["not.registered"]})
        assert report.unseen == (("L0.norm", "test.other"),)
        assert report.undeclared == (("L0.norm", "test.double"),)
        assert "not seen in warmup: test.other in L0.norm" in report.summary()

    def test_a_kernel_that_communicates_is_loaded_never_launched(self, registry):
        kernel = registry.register(HostKernel("test.allreduce", communicates=True))
        self.warmed_up(registry, kernel, shapes=((2, 8),))
        kernel.launches.clear()
        report = registry.prewarm({CPU: None})
        assert kernel.launches == [] and kernel.loads == [registry.spec(kernel, (torch.ones(2, 8), torch.ones(2, 8)))]
        assert report.entries[0].launched is False and report.launched == 0

    def test_scratch_that_specializes_differently_is_refused(self, registry):
        class Shrinking(HostKernel):
            def scratch(self, spec, device, example):
                return torch.zeros(1, 3), torch.zeros(1, 3)

        kernel = registry.register(Shrinking())
        self.warmed_up(registry, kernel, shapes=((2, 8),))
        with pytest.raises(CaptureError, match=r"specialize to test.double\[dtype=float32, n=3, arch=cpu\], not "
                                               r"test.double\[dtype=float32, n=8, arch=cpu\].*override Shrinking"):
            registry.prewarm({CPU: None})

    def test_an_empty_pipeline_prewarms_nothing(self, registry):
        assert registry.prewarm({CPU: None}) == PrewarmReport()


class TestPrepareHook:
    """A channel under warmup 'prepare': its prepare hook prewarms the collective's kernel
    for the input tensor and no communication happens."""

    def plan(self):
        return Plan(
            name="prepared", streams=[Stream("s0", "cuda:0")],
            buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", BufferRole.INPUT),
                     Buffer("y", ("B", 8), "float32", "cuda:0", BufferRole.OUTPUT)],
            channels=[Channel("ar", ChannelKind.ALL_REDUCE, "tp", 1, "target", WarmupPolicy.PREPARE, "ar",
                              jit=True)],
            segments=[Segment("reduce", SegmentKind.GRAPH, "reduce", ("x",), ("y",), "s0", ("ar",),
                              kernels=("test.allreduce",))],
            prewarm=[Prewarm("ar", "prepare_ar", per_size=False)],
            capture=CaptureSettings(modes=(Mode.PIECEWISE,), sizes=(2, 1), warmup_iters=2))

    def test_warmup_prepares_each_specialization_once_without_communicating(self, registry):
        kernel = registry.register(HostKernel("test.allreduce", communicates=True))
        plan = self.plan()
        channels = ChannelRuntime(plan, tracer=False)
        handle = channels.handles["ar"]
        handle.set_prepare(registry.prepare_hook(kernel, lambda t: (t, torch.empty_like(t))))
        reduced = []

        class Model:
            def reduce(self, x, y):
                y.copy_(handle.all_reduce(x.clone()))
                reduced.append(handle.path().value)

            def prepare_ar(self):
                """The plan's declared hook; the handle's own prepare (set above) serves warmup."""

        run_pipeline(plan, RunOptions(verify=False), backend=CpuBackend(), model=Model(), channels=channels, listeners=[registry])
        specs = {registry.spec(kernel, (torch.ones(n, 8), torch.ones(n, 8))) for n in (1, 2)}
        assert len(specs) == 1  # rows are not part of the specialization
        assert kernel.loads == list(specs) and kernel.launches == []
        assert registry.is_warm(next(iter(specs)), CPU)
        assert "prepare" in reduced and "captured" in reduced


class TestInAPipeline:
    """The registry as a listener of a real CPU pipeline."""

    def plan(self):
        return Plan(
            name="jit", streams=[Stream("s0", "cuda:0")],
            buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", BufferRole.INPUT),
                     Buffer("y", ("B", 8), "float32", "cuda:0", BufferRole.OUTPUT)],
            segments=[Segment("double", SegmentKind.GRAPH, "double", ("x",), ("y",), "s0", kernels=("test.double",))],
            capture=CaptureSettings(modes=(Mode.PIECEWISE,), sizes=(4, 2), warmup_iters=1))

    def test_warmup_uses_make_capture_warm(self, registry, kernel):
        class Model:
            def double(self, x, y):
                kernel(x, y)

        engine = run_pipeline(self.plan(), backend=CpuBackend(), model=Model(), listeners=[registry])
        engine.close()
        assert len(kernel.compiles) == 1
        assert set(registry.uses()) == {("double", "test.double")}

    def test_a_capture_only_path_with_a_cold_specialization_fails_the_pipeline_naming_it(self, registry, kernel):
        class Model:
            def double(self, x, y):
                if registry.capturing():  # what `if torch.cuda.is_current_stream_capturing():` branches do
                    kernel(x.double(), y.double())
                else:
                    kernel(x, y)

        backend = CpuBackend()
        with pytest.raises(CaptureError) as info:
            run_pipeline(self.plan(), backend=backend, model=Model(), listeners=[registry])
        error = info.value
        assert (error.phase, error.segment, error.descriptor, error.rank) == (
            "capture", "double", Descriptor(Mode.PIECEWISE, 4), 0)
        assert "test.double[dtype=float64, n=8, arch=cpu] would be first compiled on cpu" in str(error)
        assert not registry.capturing()  # the rollback event reset where the registry thinks it is


class TestDsv4Backends:
    """The dsv4 model's RMSNorm backend, chosen per plan (``model_args.rms_kernel``)."""

    def test_an_unknown_backend_is_refused_by_the_config_and_the_kernels(self):
        from graphflow.integrations.dsv4 import DSV4Config
        from graphflow.integrations.dsv4.kernels import jit_kernel

        with pytest.raises(ValueError, match="rms_kernel"):
            DSV4Config(rms_kernel="cutlass")
        with pytest.raises(ValueError, match="choose one of cute, triton, torch"):
            jit_kernel("cutlass")

    @pytest.mark.parametrize("backend", ["cute", "triton", "torch"])
    def test_off_cuda_every_backend_is_pytorchs(self, backend):
        from graphflow.integrations.dsv4.kernels import rms_norm, uses_jit

        x, weight = torch.randn(3, 64), torch.randn(64)
        assert not uses_jit(x, weight, backend)
        assert torch.equal(rms_norm(x, weight, 1e-6, backend), torch.nn.functional.rms_norm(x, (64,), weight, 1e-6))

    def test_a_plan_on_the_cute_kernel_builds_and_runs_on_the_cpu(self):
        import pathlib

        from graphflow.integrations.dsv4.plans import plan_variant

        plans = pathlib.Path(__file__).resolve().parents[1] / "plans"
        plan = plan_variant(plans / "dsv4_mini_piecewise.yaml", sizes=(2,), rms_kernel="cute", n_layers=1)
        assert plan.model_args["rms_kernel"] == "cute"
        run_pipeline(plan, backend=CpuBackend()).close()

    def test_a_cuda_model_on_the_cute_kernel_needs_the_package(self, monkeypatch):
        from graphflow.integrations.dsv4 import DSV4Config, model

        monkeypatch.setattr(model, "cute_available", lambda: False)  # as where nvidia-cutlass-dsl is absent
        with pytest.raises(ValueError, match=r"rms_kernel: cute needs nvidia-cutlass-dsl \(pip install "
                                             r"'graphflow\[cutedsl\]'\)"):
            model.check_rms_kernel(DSV4Config(rms_kernel="cute"), torch.device("cuda", 0))
        model.check_rms_kernel(DSV4Config(rms_kernel="cute"), CPU)  # the CPU model runs PyTorch's
