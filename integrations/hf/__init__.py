"""Hugging Face ``transformers`` models under graphflow: a KV cache the plan owns.

A ``transformers`` ``StaticCache`` allocates its tensors lazily, at the first call's
batch size, and writes each step at its own device-side counter (``cumulative_length``),
which every call advances, whatever position the caller meant. Captured as is, the cache
is state outside the plan: its memory is counted nowhere, verify neither snapshots nor
restores it (each warmup and verify step moves the counter on), and a graph bakes in the
tensors of whichever batch size came first.

``static_cache(model, max_cache_len)`` returns a ``StaticCache`` whose layers hold no
tensors yet, marked initialized, so the plan's buffers become them: each layer's
``keys``, ``values`` and ``cumulative_length`` are buffers that adopt
``cache.layers.{layer}.keys`` (and so on), which graphflow allocates at the largest
batch size and points at the view of each descriptor's size. The counters are then
state too: verify restores them, and a replay advances them exactly as the model's own
decode loop does. Assign the cache to the model (``model.cache = ...``) so the plan can
name it (``objects: {past_key_values: cache}``, ``adopt: "cache.layers.0.keys"``).

``decode_plan(model, max_cache_len, sizes=...)`` writes the plan the examples spell in
YAML (``examples/hf_llama/decode.yaml``) for any causal LM with a static cache: the
cache's shapes are read off one eager step of the model itself, so nothing is computed
by hand. ``greedy(runner, prompt, steps)`` decodes greedily on the captured step.
"""

from __future__ import annotations

__all__ = ["decode_plan", "greedy", "static_cache"]


def static_cache(model, max_cache_len: int):
    """A ``transformers.StaticCache`` for ``model`` whose tensors a plan's buffers adopt.

    Each layer is marked initialized (dtype and device: the model's parameters') with no
    ``keys``, ``values`` or ``cumulative_length`` yet: graphflow fills those slots with
    the buffers that adopt them, before warmup. Use it only under graphflow; run the
    model's own forward with a fresh ``StaticCache`` instead.
    """
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    parameter = next(model.parameters())
    for layer in cache.layers:
        layer.keys = layer.values = layer.cumulative_length = None
        layer.dtype, layer.device = parameter.dtype, parameter.device
        layer.is_initialized = True
    return cache


def decode_plan(model, max_cache_len: int, *, sizes, modes=("PIECEWISE", "FULL"), device: str = "cuda:0",
                name: str = "hf-decode", factory: str | None = None, cache: str = "cache",
                breaks=("model.layers.*.self_attn",), warmup_iters: int = 2):
    """The plan of one greedy decode step of ``model``: its own ``forward`` on ``tokens``
    (``[B, 1]``), writing ``logits`` (``[B, 1, vocab]``), with the ``StaticCache`` at
    attribute ``cache`` adopted (``k{i}``, ``v{i}``: a row per batch row, kept when
    padded; ``len{i}``: its write position), cut at ``breaks`` when PIECEWISE.

    The cache's per-layer shapes and dtypes, and the logits' dtype, come from one eager
    step of the model on a throwaway cache at batch size 1. ``device`` is the plan's
    device name (``cuda:0``; the CPU backend maps it). ``factory`` is the
    ``module:function`` that rebuilds the model for ``graphflow run``.
    """
    import torch
    from transformers import StaticCache

    from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream

    probe = StaticCache(config=model.config, max_cache_len=max_cache_len)
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
    import torch

    runner.clear_state()  # an empty cache: position 0
    for i in range(prompt.shape[1]):
        (logits,) = runner.run(tokens=prompt[:, i : i + 1])
    tokens = []
    for _ in range(steps):
        tokens.append(logits[:, -1].argmax(-1, keepdim=True))
        (logits,) = runner.run(tokens=tokens[-1])
    return torch.cat(tokens, dim=1)
