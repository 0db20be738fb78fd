"""Hugging Face models captured from their plans alone (examples/hf_*), on the CPU backend.

Each example is a random-weight ``transformers`` model (nothing downloaded) with a
``StaticCache`` the plan owns, and a plan that captures the model's own ``forward``:
PIECEWISE with attention eager between graphs, or FULL. Greedy decoding through the
runner must give exactly the tokens of Hugging Face's own decode loop. The CPU backend
records no graph (its regions replay their calls); ``tests/cuda/test_cuda_hf.py`` runs
the same on a GPU with real graphs.
"""

from __future__ import annotations

import attrs
import pytest
import torch

transformers = pytest.importorskip("transformers")

from graphflow.engine import RunOptions  # noqa: E402
from graphflow.errors import CaptureError  # noqa: E402
from graphflow.session import Session  # noqa: E402
from graphflow.integrations.hf import greedy  # noqa: E402
from graphflow.plan.rules import validate  # noqa: E402
from tests.hf_examples import EXAMPLES, MODELS, example, hf_greedy  # noqa: E402

STEPS = 32


def prompt_of(batch: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_equal_hugging_faces_own_decode_loop(name, mode):
    module, plan = example(name)
    prompt = prompt_of(2)
    with Session(plan.with_modes([mode]), RunOptions(backend="cpu", sizes=(2,))) as session:
        session.capture()
        assert session.engine.report.verify[0].bit_exact
        got = greedy(session.runner, prompt, STEPS)
    want = hf_greedy(module, prompt, STEPS)
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) > 8  # a real sequence, not one token repeated


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_example_validates_clean_with_little_user_code(name):
    _, plan = example(name)
    assert validate(plan).diagnostics == ()
    code = (EXAMPLES / name / f"{MODELS[name]}.py").read_text().splitlines()
    assert len(code) < 40


@pytest.mark.parametrize("name", sorted(MODELS))
def test_decode_plan_writes_the_examples_yaml_from_the_model(name):
    from graphflow.plan.decorators import normalized
    from graphflow.integrations.hf import decode_plan

    module, plan = example(name)
    written = decode_plan(module.build(), module.MAX_LEN, sizes=(1, 2, 4), name=plan.name,
                          factory=f"{MODELS[name]}:build")
    assert normalized(written) == normalized(plan)


def test_a_padded_batch_leaves_the_cache_rows_it_does_not_use():
    module, plan = example("hf_llama")
    with Session(plan.with_modes(["FULL"]), RunOptions(backend="cpu", sizes=(2,))) as session:
        session.capture()
        runner = session.runner
        runner.clear_state()
        keys = session.engine.buffers.tensors["k0"]
        keys[1].fill_(7.0)
        assert runner.descriptor_for(1).size == 2
        runner.run(tokens=torch.tensor([[5]]))
        assert bool((keys[1] == 7.0).all()) and bool(keys[0].abs().sum() > 0)


def test_a_static_cache_outside_the_plan_is_named_not_blamed_on_the_tolerance():
    """The cache writes at its own counter and advances it on every call: replay decodes
    the next position. Verify must say so, and not suggest a looser tolerance."""
    module, plan = example("hf_llama")
    kept = [b.name for b in plan.buffers if b.adopt is None]
    segment = attrs.evolve(plan.segments[0], reads=(), writes=(), breaks=())
    plan = attrs.evolve(plan, buffers=[plan.buffer(n) for n in kept], segments=[segment])
    model = module.build()
    model.cache = transformers.StaticCache(config=model.config, max_cache_len=module.MAX_LEN)
    with pytest.raises(CaptureError) as info:
        Session(plan.with_modes(["FULL"]), RunOptions(backend="cpu", sizes=(2,), detectors=False)).capture(model)
    error = info.value
    assert error.phase == "verify"
    assert ("the step changed the model's tensors cache.layers.0.cumulative_length, cache.layers.0.keys, "
            "cache.layers.0.values, cache.layers.1.cumulative_length and 2 more, which no plan buffer holds") \
        in error.message
    assert error.hint.startswith("make that state the plan's: declare a buffer per tensor with adopt (adopt: "
                                 "'cache.layers.0.cumulative_length', role: state)")
    assert "atol" not in error.hint


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_replaying_only_what_was_recorded_and_the_eager_attentions_decodes_like_hf(name, mode):
    """A stand-in for CUDA capture (tests/tape_backend.py) replays the ops each piece
    recorded and none of their Python, with the attention eager between PIECEWISE's
    pieces: the split protocol and the adopted cache end to end, without a GPU."""
    from tests.tape_backend import TapeBackend

    module, plan = example(name)
    prompt = prompt_of(2)
    # The tape keeps every tensor it recorded alive (its stand-in for graph memory), which
    # the escape check would take for the segment's own leaks.
    with Session(plan.with_modes([mode]), RunOptions(sizes=(2,), disabled_checks=["escape"])) as session:
        session.capture(backend=TapeBackend())
        (program,) = session.engine.programs.values()
        pieces = program[0].__self__
        # PIECEWISE is cut at both layers' self_attn; FULL records the whole forward
        assert (len(pieces.tapes), len(pieces.between)) == ((3, 2) if mode == "PIECEWISE" else (1, 0))
        assert session.engine.report.verify[0].bit_exact
        got = greedy(session.runner, prompt, STEPS)
    assert torch.equal(got, hf_greedy(module, prompt, STEPS))
