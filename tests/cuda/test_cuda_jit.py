"""JIT kernels on a GPU: the CuTe DSL RMSNorm against PyTorch, cold kernels refused inside
capture, prewarmed kernels captured and replayed, a launch without ``stream=``, and the
dsv4 mini plans on the CuTe kernel.

CuTe tests skip where nvidia-cutlass-dsl is absent; Triton tests where Triton is. On the
GPU machine the package comes from an archive (shared/tools/cute_bundle.sh); the command
that unpacks it and runs this file is in docs/jit.md.
"""

from __future__ import annotations

import gc
import pathlib
import traceback

import pytest
import torch
import torch.nn.functional as F

from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.engine.jit import JitRegistry, TritonKernel
from graphflow.engine.locus import Locus

pytestmark = pytest.mark.cuda

PLANS = pathlib.Path(__file__).resolve().parents[2] / "plans"
STEPS = 64


def _cute():
    try:
        from graphflow.integrations.dsv4 import cute_rms
    except ImportError:
        pytest.skip("nvidia-cutlass-dsl is not installed")
    return cute_rms


@pytest.fixture
def registry(tmp_path):
    return JitRegistry()


@pytest.fixture
def cute_rms(registry):
    """A fresh CuTe RMSNorm (nothing compiled yet), registered in a fresh registry."""
    return registry.register(_cute().CuteRMSNorm("test.rms_norm"))


def rms(kernel, x, weight, eps=1e-6):
    out = torch.full_like(x, float("nan"))  # poisoned: every element must be written
    kernel(x, weight, out, eps)
    return out


def reference64(x, weight, eps=1e-6):
    x64 = x.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def ulps(got, want):
    """max |got - want| / (eps * |want| / 2): at most 1 for a correctly rounded result."""
    spacing = torch.finfo(got.dtype).eps * want.abs().clamp_min(torch.finfo(got.dtype).tiny) / 2
    return ((got.double() - want).abs() / spacing.double()).max().item()


SHAPES = [(1, 2048), (8, 2048), (32, 8192), (128, 2048), (512, 8192), (5, 3, 100), (2, 64), (3, 256), (7, 3),
          (1, 32768)]


class TestCuteRMSNorm:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("shape", SHAPES)
    def test_matches_pytorch_on_fresh_random_inputs(self, cute_rms, shape, dtype):
        generator = torch.Generator(device="cuda").manual_seed(hash(shape) % 1000)
        for trial in range(3):
            x = (torch.randn(shape, device="cuda", generator=generator) * (1 + trial)).to(dtype)
            weight = torch.randn(shape[-1], device="cuda", generator=generator).to(dtype)
            got = rms(cute_rms, x, weight)
            assert not got.isnan().any(), "an element was not written"
            torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), weight, 1e-6))  # one rounding either way
            # Against float64: bf16 is the rounding itself (<= 1 ulp); in float32 the sum's
            # rounding (chains of at most ~70 additions) and rsqrt.approx stay within 4e-6.
            assert ulps(got, reference64(x, weight)) <= (64 if dtype == torch.float32 else 1.01)

    def test_misaligned_views_take_a_narrower_vector_and_stay_correct(self, registry, cute_rms):
        base = torch.randn(4 * 2048 + 3, device="cuda", dtype=torch.bfloat16)
        x = base[3:].view(4, 2048)  # 6 bytes past a 16-byte boundary
        weight = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        assert registry.spec(cute_rms, (x, weight, out, 1e-6)).get("vec") == 1
        torch.testing.assert_close(rms(cute_rms, x, weight), F.rms_norm(x, (2048,), weight, 1e-6))

    def test_is_deterministic(self, cute_rms):
        x = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
        first = rms(cute_rms, x, weight)
        assert all(torch.equal(first, rms(cute_rms, x, weight)) for _ in range(5))

    def test_a_prewarmed_kernel_captures_under_the_tripwires_and_replays(self, registry, cute_rms):
        x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
        weight = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        stream = torch.cuda.Stream()
        _warmup(registry, cute_rms, (x, weight, out, 1e-6))
        report = registry.prewarm({x.device: stream}, declared={"L0.pre": ["test.rms_norm"]})
        assert (report.compiled, report.launched, report.unseen, report.problems) == (0, 1, (), ())
        graph = torch.cuda.CUDAGraph()
        with registry.tripwires(), torch.cuda.graph(graph, stream=stream):
            cute_rms(x, weight, out, 1e-6)
        x.normal_()
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, rms(cute_rms, x, weight))


def _warmup(registry, kernel, args, segment="L0.pre"):
    """What the pipeline's warmup does for the registry: one eager call inside a segment of
    the warmup phase, in the locus the registry follows."""
    locus = Locus()
    registry.attach(locus)
    with locus.at(phase=Phase.WARMUP), locus.segment(segment):
        kernel(*args)
    torch.cuda.synchronize()


