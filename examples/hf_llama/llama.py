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

