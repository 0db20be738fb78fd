"""Tiny random Hugging Face models (nothing downloaded) and a driver for transformers'
continuous-batching engine, with and without graphflow's ``serve``, for
tests/test_hf_serving.py.

``run`` drives one whole session the way a server does (init_continuous_batching, serve,
start, add_requests, get_result, stop, close) and counts the engine's steps by wrapping the
batch processor's ``_generation_step``. ``hf_generate`` is the independent reference:
Hugging Face's own ``generate``, greedy, one prompt at a time, on a copy of the model that
keeps its default attention.
"""

from __future__ import annotations

import copy
import functools
import gc
import time

import attrs
import pytest
import torch

#: The sliding window of the sliding and hybrid models: shorter than most prompts below.
WINDOW = 8
_COMMON = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=512, initializer_range=0.3)


#: A foreground capture of every key before serving, each verified then (``serve``'s
#: default leaves the FULL keys to the capture thread and verifies a sample).
EVERY_KEY_VERIFIED = {"full_in_background": False, "verify": "all"}


@pytest.fixture(scope="module", autouse=True)
def quick_gc():
    """The engine's batch processor runs ``gc.collect()`` when it is freed: a quarter of a
    second each with torch and transformers loaded, unless what is loaded is frozen.
    Autouse in every module that imports it."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def _llama(layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**_COMMON, "num_hidden_layers": layers}))


def _mistral():  # every layer slides
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=WINDOW))


def _qwen2():  # layer 0 full, layer 1 sliding
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW,
                                        max_window_layers=1))


def _gemma2():  # sliding and full layers alternate (untied: a tied random Gemma repeats its input)
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**_COMMON, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
                                              layer_types=["sliding_attention", "full_attention"]))


MODELS = {"llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "gemma2": _gemma2, "gemma3": _gemma3}


def build(name: str, attention: str = "paged|sdpa", **kw):
    """A fresh model (seeded, so every build of a name has the same weights) in eval mode,
    set to ``attention``, and a copy of it with the default attention for ``generate``."""
    torch.manual_seed(0)
    model = MODELS[name](**kw).eval()
    reference = copy.deepcopy(model)
    model.set_attn_implementation(attention)
    return model, reference


@functools.cache
def shared(name: str):
    """``build(name)``, once per session: for tests that neither wrap nor patch the model."""
    return build(name)


def prompts(lengths=(5, 11, 19, 3, 14), seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [[int(x) for x in torch.randint(3, _COMMON["vocab_size"] - 3, (n,), generator=generator)] for n in lengths]


def hf_generate(reference, prompt_list, new_tokens: int) -> list[list[int]]:
    """Hugging Face's own greedy ``generate``, each prompt alone (no batching, no padding)."""
    out = []
    for prompt in prompt_list:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                           min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                           eos_token_id=None)
        out.append(generated[0, len(prompt):].tolist())
    return out


def cb_config(**settings):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    values = dict(block_size=8, num_blocks=16, max_batch_tokens=32, max_requests_per_batch=4,
                  q_padding_interval_size=8, kv_padding_interval_size=32)
    values.update(settings)
    return ContinuousBatchingConfig(**values)


def manager(model, new_tokens: int, **settings):
    from transformers import GenerationConfig

    generation = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config(**settings))


@attrs.define
class Run:
    tokens: list[list[int]]
    steps: int  # the engine's generation steps
    serving: object  # graphflow's Serving (closed), or None
    keys: list  # the keys of each step, in order (graphflow's batch_keys: its FULL key if any, its covering key)
    reads: list  # the KV tokens each step's batch read, padded (its ``max_kv_read``)
    processor: object
    manager: object


def run(model, prompt_list, new_tokens: int = 6, mode: str | None = None, *, queue_first: bool = False,
        settle: bool = False, ahead: bool = False, serve_kwargs=None, before_serve=None, after_stop=None,
        **settings) -> Run:
    """One session of the engine over ``prompt_list``, greedy, ``new_tokens`` each.

    ``mode``: None (the engine alone), "fg" (``serve(manager)``) or "lazy"
    (``serve(manager, lazy=True)``). ``queue_first`` adds the requests before ``start()``
    (the first batch then holds them all, so the batches, and their keys, are the same
    every run); otherwise they are added after, as a server does. ``settle`` (keys
    captured beside serving: lazy, or a foreground capture's FULL keys in the background):
    each step waits until the capture thread has dealt with its keys (the thread begins
    only once a step has asked for one, and records only between steps), so the first
    step of each key is eager ("no graph yet") and later ones are not left to timing. ``ahead`` (lazy): after the
    engine's first step, the next waits until every key of the plan is captured but the
    FULL keys no step asked for yet, so each later PIECEWISE key's first step is its
    graph's check. ``before_serve(processor)``
    runs on the engine's batch processor before ``serve``; ``after_stop(serving)`` after
    ``stop()`` and before ``close()``.
    """
    from graphflow.engine.lazy import KeyState
    from graphflow.integrations.hf.batching import serve
    from graphflow.integrations.hf.batching.keys import batch_keys

    mgr = manager(model, new_tokens, **settings)
    serving = None
    mgr.batch_processor = mgr._create_batch_processor()
    if before_serve is not None:
        before_serve(mgr.batch_processor)
    if mode is not None:
        serving = serve(mgr, lazy=mode == "lazy", **(serve_kwargs or {}))
    processor = mgr.batch_processor
    engine_step = processor._generation_step
    keys, reads = [], []

    def counted(model_):
        engine_step(model_)
        io = processor.inputs_and_outputs
        keys.append(batch_keys(io))
        reads.append(io.max_kv_read)
        waiting_for = ()
        if serving is not None and serving.core is not None:
            if ahead and len(keys) == 1:
                assert serving.wait_captured(30), "the capture thread did not catch up in 30 s"
            elif settle:
                waiting_for = tuple(k for k in keys[-1] if k in serving.plan.keys)
        deadline = time.monotonic() + 30
        while any(serving.coverage.state(k) is KeyState.PLANNED for k in waiting_for) \
                and time.monotonic() < deadline:
            time.sleep(0.002)

    processor._generation_step = counted
    try:
        if queue_first:
            mgr.add_requests(prompt_list, max_new_tokens=new_tokens)
        mgr.start()
        if not queue_first:
            mgr.add_requests(prompt_list, max_new_tokens=new_tokens)
        results = {}
        for _ in prompt_list:
            result = mgr.get_result(timeout=60)
            assert result is not None, "the engine returned no result within 60 s"
            results[result.request_id] = result
    finally:
        mgr.stop(block=True, timeout=60)
        del processor._generation_step
        if serving is not None:
            if after_stop is not None:
                after_stop(serving)
            serving.close()
    for result in results.values():
        assert result.error is None, result.error
    tokens = [results[f"req_{i}"].generated_tokens for i in range(len(prompt_list))]
    return Run(tokens, len(keys), serving, keys, reads, processor, mgr)


def fill_cache(value: float):
    """A ``before_serve``: every slot of the paged KV cache set to ``value`` (the cache is
    ``torch.empty``: until a request writes a slot it holds whatever the memory held),
    but the read-trash block, which the engine zeroes and padding reads."""
    def fill(processor):
        cache = processor.cache
        for tensor in (*cache.key_cache, *cache.value_cache):
            tensor[: cache.num_pages].fill_(value)

    return fill
