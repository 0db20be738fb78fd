"""The plan of a Hugging Face model's decode step, written from the model itself, and
greedy decoding on it."""

from __future__ import annotations

import torch

from graphflow.integrations.hf.cache import device_cache
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream

__all__ = ["decode_plan", "greedy"]


def decode_plan(model, max_cache_len: int, *, sizes, modes=("PIECEWISE", "FULL"), device: str = "cuda:0",
                name: str = "hf-decode", factory: str | None = None, cache: str = "cache",
                breaks=("model.layers.*.self_attn",), warmup_iters: int = 2) -> Plan:
    """The plan of one greedy decode step of ``model``: its own ``forward`` on ``tokens``
    (``[B, 1]``), writing ``logits`` (``[B, 1, vocab]``), with the ``static_cache`` at
    attribute ``cache`` adopted (``k{i}``, ``v{i}``: a row per batch row, kept when
    padded; ``len{i}``: the tokens it has seen), cut at ``breaks`` when PIECEWISE.

    For a causal LM whose ``StaticCache`` has full-attention and sliding-window layers
    (Llama, DeepSeek-V3, Mistral, Qwen2, Gemma-2 and -3 and their kin): a cache with
    layers of another kind (recurrent or indexer state) is refused here, naming them,
    since the plan would leave their state outside (``graphflow.integrations.hf.cache``
    says why sliding windows are safe, and at what cost).

    The cache's per-layer shapes and dtypes, and the logits' dtype, come from one eager
    step of the model on a throwaway cache at batch size 1. ``device`` is the plan's
    device name (``cuda:0``; the CPU backend maps it). ``factory`` is the
    ``module:function`` that rebuilds the model for ``graphflow run``.
    """
    probe = device_cache(model.config, max_cache_len)
    parameter = next(model.parameters())
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=parameter.device), past_key_values=probe,
                    use_cache=True)
    vocab = out.logits.shape[-1]

    def dtype(tensor) -> str:
        return str(tensor.dtype).removeprefix("torch.")

    buffers = [Buffer("tokens", ("B", 1), "int64", device, role=BufferRole.INPUT, values=(0, vocab)),
               Buffer("logits", ("B", 1, vocab), dtype(out.logits), device, role=BufferRole.OUTPUT)]
    for index, layer in enumerate(probe.layers):
        for prefix, tensor, attr in (("k", layer.keys, "keys"), ("v", layer.values, "values")):
            buffers.append(Buffer(f"{prefix}{index}", ("B", *tensor.shape[1:]), dtype(tensor), device,
                                  role=BufferRole.STATE, adopt=f"{cache}.layers.{index}.{attr}", pad="keep"))
        buffers.append(Buffer(f"len{index}", (), "int64", device, role=BufferRole.STATE,
                              adopt=f"{cache}.layers.{index}.cumulative_length"))
    state = [f"{prefix}{index}" for prefix in ("k", "v", "len") for index in range(len(probe.layers))]
    segment = Segment("decode", SegmentKind.GRAPH, "forward", reads=state, writes=state, stream="s0",
                      inputs={"input_ids": "tokens"}, objects={"past_key_values": cache},
                      constants={"use_cache": True}, returns=("logits",), breaks=tuple(breaks))
    return Plan(name, buffers=buffers, streams=[Stream("s0", device)], segments=[segment], model=factory,
                capture=CaptureSettings(modes=tuple(Mode(m) for m in modes), sizes=tuple(sizes),
                                        warmup_iters=warmup_iters))


def greedy(runner, prompt, steps: int):
    """Greedy decoding on a captured decode step (a plan's ``tokens`` in, ``logits`` out):
    from an empty cache, the prompt ``[B, P]`` one token a step, then ``steps`` new
    tokens, returned as ``[B, steps]``."""
    runner.clear_state()  # an empty cache: position 0
    for i in range(prompt.shape[1]):
        (logits,) = runner.run(tokens=prompt[:, i : i + 1])
    tokens = []
    for _ in range(steps):
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
        (logits,) = runner.run(tokens=tokens[-1])
    return torch.cat(tokens, dim=1)
