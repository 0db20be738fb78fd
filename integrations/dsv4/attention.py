"""Attention over a paged latent KV cache with a KV compressor, in two forms.

Every token's latent (key = value, ``kv_dim``) goes into a paged pool: pages of
``block_size`` tokens, reached through a block table. Every ``m`` tokens
(``compress_every``) the compressor folds the last ``m`` latents into one compressed
entry, appended to the sequence's compressed cache. A query at position ``p`` (length
``n = p + 1``) attends over the ``n // m`` compressed entries plus the raw tail of
the ``n % m`` tokens not yet compressed, so each past token is seen exactly once.

* ``eager_attention``: the counts are Python ints (read from the device). The
  compressor runs only when some sequence reaches a boundary, and the key set is cut to
  the batch's longest extent. Shapes depend on values, so it cannot be captured: it is
  the eager break of the PIECEWISE plan.
* ``static_attention``: lengths and compressed counts are computed on the device from
  the positions; the compressor runs every step and writes through a mask; keys are the
  whole compressed cache and a fixed ``m - 1`` tail window, masked. Every shape depends
  on the batch size only, so the FULL plan captures it.

Both write the same state, so either can continue the other's cache; on the same state
they agree to float tolerance (only the lengths of their reductions differ).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.weights import WeightSource

__all__ = ["Compressor", "PagedLayout", "eager_attention", "static_attention", "write_token"]


class PagedLayout(nn.Module):
    """Where token ``t`` of sequence ``b`` lives in a layer's pool [num_blocks, block_size, kv_dim].

    The block table [max_batch, blocks_per_seq] is a seeded permutation of the pool's
    pages, shared by every layer (like an engine's page allocator after some churn), so
    a sequence's pages are scattered and only the table finds them. It is a registered
    module buffer, so capture knows it as the model's own, fixed tensor.
    """

    def __init__(self, config: DSV4Config, device: torch.device):
        super().__init__()
        self.block_size = config.block_size
        self.max_len = config.max_len
        generator = torch.Generator().manual_seed(config.seed + 1)
        table = torch.randperm(config.num_blocks, generator=generator).view(config.max_batch, config.blocks_per_seq)
        self.register_buffer("block_table", table.to(device))  # [max_batch, blocks_per_seq] int64

    def slots(self, tokens: torch.Tensor) -> torch.Tensor:
        """Flat pool slots of tokens [B, T] (token index per sequence row) → [B, T]."""
        tokens = tokens.clamp(0, self.max_len - 1)
        table = self.block_table[: tokens.shape[0]]
        pages = torch.gather(table, 1, torch.div(tokens, self.block_size, rounding_mode="floor"))
        return pages * self.block_size + tokens.remainder(self.block_size)

    def read(self, pool: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Latents of tokens [B, T] → [B, T, kv_dim]."""
        slots = self.slots(tokens)
        return pool.view(-1, pool.shape[-1]).index_select(0, slots.flatten()).view(*slots.shape, pool.shape[-1])


class Compressor(nn.Module):
    """Folds ``m`` consecutive latents into one: a learned softmax over the window, then a projection."""

    def __init__(self, config: DSV4Config, source: WeightSource):
        super().__init__()
        self.every = config.compress_every
        self.gate = source.normal(config.compress_every, std=1.0)
        self.proj = source.normal(config.kv_dim, config.kv_dim)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """window [B, m, kv_dim] → [B, kv_dim]."""
        weights = torch.softmax(self.gate.float(), dim=0).to(window.dtype)
        return torch.matmul(torch.matmul(weights, window), self.proj)

    def window(self, layout: PagedLayout, pool: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """The last m latents of each sequence of lengths [B] → [B, m, kv_dim]."""
        offsets = torch.arange(-self.every, 0, device=lengths.device)
        return layout.read(pool, lengths.unsqueeze(-1) + offsets)


def write_token(layout: PagedLayout, pool: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> None:
    """Store each sequence's new latent kv [B, kv_dim] at its position's slot (slots are distinct)."""
    slots = layout.slots(positions.unsqueeze(-1)).squeeze(-1)
    pool.view(-1, pool.shape[-1]).index_copy_(0, slots, kv)


def _append_compressed(comp_cache: torch.Tensor, entry: torch.Tensor, lengths: torch.Tensor, every: int) -> None:
    """Write entry [B, kv] at index n//m - 1 of the sequences whose length n is a multiple of m."""
    due = (lengths.remainder(every) == 0).unsqueeze(-1)
    index = (torch.div(lengths, every, rounding_mode="floor") - 1).clamp(min=0)
    rows = torch.arange(comp_cache.shape[0], device=lengths.device)
    comp_cache[rows, index] = torch.where(due, entry, comp_cache[rows, index])


def _attend(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Softmax attention of q [B, H, D] over keys = values [B, S, D] where valid [B, S]."""
    scores = torch.bmm(q, keys.transpose(1, 2)).float() * (1.0 / math.sqrt(q.shape[-1]))  # [B, H, S]
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(keys.dtype)
    return torch.bmm(probs, keys)


def _keys(layout: PagedLayout, pool: torch.Tensor, comp_cache: torch.Tensor, lengths: torch.Tensor,
          every: int, n_comp: int, n_tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n_comp compressed entries and an n_tail raw window per sequence, with validity."""
    compressed = torch.div(lengths, every, rounding_mode="floor")  # [B] entries per sequence
    entry = torch.arange(n_comp, device=lengths.device)
    offset = torch.arange(n_tail, device=lengths.device)
    tail_tokens = (compressed * every).unsqueeze(-1) + offset  # [B, n_tail]
    keys = torch.cat((comp_cache[:, :n_comp], layout.read(pool, tail_tokens)), dim=1)
    valid = torch.cat((entry < compressed.unsqueeze(-1), tail_tokens < lengths.unsqueeze(-1)), dim=1)
    return keys, valid


def eager_attention(layout: PagedLayout, compressor: Compressor, q: torch.Tensor, kv: torch.Tensor,
                    positions: torch.Tensor, host_positions: list[int], pool: torch.Tensor,
                    comp_cache: torch.Tensor) -> torch.Tensor:
    """Attention with Python-int counts, ``host_positions`` (see the module docstring)."""
    every = compressor.every
    write_token(layout, pool, kv, positions)
    lengths = positions + 1
    host_lengths = [p + 1 for p in host_positions]
    if any(n % every == 0 for n in host_lengths):
        _append_compressed(comp_cache, compressor(compressor.window(layout, pool, lengths)), lengths, every)
    n_comp = max(host_lengths) // every
    n_tail = max(n % every for n in host_lengths)
    keys, valid = _keys(layout, pool, comp_cache, lengths, every, n_comp, n_tail)
    return _attend(q, keys, valid)


def static_attention(layout: PagedLayout, compressor: Compressor, q: torch.Tensor, kv: torch.Tensor,
                     positions: torch.Tensor, pool: torch.Tensor, comp_cache: torch.Tensor) -> torch.Tensor:
    """Attention with device-side counts and fixed shapes (see the module docstring)."""
    every = compressor.every
    write_token(layout, pool, kv, positions)
    lengths = positions + 1
    _append_compressed(comp_cache, compressor(compressor.window(layout, pool, lengths)), lengths, every)
    keys, valid = _keys(layout, pool, comp_cache, lengths, every, comp_cache.shape[1], every - 1)
    return _attend(q, keys, valid)
