"""A small random DeepSeek-V3 (MLA attention, MoE; nothing downloaded) whose StaticCache the plan owns."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from graphflow.integrations.hf import static_cache

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
              first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
              topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
              qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
              initializer_range=0.3, experts_implementation="batched_mm")  # batched_mm: no data-dependent shapes
MAX_LEN = 64  # the cache holds 64 positions


def build(device="cpu", seed=0):
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**CONFIG)).to(device).eval()
    model.cache = static_cache(model, MAX_LEN)  # tensors: the plan's buffers
    return model

