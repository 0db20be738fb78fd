"""The dsv4 mini model captured as CUDA graphs, PIECEWISE and FULL, on a GPU.

For every descriptor of both bundled plans: a 64-step greedy decode replayed through
graphflow's runtime gives the same tokens and bit-identical logits at every step as the
same decode run eagerly from the same state.
"""

import pathlib

import pytest
import torch

from graphflow.engine import run_pipeline
from graphflow.integrations.dsv4.decode import decode_both
from graphflow.loader import load_plan

PLANS = pathlib.Path(__file__).resolve().parents[2] / "plans"
STEPS = 64

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module", params=["dsv4_mini_piecewise.yaml", "dsv4_mini_full.yaml"])
def engine(request):
    engine = run_pipeline(load_plan(PLANS / request.param), backend="cuda")
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