def _cold_capture(registry, launch):
    """Capture ``launch`` with the tripwires on; return the error, checking nothing is left."""
    gc.collect()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(CaptureError) as info:
        with registry.tripwires(), torch.cuda.graph(graph, stream=stream):
            launch()
    error = info.value
    traceback.clear_frames(error.__traceback__)  # the frames hold what the failed capture allocated
    del info, graph
    gc.collect()
    torch.cuda.synchronize()
    assert not torch.cuda.is_current_stream_capturing()
    with torch.cuda.stream(stream):
        assert not torch.cuda.is_current_stream_capturing()
    assert torch.cuda.memory_allocated() == baseline
    return error


class TestColdKernelsInCapture:
    def test_a_cold_cute_kernel_is_a_named_capture_error(self, registry, cute_rms):
        x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
        weight, out = torch.ones(2048, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
        error = _cold_capture(registry, lambda: cute_rms(x, weight, out, 1e-6))
        assert "JIT kernel test.rms_norm specialization test.rms_norm[dtype=bfloat16, n=2048, vec=8, arch=sm_" in str(error)
        assert "would be first compiled on cuda:0 inside the capture" in str(error)
        assert error.hint.startswith("declare prewarm for test.rms_norm")
        torch.testing.assert_close(rms(cute_rms, x, weight), F.rms_norm(x, (2048,), weight, 1e-6))  # usable after

    def test_a_compiled_but_never_launched_cute_kernel_is_refused_at_its_module_load(self, registry, cute_rms):
        x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
        weight, out = torch.ones(2048, device="cuda", dtype=torch.bfloat16), torch.empty_like(x)
        spec = registry.spec(cute_rms, (x, weight, out, 1e-6))
        cute_rms._ready(spec, (x, weight, out, 1e-6))  # compiled; its module loads at the first launch
        compiled = cute_rms.compiled(spec)
        import cuda.bindings.driver as cuda

        def raw_launch():  # not through the registry: only the class-level tripwire stands guard
            compiled(*cute_rms.arguments(spec, x, weight, out, 1e-6),
                     cuda.CUstream(torch.cuda.current_stream().cuda_stream))

        error = _cold_capture(registry, raw_launch)
        assert "CuTe DSL module load of" in str(error)

    def test_a_cold_triton_kernel_is_a_named_capture_error(self, registry):
        kernel = _fresh_triton(registry, "test.triton_add")
        x = torch.randn(1024, device="cuda")
        error = _cold_capture(registry, lambda: kernel(x, x))
        assert "JIT kernel test.triton_add specialization" in str(error)
        assert "would be first compiled on cuda:0 inside the capture" in str(error)  # Triton's cache: unknown

    def test_triton_compiles_outside_the_registry_are_caught_by_its_hooks(self, registry):
        add = _fresh_triton(registry, "test.triton_raw").launch
        x = torch.randn(1024, device="cuda")
        error = _cold_capture(registry, lambda: add(x, x))
        assert "Triton compile of" in str(error) and "in-memory cache miss on device 0" in str(error)
        add(x, x)  # compiles, loads and runs normally afterwards
        torch.cuda.synchronize()

    def test_a_triton_kernel_compiled_by_warmup_but_not_loaded_is_refused_and_stays_usable(self, registry):
        add = _fresh_triton(registry, "test.triton_warm").launch
        x = torch.randn(1024, device="cuda")
        compiled = add.kernel.warmup(x, x, x, x.numel(), BLOCK=1024, grid=(1,))  # compiles, does not load
        assert compiled.module is None
        error = _cold_capture(registry, lambda: add(x, x))
        assert "Triton module load of" in str(error)
        out = add(x, x)
        torch.cuda.synchronize()
        assert torch.equal(out, 2 * x)

    def test_a_collective_kernel_prepared_without_a_launch_captures_and_replays(self, registry):
        """The warmup policy 'prepare': the hook loads the specialization, nothing runs, and
        the launch inside capture loads nothing."""
        _cute()
        from tests.cute_kernels import Bump, _bump_on_stream

        kernel = registry.register(Bump("test.collective", _bump_on_stream))
        kernel.communicates = True
        x = torch.zeros(32, device="cuda")
        registry.prepare_hook(kernel)(x)
        torch.cuda.synchronize()
        assert torch.equal(x, torch.zeros(32, device="cuda"))  # prepared, not launched
        graph = torch.cuda.CUDAGraph()
        with registry.tripwires(), torch.cuda.graph(graph):
            kernel(x)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones(32, device="cuda"))

    def test_prewarmed_triton_and_cute_kernels_capture_and_replay(self, registry, cute_rms):
        kernel = _fresh_triton(registry, "test.triton_pre")
        x = torch.randn(1024, device="cuda")
        h = torch.randn(4, 8192, device="cuda", dtype=torch.bfloat16)
        weight, normed = torch.ones(8192, device="cuda", dtype=torch.bfloat16), torch.empty_like(h)
        locus = Locus()
        registry.attach(locus)
        with locus.at(phase=Phase.WARMUP):
            for name, call in (("a", lambda: kernel(x, x)), ("b", lambda: cute_rms(h, weight, normed, 1e-6))):
                with locus.segment(name):
                    call()
        stream = torch.cuda.Stream()
        report = registry.prewarm({x.device: stream})
        assert report.launched == 2 and len(report.specializations) == 2
        graph = torch.cuda.CUDAGraph()
        with registry.tripwires(), torch.cuda.graph(graph, stream=stream):
            doubled = kernel(x, x)
            cute_rms(h, weight, normed, 1e-6)
        x.copy_(torch.arange(1024.0, device="cuda"))
        h.normal_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(doubled, 2 * x)
        torch.testing.assert_close(normed, F.rms_norm(h, (8192,), weight, 1e-6))


