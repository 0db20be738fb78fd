"""A small random Llama (nothing downloaded) whose StaticCache the plan owns."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from graphflow.integrations.hf import static_cache

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3)
MAX_LEN = 64  # the cache holds 64 positions


def build(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(device).eval()
    model.cache = static_cache(model, MAX_LEN)  # tensors: the plan's buffers
    return model


def generate(runner, prompt, steps):
    """Greedy decoding on the captured step: the prompt one token a step, then ``steps`` new tokens."""
    runner.clear_state()  # an empty cache: position 0
    for i in range(prompt.shape[1]):
        (logits,) = runner.run(tokens=prompt[:, i : i + 1])
    tokens = []
    for _ in range(steps):
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
        (logits,) = runner.run(tokens=tokens[-1])
    return torch.cat(tokens, dim=1)
