"""The dsv4 model's Triton RMSNorm against PyTorch's, eagerly and inside a CUDA graph (and
the CuTe DSL one captured the same way; tests/cuda/test_cuda_jit.py checks its values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphflow.integrations.dsv4.kernels import MAX_ROW, cute_available, rms_norm, uses_triton

pytestmark = pytest.mark.cuda
pytest.importorskip("triton")

SHAPES = [(1, 8192), (32, 2048), (5, 3, 100), (2, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_triton_rms_norm_matches_pytorch(shape, dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=generator).to(dtype)
    weight = torch.randn(shape[-1], device="cuda", generator=generator).to(dtype)
    assert uses_triton(x)
    got = rms_norm(x, weight, 1e-6)
    want = F.rms_norm(x, (shape[-1],), weight, 1e-6)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, want)  # dtype-aware tolerances: one rounding either way


def test_rows_past_the_register_limit_and_strided_inputs_use_pytorch():
    assert not uses_triton(torch.zeros(1, MAX_ROW + 1, device="cuda"))
    strided = torch.zeros(8, 4, device="cuda").t()
    assert not uses_triton(strided)
    assert torch.equal(rms_norm(strided, torch.ones(8, device="cuda"), 1e-6),
                       F.rms_norm(strided, (8,), torch.ones(8, device="cuda"), 1e-6))


@pytest.mark.parametrize("backend", ["triton", "cute"])
def test_a_captured_rms_norm_replays_what_it_computes_eagerly(backend):
    if backend == "cute" and not cute_available():
        pytest.skip("nvidia-cutlass-dsl is not installed")
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out.copy_(rms_norm(x, weight, 1e-6, backend))  # compiles here, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out.copy_(rms_norm(x, weight, 1e-6, backend))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    x.add_(1.0)  # not a rescaling, which RMSNorm would undo
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(out, eager)
    assert torch.equal(out, rms_norm(x, weight, 1e-6, backend))
