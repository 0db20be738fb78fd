"""Hugging Face models with sliding-window layers captured as CUDA graphs with
``graphflow.integrations.hf``: Mistral at its default window (wider than the cache),
Mistral, Qwen2, Gemma-2 and Gemma-3 with a window of 16 that fills and slides within the
36 decoded positions, and Llama 4 with chunks of 16 (``tests/hf_sliding.py``).

transformers' own sliding-window layer picks each step's write and mask on the host;
graphflow's keeps its count on the device only, so the one graph of a step replays the
right position at every step. PIECEWISE cuts at every ``self_attn`` (three graphs, the
two attentions eager between them), FULL records one graph. For both, 32 greedy tokens
through graphflow's runner must equal those of Hugging Face's own decode loop with its
own ``StaticCache`` on the same GPU, a padded batch must leave the cache rows it does
not use, and closing the session must give the GPU memory back.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphflow.engine import RunOptions  # noqa: E402
from graphflow.integrations.hf import greedy  # noqa: E402
from graphflow.session import Session  # noqa: E402
from tests.cuda.memory import allocated  # noqa: E402
from tests.hf_sliding import MODELS, WINDOW, build, hf_greedy, plan  # noqa: E402

pytestmark = pytest.mark.cuda

STEPS = 32


@pytest.fixture(scope="module", params=[(n, m) for n in sorted(MODELS) for m in ("PIECEWISE", "FULL")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def captured(request):
    name, mode = request.param
    model = build(name, "cuda:0")
    session = Session(plan(model, mode), RunOptions(backend="cuda"))
    session.capture(model)
    yield name, session, mode
    session.close()


class TestCudaHuggingFaceSliding:
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
        name, session, _ = captured
        prompt = torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(batch)).cuda()
        got = greedy(session.runner, prompt, STEPS)
        assert torch.equal(got, hf_greedy(name, prompt, STEPS))

    def test_a_batch_of_3_on_the_b4_graph_leaves_cache_row_3(self, captured):
        _, session, _ = captured
        runner = session.runner
        runner.clear_state()
        keys = session.engine.buffers.tensors["k0"]
        keys[3].fill_(7.0)
        assert runner.descriptor_for(3).size == 4
        for token in range(WINDOW + 2):  # a window of 16 fills, then slides
            runner.run(tokens=torch.tensor([[token], [token + 1], [token + 2]], device="cuda:0"))
        torch.cuda.synchronize()
        assert bool((keys[3] == 7.0).all()) and bool(keys[:3].abs().sum() > 0)


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
def test_closing_gives_the_gpu_memory_back(mode):
    model = build("gemma2", "cuda:0")
    written = plan(model, mode)  # its probe step's tensors are gone when it returns
    before = allocated()
    with Session(written, RunOptions(backend="cuda")) as session:
        session.capture(model)
        greedy(session.runner, torch.zeros(2, 2, dtype=torch.long, device="cuda:0"), WINDOW + 2)
    assert allocated() - before < 1 << 20
