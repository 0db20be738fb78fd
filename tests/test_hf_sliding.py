"""Hugging Face models with sliding-window (and chunked) attention layers, captured with
``graphflow.integrations.hf`` on the CPU backend: Mistral at its default window (wider
than the cache: it never slides), Mistral, Qwen2, Gemma-2 and Gemma-3 with a window of
16 that fills and slides within the 36 decoded positions (all layers sliding, or hybrid:
some full, some sliding), and Llama 4's chunked layers. 32 greedy tokens through the
runner must be exactly those of Hugging Face's own loop with its own ``StaticCache``.

The CPU backend records no graph (a region replays its calls), so these prove the plan
and the caches right and that nothing the step needs is a count kept on the host: the
tape backend (``tests/tape_backend.py``) replays only the ops it recorded, as a graph
would, and a step must leave every Python value on the model and its cache as it was.
They prove nothing about CUDA itself: ``tests/cuda/test_cuda_hf_sliding.py`` does.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer  # noqa: E402

from graphflow.engine import RunOptions  # noqa: E402
from graphflow.integrations.hf import decode_plan, greedy, static_cache  # noqa: E402
from graphflow.integrations.hf.cache import SlidingWindowLayer  # noqa: E402
from graphflow.session import Session  # noqa: E402
from tests.hf_sliding import MAX_LEN, MODELS, WINDOW, build, hf_greedy, plan  # noqa: E402

STEPS = 32
ALL = sorted(MODELS)


def prompt_of(batch: int) -> torch.Tensor:
    return torch.randint(0, 128, (batch, 4), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
@pytest.mark.parametrize("name", ALL)
def test_greedy_tokens_equal_hugging_faces_own_decode_loop(name, mode):
    model = build(name)
    prompt = prompt_of(2)
    with Session(plan(model, mode), RunOptions(backend="cpu", sizes=(2,))) as session:
        session.capture(model)
        assert session.engine.report.verify[0].bit_exact
        got = greedy(session.runner, prompt, STEPS)
    want = hf_greedy(name, prompt, STEPS)
    assert torch.equal(got, want)
    assert len(set(want.flatten().tolist())) > 8  # a real sequence, not one token repeated


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL"])
@pytest.mark.parametrize("name", ALL)
def test_replaying_only_the_recorded_ops_decodes_like_hf(name, mode):
    """On the tape every op a piece recorded is replayed without its Python (FULL: the
    cache's too; PIECEWISE: the positions and masks, the attention eager between), so a
    position or a branch read on the host would be frozen at capture."""
    from tests.tape_backend import TapeBackend

    model = build(name)
    prompt = prompt_of(2)
    # the tape keeps every tensor it recorded alive, which the escape check would take for leaks
    with Session(plan(model, mode), RunOptions(sizes=(2,), disabled_checks=["escape"])) as session:
        session.capture(model, backend=TapeBackend())
        (program,) = session.engine.programs.values()
        pieces = program[0].__self__
        assert (len(pieces.tapes), len(pieces.between)) == ((3, 2) if mode == "PIECEWISE" else (1, 0))
        assert session.engine.report.verify[0].bit_exact
        got = greedy(session.runner, prompt, STEPS)
    assert torch.equal(got, hf_greedy(name, prompt, STEPS))


def _host_values(model) -> dict:
    """Every Python number, bool, string or tuple on the model's modules and its cache."""
    plain = (bool, int, float, str, tuple, type(None))
    owners = {f"model.{path}" if path else "model": module for path, module in model.named_modules()}
    owners["cache"] = model.cache
    owners.update({f"cache.layers.{index}": layer for index, layer in enumerate(model.cache.layers)})
    return {f"{path}.{key}": value for path, owner in owners.items() for key, value in vars(owner).items()
            if isinstance(value, plain)}


@pytest.mark.parametrize("name", ALL)
def test_a_step_changes_no_python_value_on_the_model_or_its_cache(name):
    model = build(name)
    with Session(plan(model, "FULL"), RunOptions(backend="cpu", sizes=(2,))) as session:
        session.capture(model)
        session.runner.clear_state()
        before = _host_values(model)
        for token in range(WINDOW + 2):  # past the window's filling
            session.runner.run(tokens=torch.full((2, 1), token))
        assert _host_values(model) == before


def test_a_padded_batch_leaves_the_window_rows_it_does_not_use():
    """A row of the largest batch is saved and put back around a smaller batch's step,
    the window's shift included."""
    model = build("mistral-window")
    with Session(plan(model, "FULL"), RunOptions(backend="cpu", sizes=(2,))) as session:
        session.capture(model)
        runner = session.runner
        runner.clear_state()
        keys = session.engine.buffers.tensors["k0"]
        keys[1].fill_(7.0)
        assert runner.descriptor_for(1).size == 2
        for token in range(WINDOW + 2):  # the window fills, then slides
            runner.run(tokens=torch.tensor([[token]]))
        assert bool((keys[1] == 7.0).all()) and bool((keys[0] != 0).all())


@pytest.mark.parametrize("window", [WINDOW, 4096])
def test_the_layer_holds_and_masks_as_transformers_own_at_every_position(window):
    ours, theirs = SlidingWindowLayer(MAX_LEN, window), StaticSlidingWindowLayer(MAX_LEN, window)
    states = torch.randn(2 * MAX_LEN if window < MAX_LEN else MAX_LEN, 2, 1, 2, 1, 8,
                         generator=torch.Generator().manual_seed(window))
    for position, (keys, values) in enumerate(states):
        assert int(ours.get_seq_length()) == theirs.get_seq_length() == position
        assert [int(size) for size in ours.get_mask_sizes(1)] == list(theirs.get_mask_sizes(1))
        got, want = ours.update(keys, values), theirs.update(keys, values)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), position
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_more_than_one_token_a_call_on_a_sliding_window_is_refused():
    """transformers picks the keys it returns, and their length, from a count on the host."""
    layer = SlidingWindowLayer(MAX_LEN, WINDOW)
    pair = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"a sliding-window layer \(window 16, smaller than the cache\) takes one "
                                         r"token a call under graphflow, not 3: .* or build the cache with "
                                         r"max_cache_len <= sliding_window"):
        layer.update(pair, pair)
    with pytest.raises(ValueError, match="not 3"):
        layer.get_mask_sizes(3)
    wide = SlidingWindowLayer(MAX_LEN, 4096)  # never slides in the cache: a static layer's prefill
    keys, _ = wide.update(pair, pair)
    assert keys.shape[-2] == MAX_LEN and int(wide.get_seq_length()) == 3


def test_the_plan_and_the_cache_hold_each_layer_at_its_own_length():
    model = build("gemma2")
    assert [type(layer) for layer in model.cache.layers] == [SlidingWindowLayer, StaticLayer]
    assert model.cache.layers[0].slides and not SlidingWindowLayer(MAX_LEN, 4096).slides
    written = plan(model, "FULL")
    assert [written.buffer(f"k{index}").shape for index in range(2)] == [("B", 2, WINDOW, 16), ("B", 2, MAX_LEN, 16)]


def test_a_layer_kind_it_cannot_adopt_is_refused_when_the_plan_is_built():
    config = transformers.Lfm2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     layer_types=["conv", "full_attention"])  # layer 0: a conv state
    model = transformers.Lfm2ForCausalLM(config)
    message = (r"cache.layers.0 is a LinearAttentionLayer: graphflow's Hugging Face cache adopts the keys, values "
               r"and device counter of full-attention and sliding-window layers only")
    with pytest.raises(ValueError, match=message):
        static_cache(model, MAX_LEN)
    with pytest.raises(ValueError, match=message):
        decode_plan(model, MAX_LEN, sizes=(1,))
