"""Real CuTe DSL compiles on the CPU: the dsv4 RMSNorm's specializations, persistence
across processes, the compile and load tripwires, and a launch without ``stream=``.

nvidia-cutlass-dsl compiles with no GPU when the target architecture is given
(``CUTE_DSL_ARCH=sm_90a``); launching needs one (tests/cuda/test_cuda_jit.py). The
package is 260 MB, of no use on a machine without a GPU but for these tests: it is the
``cutedsl`` extra, not the ``test`` one, and the module is slow, run by CI's second step
(``pip install -e '.[cutedsl]'``, then ``pytest -m slow``); it skips where the package is
not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not torch.cuda.is_available():  # compile for an H200 where there is no GPU to ask
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytestmark = pytest.mark.slow
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is the cutedsl extra: pip install -e '.[cutedsl]'")

import cutlass.cute as cute  # noqa: E402
from cutlass.base_dsl.compiler import CompileCallable  # noqa: E402
from cutlass.base_dsl.jit_executor import JitCompiledFunction  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor  # noqa: E402
from cutlass.cutlass_dsl.cuda_jit_executor import CudaDialectJitCompiledFunction  # noqa: E402

from graphflow.errors import CaptureError  # noqa: E402
from graphflow.integrations.dsv4.cute_rms import CuteRMSNorm, RMSNormConfig  # noqa: E402
from graphflow.engine.jit import JitRegistry  # noqa: E402
from tests.cute_kernels import Bump, _bump_on_default_stream, _bump_on_stream  # noqa: E402

ARCH = os.environ.get("CUTE_DSL_ARCH") or "sm_{}{}a".format(*torch.cuda.get_device_capability())


@pytest.fixture
def registry(tmp_path):
    return JitRegistry(cache_dir=tmp_path / "jit")


def rms_args(rows, n, dtype, offset=0):
    base = torch.zeros(rows * n + offset, dtype=dtype)
    weight = torch.ones(n + offset, dtype=dtype)[offset:]
    return base[offset:].view(rows, n), weight, torch.empty(rows, n, dtype=dtype), 1e-6


class TestRMSNormSpecializations:
    @pytest.mark.parametrize("dtype, n, vec, threads, per_thread", [
        ("bfloat16", 2048, 8, 256, 1),  # the 61-layer plan's hidden size
        ("bfloat16", 8192, 8, 256, 4),  # its flattened hyper-connection streams (4 x 2048)
        ("float32", 2048, 4, 256, 2),
        ("float32", 8192, 4, 256, 8),
        ("float32", 64, 4, 32, 1),  # the mini plans: 16 vectors, half a warp idle
        ("float32", 256, 4, 64, 1),
        ("float16", 32768, 8, 1024, 4),  # the longest row
        ("float32", 3, 1, 32, 1),
    ])
    def test_threads_and_vectors_per_row(self, dtype, n, vec, threads, per_thread):
        config = RMSNormConfig(dtype, n, vec)
        assert (config.threads, config.per_thread) == (threads, per_thread)
        assert config.threads * config.per_thread * vec >= n

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("n", [64, 256, 2048, 8192])
    def test_every_dsv4_specialization_compiles(self, registry, dtype, n):
        kernel = registry.register(CuteRMSNorm())
        args = rms_args(3, n, dtype)
        spec = registry.spec(kernel, args)
        assert spec.parts == (("dtype", str(dtype).removeprefix("torch.")), ("n", n), ("vec", 16 // args[0].element_size()))
        assert spec.arch == ARCH
        assert kernel._ready(spec, args) == "compiled"
        assert isinstance(kernel.compiled(spec), CudaDialectJitCompiledFunction)
        assert kernel._ready(spec, rms_args(500, n, dtype)) == "cached"  # rows are a runtime argument

    def test_the_vector_narrows_to_what_the_row_and_the_addresses_allow(self, registry):
        kernel = registry.register(CuteRMSNorm())
        assert registry.spec(kernel, rms_args(2, 2048, torch.bfloat16, offset=1)).get("vec") == 1
        assert registry.spec(kernel, rms_args(2, 2048, torch.bfloat16, offset=4)).get("vec") == 4
        assert registry.spec(kernel, rms_args(2, 100, torch.bfloat16)).get("vec") == 4
        spec = registry.spec(kernel, rms_args(2, 2048, torch.bfloat16, offset=4))
        assert kernel._ready(spec, rms_args(2, 2048, torch.bfloat16, offset=4)) == "compiled"

    def test_unsupported_configs_are_refused(self):
        with pytest.raises(ValueError, match="must divide"):
            RMSNormConfig("float32", 6, 4)
        with pytest.raises(ValueError, match="unsupported dtype"):
            RMSNormConfig("int8", 64, 4)


class TestPersistence:
    SCRIPT = textwrap.dedent("""
        import os, sys, torch
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"
        from graphflow.engine.jit import JitRegistry
        from graphflow.integrations.dsv4.cute_rms import CuteRMSNorm
        registry = JitRegistry(cache_dir=sys.argv[1])
        kernel = registry.register(CuteRMSNorm())
        args = (torch.zeros(4, 2048, dtype=torch.bfloat16), torch.ones(2048, dtype=torch.bfloat16),
                torch.empty(4, 2048, dtype=torch.bfloat16), 1e-6)
        spec = registry.spec(kernel, args)
        print(kernel._ready(spec, args), type(kernel.compiled(spec)).__name__)
    """)

    @pytest.mark.slow
    def test_a_second_process_loads_what_the_first_compiled(self, tmp_path):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        runs = [subprocess.run([sys.executable, "-c", self.SCRIPT, str(tmp_path)], capture_output=True, text=True,
                               env=env, timeout=300) for _ in range(2)]
        assert [r.stdout.strip() for r in runs] == ["compiled CudaDialectJitCompiledFunction",
                                                    "loaded CudaDialectJitCompiledFunction"], runs[0].stderr
        files = sorted(p.suffix for p in (tmp_path / "dsv4.rms_norm").iterdir())
        assert files == [".h", ".json", ".o"]

    def test_an_entry_without_its_object_file_is_compiled_again(self, registry, tmp_path):
        kernel = registry.register(CuteRMSNorm())
        args = rms_args(2, 64, torch.float32)
        spec = registry.spec(kernel, args)
        kernel._ready(spec, args)
        for path in (registry.cache_dir / "dsv4.rms_norm").glob("*.o"):
            path.unlink()
        again = JitRegistry(cache_dir=registry.cache_dir).register(CuteRMSNorm())
        assert again._ready(spec, args) == "compiled"


class TestTripwires:
    def test_a_compile_and_a_module_load_inside_capture_are_refused(self, registry):
        a = make_fake_compact_tensor(cutlass.Float32, (32,))
        compiled = cute.compile(_bump_on_stream, a, cutlass.runtime.make_fake_stream())
        capturing = [True]
        with registry.tripwires(capturing=lambda: capturing[0]):
            with pytest.raises(CaptureError) as info:
                cute.compile(_bump_on_stream, a, cutlass.runtime.make_fake_stream())
            assert str(info.value).startswith("[phase=capture] CuTe DSL compile of _bump_on_stream inside the capture")
            assert "register it with graphflow.engine.jit" in info.value.hint
            with pytest.raises(CaptureError, match="CuTe DSL module load of .*_bump_on_stream"):
                compiled.to(None)
            capturing[0] = False
            assert cute.compile(_bump_on_stream, a, cutlass.runtime.make_fake_stream()) is not None

    def test_removal_restores_the_originals_and_nesting_is_allowed(self, registry):
        originals = (CompileCallable.__dict__["_compile"], JitCompiledFunction.__dict__["to"],
                     CudaDialectJitCompiledFunction.__dict__["to"])
        with registry.tripwires(capturing=lambda: False):
            assert CompileCallable.__dict__["_compile"] is not originals[0]
            with registry.tripwires(capturing=lambda: True):
                pass
            assert CompileCallable.__dict__["_compile"] is not originals[0]
        assert (CompileCallable.__dict__["_compile"], JitCompiledFunction.__dict__["to"],
                CudaDialectJitCompiledFunction.__dict__["to"]) == originals

    def test_a_launch_without_stream_is_found_at_compile_and_refused_inside_capture(self, registry):
        good = registry.register(Bump("test.bump", _bump_on_stream))
        bad = registry.register(Bump("test.bump_default", _bump_on_default_stream))
        x = torch.zeros(32)
        for kernel in (good, bad):
            kernel._ready(registry.spec(kernel, (x,)), (x,))
        assert good._problem(registry.spec(good, (x,))) is None
        problem = bad._problem(registry.spec(bad, (x,)))
        assert "launches _bump without stream=: on the default stream, outside the capture" in problem
        with registry.tripwires(capturing=lambda: True), pytest.raises(CaptureError) as info:
            bad(x)
        assert "without stream=" in str(info.value) and "pass the stream" in info.value.hint
