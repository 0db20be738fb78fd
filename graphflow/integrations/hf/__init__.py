"""Hugging Face ``transformers`` models under graphflow: a KV cache the plan owns.

A ``transformers`` ``StaticCache`` allocates its tensors lazily, at the first call's
batch size, and writes each step at its own device-side counter (``cumulative_length``),
which every call advances, whatever position the caller meant. Captured as is, the cache
is state outside the plan: its memory is counted nowhere, verify neither snapshots nor
restores it (each warmup and verify step moves the counter on), and a graph bakes in the
tensors of whichever batch size came first. Its sliding-window layers also count in a
Python int that picks each step's branch and position on the host, which a graph
replays frozen at capture (``graphflow.integrations.hf.cache``).

``static_cache(model, max_cache_len)`` returns a ``StaticCache`` whose sliding-window
layers keep that count on the device only, and whose layers hold no tensors yet, marked
initialized, so the plan's buffers become them: each layer's ``keys``, ``values`` and
``cumulative_length`` are buffers that adopt ``cache.layers.{layer}.keys`` (and so on),
which graphflow allocates at the largest batch size and points at the view of each
descriptor's size. The counters are then state too: verify restores them, and a replay
advances them exactly as the model's own decode loop does. Assign the cache to the model
(``model.cache = ...``) so the plan can name it (``objects: {past_key_values: cache}``,
``adopt: "cache.layers.0.keys"``).

``decode_plan(model, max_cache_len, sizes=...)`` writes the plan the examples spell in
YAML (``examples/hf_llama/decode.yaml``) for a causal LM with full-attention and
sliding-window layers (and refuses a cache with layers of another kind): the cache's
shapes are read off one eager step of the model itself, so nothing is computed by hand.
``greedy(runner, prompt, steps)`` decodes greedily on the captured step.
"""

from __future__ import annotations

from graphflow.exports import lazy_names

#: Each name and its module, imported on first use: a subpackage (``batching``, and the
#: server's entry point in it) is reached through this package, and must not wait for
#: transformers and torch to load before it can say anything.
_NAMES = {"decode_plan": "plan", "greedy": "plan", "static_cache": "cache"}

__all__ = sorted(_NAMES)
__getattr__ = lazy_names(__name__, _NAMES)
