"""A ``StaticCache`` whose every layer keeps its state on the device.

A graph replays device work only: whatever the step decides on the host is decided once,
at capture. transformers' ``StaticLayer`` (full attention) keeps its write position as a
device tensor (``cumulative_length``), so a replay writes where the model's own loop
would. ``StaticSlidingWindowLayer`` (Mistral's layers, Qwen2's with
``use_sliding_window``, every other layer of Gemma-2 and Gemma-3) counts the tokens it
has seen in a Python int as well, ``cumulative_length_int``, and that int decides the
step: whether the write is an ``index_copy`` at the counter (window not yet full) or a
roll left by one (full), the mask's ``kv_offset``, and, through ``get_seq_length``, the
model's position ids and the mask's query offset. Captured, the step replays the
position and the branch of whichever call was recorded, from the first token on.

``SlidingWindowLayer`` takes its place and derives all of that from the device counter,
with the same tensors, the same contents and the same mask. Two cases, fixed when the
cache is built (``W = min(sliding_window, max_cache_len)`` slots, as transformers
allocates):

- ``sliding_window >= max_cache_len``: within the cache's ``max_cache_len`` positions
  the window never fills, so transformers' layer only ever takes its ``index_copy``
  branch and reports the constant mask sizes ``(W, 0)``: exactly a ``StaticLayer``'s
  step, which this layer runs. Past ``max_cache_len`` positions the write is out of
  range, as a full layer's is (transformers' own layer would start rolling there, over
  a window of ``max_cache_len`` rather than the model's).
- ``sliding_window < max_cache_len``: the window fills and slides within the cache. One
  token a call, with ``p`` the tokens seen so far, after the step slot ``j`` holds what
  slot ``min(j + [p >= W], W - 1)`` held, and the new token is written to slot
  ``min(p, W - 1)``: before the window fills, the identity and transformers'
  ``index_copy`` at ``p``; after, its roll by one and write at the end. Pure copies, so
  the keys and values are bit-identical. The mask sizes are ``(W, max(p - W + 1, 0))``
  as transformers computes them, the offset a device tensor rather than an int, and the
  position ids and the mask's query offset are ``p``: the same integers, from which
  transformers' own mask code builds the same boolean mask, so attention runs on the
  same tensors of the same shapes. The price is a copy of the window every step, which
  transformers pays only once it is full.

A call of more than one token on a layer whose window is smaller than the cache is
refused: the keys transformers returns then, and their length, depend on ``p`` on the host.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer, get_layer_types_and_kwargs

__all__ = ["SlidingWindowLayer", "device_cache", "static_cache"]


class SlidingWindowLayer(StaticLayer):
    """transformers' ``StaticSlidingWindowLayer`` with no host-side count: the tokens seen
    (``cumulative_length``, never clamped to the window) are the only state it keeps."""

    is_sliding = True

    def __init__(self, max_cache_len: int, sliding_window: int):
        super().__init__(max_cache_len=min(sliding_window, max_cache_len))
        self.sliding_window = sliding_window
        #: the window fills within the cache: each step shifts it (a constant, not a count)
        self.slides = sliding_window < max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.slides:
            return super().update(key_states, value_states, *args, **kwargs)
        self._one_token(key_states.shape[-2])
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        window, seen = self.max_cache_len, self.cumulative_length
        source = (torch.arange(window, device=self.device) + (seen >= window).long()).clamp_(max=window - 1)
        slot = seen.clamp(max=window - 1).reshape(1)
        for cache, states in ((self.keys, key_states), (self.values, value_states)):
            cache.copy_(cache.index_select(2, source))
            cache.index_copy_(2, slot, states)
        seen.add_(1)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int | torch.Tensor]:
        if not self.slides:
            return super().get_mask_sizes(query_length)
        self._one_token(query_length)
        window = self.max_cache_len
        return window, (self.cumulative_length - (window - 1)).clamp(min=0)

    def _one_token(self, length: int) -> None:
        if length != 1:
            raise ValueError(f"a sliding-window layer (window {self.sliding_window}, smaller than the cache) takes one "
                             f"token a call under graphflow, not {length}: for more, transformers picks the keys it "
                             "returns, and their length, from a count it keeps on the host; run a prompt one token a "
                             "call, or build the cache with max_cache_len <= sliding_window")


def device_cache(config, max_cache_len: int) -> StaticCache:
    """transformers' own ``StaticCache`` for ``config``, its sliding-window layers replaced
    by ``SlidingWindowLayer``: the cache a graph can replay. Refused, naming them, when a
    layer is of a kind whose state would stay on the host or outside the plan."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    _, kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    others = [f"cache.layers.{index} is a {type(layer).__name__}" for index, layer in enumerate(cache.layers)
              if type(layer) not in (StaticLayer, StaticSlidingWindowLayer)]
    if others:
        raise ValueError(f"{'; '.join(others)}: graphflow's Hugging Face cache adopts the keys, values and device "
                         "counter of full-attention and sliding-window layers only, and a layer of another kind keeps "
                         "more (conv or recurrent states, an indexer cache) that the plan would leave outside, which "
                         "verify would not restore; write the plan yourself, adopting every tensor those layers keep")
    for index, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            cache.layers[index] = SlidingWindowLayer(max_cache_len, kwargs["sliding_window"])
    return cache


def static_cache(model, max_cache_len: int) -> StaticCache:
    """A ``StaticCache`` for ``model`` whose tensors a plan's buffers adopt.

    Each layer is marked initialized (dtype and device: the model's parameters') with no
    ``keys``, ``values`` or ``cumulative_length`` yet: graphflow fills those slots with
    the buffers that adopt them, before warmup. Use it only under graphflow; run the
    model's own forward with a fresh ``StaticCache`` instead.
    """
    cache = device_cache(model.config, max_cache_len)
    parameter = next(model.parameters())
    for layer in cache.layers:
        layer.keys = layer.values = layer.cumulative_length = None
        layer.dtype, layer.device = parameter.dtype, parameter.device
        layer.is_initialized = True
    return cache
