"""Hugging Face Llama and DeepSeek-V3 captured as CUDA graphs from their plans alone.

The examples (examples/hf_*) capture the model's own ``forward`` with a ``StaticCache``
the plan owns. PIECEWISE cuts it at every ``self_attn`` (one graph between each pair of
attention calls, the attention run eagerly between them), FULL records one graph. For
both, 32 greedy tokens through graphflow's runner must equal those of Hugging Face's
own decode loop on the same GPU, a padded batch must leave the cache rows it does not
use, and closing the session must give the GPU memory back.
"""

from __future__ import annotations


import pytest
import torch

from graphflow.engine import RunOptions
from graphflow.integrations.hf import greedy
from graphflow.session import Session
from tests.cuda.memory import allocated
from tests.hf_examples import MODELS, example, hf_greedy

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.cuda

STEPS = 32


@pytest.fixture(scope="module", params=[(n, m) for n in sorted(MODELS) for m in ("PIECEWISE", "FULL")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def captured(request):
    name, mode = request.param
    module, plan = example(name)
    session = Session(plan.with_modes([mode]), RunOptions(backend="cuda"))
    session.capture()
    yield module, session, mode
    session.close()


class TestCudaHuggingFace:
    def test_real_graphs_verified_bit_exact(self, captured):
        _, session, mode = captured
        report = session.engine.report
        assert report.captures_graphs and [v.bit_exact for v in report.verify] == [True] * 3
        program = session.engine.programs[report.descriptors[0]]
        assert len(program) == 1  # one region: the model's forward
        if mode == "PIECEWISE":  # cut at both layers' self_attn: three graphs, two eager attentions
            pieces = program[0].__self__
            assert len(pieces.graphs) == 3 and len(pieces.between) == 2

    @pytest.mark.parametrize("batch", [1, 2, 4])
    def test_32_greedy_tokens_equal_hugging_faces_own_decode_loop(self, captured, batch):
        module, session, _ = captured
        prompt = torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(batch)).cuda()
        got = greedy(session.runner, prompt, STEPS)
        assert torch.equal(got, hf_greedy(module, prompt, STEPS))

    def test_a_batch_of_3_on_the_b4_graph_leaves_cache_row_3(self, captured):
        _, session, _ = captured
        runner = session.runner
        runner.clear_state()
        keys = session.engine.buffers.tensors["k0"]
        keys[3].fill_(7.0)
        assert runner.descriptor_for(3).size == 4
        runner.run(tokens=torch.tensor([[5], [6], [7]], device="cuda:0"))
        torch.cuda.synchronize()
        assert bool((keys[3] == 7.0).all()) and bool(keys[:3].abs().sum() > 0)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_closing_gives_the_gpu_memory_back(mode):
    """Capture, decode and close, four times in one process: from the second cycle on,
    each gives back every byte it took.

    The first cycle is counted apart: it may run the first matmul on one of the streams
    it takes, and cuBLAS keeps that stream's workspace for the stream's life (in the full
    CUDA suite on the H200 one cycle left exactly 32.0 MiB more, a workspace's size, where
    the file alone left nothing; ``tests/cuda/memory.py`` says why that is held once and
    ``test_cuda_cycles.py`` that it does not grow)."""
    module, plan = example("hf_llama")

    def cycle() -> None:
        with Session(plan.with_modes([mode]), RunOptions(backend="cuda")) as session:
            session.capture()
            greedy(session.runner, torch.zeros(2, 2, dtype=torch.long, device="cuda:0"), 4)

    start = allocated()
    cycle()
    before = allocated()
    assert before - start <= 32 << 20, f"{(before - start) / 2**20:.1f} MiB left by the first cycle"
    for _ in range(3):
        cycle()
        assert allocated() == before