def _fresh_triton(registry, name):
    """A Triton add kernel no test has launched (each call defines a new JITFunction)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def _add(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(out_ptr + offsets, tl.load(a_ptr + offsets, mask=mask) + tl.load(b_ptr + offsets, mask=mask),
                 mask=mask)

    def add(a, b):
        out = torch.empty_like(a)
        _add[(triton.cdiv(a.numel(), 1024),)](a, b, out, a.numel(), BLOCK=1024)
        return out

    add.kernel = _add
    return registry.register(TritonKernel(name, add, lambda a, b: {"dtype": str(a.dtype), "block": 1024}))


class TestLaunchWithoutStream:
    def kernels(self, registry):
        _cute()
        from tests.cute_kernels import Bump, _bump_on_default_stream, _bump_on_stream

        return (registry.register(Bump("test.bump", _bump_on_stream)),
                registry.register(Bump("test.bump_default", _bump_on_default_stream)))

    def test_inside_capture_it_is_refused(self, registry):
        _, unstreamed = self.kernels(registry)
        x = torch.zeros(32, device="cuda")
        unstreamed(x)  # eagerly it runs (on the default stream)
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones(32, device="cuda"))
        error = _cold_capture(registry, lambda: unstreamed(x))
        assert "launches _bump without stream=" in str(error)

    def test_unchecked_it_runs_eagerly_and_the_graph_lacks_it(self, registry):
        streamed, unstreamed = self.kernels(registry)
        x, y = torch.zeros(32, device="cuda"), torch.zeros(32, device="cuda")
        streamed(x)
        unstreamed(y)
        torch.cuda.synchronize()
        spec_x, spec_y = (registry.spec(k, (t,)) for k, t in ((streamed, x), (unstreamed, y)))
        graph = torch.cuda.CUDAGraph()
        import cuda.bindings.driver as cuda

        with torch.cuda.graph(graph):  # no tripwires: what happens without graphflow
            handle = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
            streamed.executor(spec_x, x.device)(*streamed.arguments(spec_x, x), handle)
            unstreamed.executor(spec_y, y.device)(*unstreamed.arguments(spec_y, y), handle)
        torch.cuda.synchronize()
        assert torch.equal(x, torch.ones(32, device="cuda"))  # captured, not run
        assert torch.equal(y, torch.full((32,), 2.0, device="cuda"))  # ran during capture, eagerly
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full((32,), 2.0, device="cuda"))
        assert torch.equal(y, torch.full((32,), 2.0, device="cuda"))  # silently absent from the graph


@pytest.fixture(scope="module", params=["dsv4_mini_piecewise.yaml", "dsv4_mini_full.yaml"])
def cute_engine(request):
    _cute()
    from graphflow.integrations.dsv4.plans import plan_variant
    from graphflow.engine.jit import registry

    engine = run_pipeline(plan_variant(PLANS / request.param, rms_kernel="cute"), RunOptions(backend="cuda"), listeners=[registry])
    yield engine, registry
    engine.close()


class TestDsv4OnTheCuteKernel:
    def test_the_plan_captured_and_verified_bit_exact_with_the_cute_kernel(self, cute_engine):
        engine, registry = cute_engine
        assert engine.report.captures_graphs
        assert all(v.bit_exact for v in engine.report.verify)
        used = {name for _, name in registry.uses()}
        assert used == {"dsv4.rms_norm"}
        specs = {str(spec) for pairs in registry.uses().values() for spec, _ in pairs}
        assert specs == {f"dsv4.rms_norm[dtype=float32, n={n}, vec=4, arch=sm_90a]" for n in (64, 256)}

    @pytest.mark.parametrize("size", [1, 8, 32])
    def test_64_step_greedy_decode_replays_bit_for_bit(self, cute_engine, size):
        from graphflow.integrations.dsv4.decode import decode_both

        engine, _ = cute_engine
        replayed, eager = decode_both(engine, size, STEPS)
        assert torch.equal(replayed.tokens, eager.tokens)
        for step in range(STEPS):
            assert torch.equal(replayed.logits[step], eager.logits[step]), f"logits differ at step {step}"
