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
"""

from __future__ import annotations

__all__ = ["static_cache"]


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
