"""The Triton tripwires on the CPU, through Triton's real hook objects.

A Triton launch needs a GPU driver, so Triton's runtime never calls the hooks here; the
tests call them as ``JITFunction._call_hook`` and ``CompiledKernel._init_handles`` do
(same keywords, same objects) and check what is installed and restored. Skipped where
Triton is not installed (CPU-only torch wheels do not bring it).
"""

from __future__ import annotations

import types

import pytest

triton = pytest.importorskip("triton")

from triton import knobs  # noqa: E402
from triton.compiler.compiler import CompiledKernel  # noqa: E402

from graphflow.errors import CaptureError  # noqa: E402
from graphflow.engine.jit import JitRegistry  # noqa: E402


def miss(hook, device=0):
    """Call a ``jit_cache_hook`` as Triton does on an in-memory cache miss."""
    fn = types.SimpleNamespace(module="m", name="_rms_norm_rows", jit_function=None)
    return hook(key="k", repr="_rms_norm_rows[num_warps=4](x_ptr: *bf16)", fn=fn,
                compile={"key": "k", "device": device}, is_manual_warmup=False, already_compiled=False)


@pytest.fixture
def registry():
    return JitRegistry()


def test_a_cache_miss_inside_capture_is_refused_naming_the_specialization(registry):
    with registry.tripwires(capturing=lambda: True):
        with pytest.raises(CaptureError) as info:
            miss(knobs.runtime.jit_cache_hook, device=1)
    assert str(info.value).startswith("[phase=capture] Triton compile of _rms_norm_rows[num_warps=4](x_ptr: *bf16) "
                                      "(an in-memory cache miss on device 1) inside the capture")


def test_outside_capture_the_hook_already_set_still_decides(registry):
    calls = []

    def previous(**kwargs):
        calls.append(kwargs["repr"])
        return True  # "skip the compile", Triton's meaning

    knobs.runtime.jit_cache_hook = previous
    try:
        with registry.tripwires(capturing=lambda: False):
            assert knobs.runtime.jit_cache_hook is not previous
            assert miss(knobs.runtime.jit_cache_hook) is True
        assert knobs.runtime.jit_cache_hook is previous
    finally:
        knobs.runtime.jit_cache_hook = None
    assert calls == ["_rms_norm_rows[num_warps=4](x_ptr: *bf16)"]


def test_a_module_load_inside_capture_is_refused_before_the_kernel_changes(registry):
    original = CompiledKernel.__dict__["_init_handles"]
    kernel = types.SimpleNamespace(module=None, name="_rms_norm_rows", _run=None)
    with registry.tripwires(capturing=lambda: True):
        with pytest.raises(CaptureError, match="Triton module load of _rms_norm_rows inside the capture"):
            CompiledKernel._init_handles(kernel)
        assert kernel._run is None  # still unloaded: the next launch loads it properly
        loaded = types.SimpleNamespace(module=object(), name="loaded")
        assert CompiledKernel._init_handles(loaded) is None  # already loaded: nothing to refuse
    assert CompiledKernel.__dict__["_init_handles"] is original
    assert knobs.runtime.jit_cache_hook is None
