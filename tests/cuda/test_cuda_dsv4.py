"""The dsv4 mini model captured as CUDA graphs, PIECEWISE and FULL, on a GPU.

For every descriptor of both bundled plans: a 64-step greedy decode replayed through
graphflow's runtime gives the same tokens and bit-identical logits at every step as the
same decode run eagerly from the same state. The PIECEWISE plan's eager attentions read
their counts from ``positions_host``, a buffer the CUDA backend keeps on the host: it
captures, verifies bit-exact and decodes like any other, and its step never waits for
the GPU.
"""

import pathlib

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.integrations.dsv4.decode import decode_both
from graphflow.plan.loader import load_plan
from graphflow.runtime import Runner

PLANS = pathlib.Path(__file__).resolve().parents[2] / "plans"
STEPS = 64

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=["dsv4_mini_piecewise.yaml", "dsv4_mini_full.yaml"])
def engine(request):
    engine = run_pipeline(load_plan(PLANS / request.param), RunOptions(backend="cuda", verify="all"))
    yield engine
    engine.close()


class TestCudaDecodeReplay:
    def test_the_pipeline_captured_real_graphs_that_verified_bit_exact(self, engine):
        assert engine.report.captures_graphs
        assert [v.bit_exact for v in engine.report.verify] == [True] * len(engine.plan.capture.sizes)

    @pytest.mark.parametrize("size", [1, 2, 4, 8, 16, 32])
    def test_64_step_greedy_decode_replays_bit_for_bit(self, engine, size):
        replayed, eager = decode_both(engine, size, STEPS)
        assert torch.equal(replayed.tokens, eager.tokens)
        for step in range(STEPS):
            assert torch.equal(replayed.logits[step], eager.logits[step]), f"logits differ at step {step}"


@pytest.fixture(scope="module")
def piecewise():
    engine = run_pipeline(load_plan(PLANS / "dsv4_mini_piecewise.yaml"), RunOptions(backend="cuda"))
    yield engine
    engine.close()


class TestCudaHostPositions:
    def test_the_host_positions_live_in_host_memory_and_the_rest_on_the_gpu(self, piecewise):
        devices = {name: tensor.device.type for name, tensor in piecewise.buffers.tensors.items()}
        assert devices.pop("positions_host") == "cpu"
        assert set(devices.values()) == {"cuda"}
        # One graph per region between attention breaks, whatever streams (s0, s1, s2) its segments use.
        assert piecewise.report.graphs == 5 * len(piecewise.plan.capture.sizes)

    @pytest.mark.parametrize("size", [1, 3, 8])
    def test_a_piecewise_step_never_waits_for_the_gpu(self, piecewise, size):
        # Positions 0..7 cover steps with and without a compressed entry due.
        runner = Runner(piecewise)
        tokens = torch.randint(0, 512, (size,), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        steps = [(torch.full((size,), p, dtype=torch.int64, device="cuda"), torch.full((size,), p, dtype=torch.int64))
                 for p in range(8)]
        runner.run(tokens, *steps[0])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for positions, host in steps:
                runner.run(tokens, positions, host)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
