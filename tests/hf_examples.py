"""The Hugging Face examples (examples/hf_*) for the CPU and CUDA tests: each one's model
module and plan, and Hugging Face's own greedy decode loop to compare with."""

from __future__ import annotations

import importlib
import pathlib
import sys

import torch

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
#: example folder -> its module (the plan's factory)
MODELS = {"hf_llama": "llama", "hf_deepseek_v3": "deepseek_v3"}


def example(name: str):
    """The example's module (importable by name, as the plan's factory imports it) and its plan."""
    from graphflow import load_plan

    folder = str(EXAMPLES / name)
    if folder not in sys.path:
        sys.path.append(folder)
    return importlib.import_module(MODELS[name]), load_plan(EXAMPLES / name / "decode.yaml")


def hf_greedy(module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Hugging Face's own decode loop on the same weights: a fresh StaticCache, one token a call."""
    import transformers

    model = module.build(device=prompt.device)
    return decode_loop(model, transformers.StaticCache(config=model.config, max_cache_len=module.MAX_LEN), prompt,
                       steps)


def decode_loop(model, cache, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding with the model's own forward on ``cache``: the prompt one token a
    call, then ``steps`` new tokens."""
    tokens = []
    with torch.no_grad():
        for i in range(prompt.shape[1]):
            out = model(input_ids=prompt[:, i : i + 1], past_key_values=cache, use_cache=True)
        for _ in range(steps):
            tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))
            out = model(input_ids=tokens[-1], past_key_values=cache, use_cache=True)
    return torch.cat(tokens, dim=1)
