"""Small random Hugging Face models with sliding-window or chunked layers (nothing
downloaded), for the CPU and CUDA tests of ``graphflow.integrations.hf``: each one's
model, decode plan, and Hugging Face's own greedy decode loop to compare with.

36 positions are decoded (a 4-token prompt, 32 new tokens), so a window (or chunk) of 16
fills at position 16 and slides for the remaining 20. With it set to 4096 instead, a
third or more of each model's tokens (two rows of 32) differ: the window matters.
"""

from __future__ import annotations

import torch

from tests.hf_examples import decode_loop

#: positions the cache holds: more than the 36 decoded, and more than the small windows
MAX_LEN = 64
WINDOW = 16
_COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)


def _mistral():  # its default window, 4096: wider than the cache, so it never slides
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_COMMON))


def _mistral_window():  # every layer slides
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=WINDOW))


def _qwen2():  # layer 0 full, layer 1 sliding
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_COMMON, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))


def _gemma2():  # layer 0 sliding (so the position ids come from a sliding layer), layer 1 full
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # untied: tied, a random Gemma repeats its input token
    return Gemma2ForCausalLM(Gemma2Config(**_COMMON, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return Gemma3ForCausalLM(Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=WINDOW, tie_word_embeddings=False,
                                              layer_types=["sliding_attention", "full_attention"]))


def _llama4():  # layer 0 chunked (transformers keeps it in the sliding-window layer), layer 1 full; no MoE
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(**_COMMON, intermediate_size_mlp=128, head_dim=16,
                                              attention_chunk_size=WINDOW, interleave_moe_layer_step=3,
                                              no_rope_layers=[1, 0], tie_word_embeddings=False))


MODELS = {"mistral": _mistral, "mistral-window": _mistral_window, "qwen2": _qwen2, "gemma2": _gemma2,
          "gemma3": _gemma3, "llama4-chunked": _llama4}


def build(name: str, device="cpu", cache: bool = True):
    """The model, with graphflow's ``static_cache`` at ``model.cache`` unless ``cache`` is false."""
    from graphflow.integrations.hf import static_cache

    torch.manual_seed(0)
    model = MODELS[name]().to(device).eval()
    if cache:
        model.cache = static_cache(model, MAX_LEN)
    return model


def plan(model, mode: str, sizes=(1, 2, 4)):
    from graphflow.integrations.hf import decode_plan

    return decode_plan(model, MAX_LEN, sizes=sizes, modes=(mode,), name="hf-sliding-decode")


def hf_greedy(name: str, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Hugging Face's own decode loop on the same weights: a fresh StaticCache (its own
    sliding-window layers), one token a call."""
    import transformers

    model = build(name, prompt.device, cache=False)
    return decode_loop(model, transformers.StaticCache(config=model.config, max_cache_len=MAX_LEN), prompt, steps)
