"""Attention over a paged latent KV cache with a KV compressor, in two forms.

Every token's latent (key = value, ``kv_dim``) goes into a paged pool: pages of
``block_size`` tokens, reached through a block table. Every ``m`` tokens
(``compress_every``) the compressor folds the last ``m`` latents into one compressed
entry, appended to the sequence's compressed cache. A query at position ``p`` (length
``n = p + 1``) attends over the ``n // m`` compressed entries plus the raw tail of
the ``n % m`` tokens not yet compressed, so each past token is seen exactly once.

* ``eager_attention``: the counts are Python ints, from positions the engine keeps on
  the host (a ``cpu`` plan buffer, as serving engines keep sequence lengths with their
  attention metadata), so reading them costs no device sync. The compressor runs only
  when some sequence reaches a boundary, and the compressed keys are cut to the batch's
  longest extent. Shapes depend on values, so it cannot be captured: it is the eager
  break of the PIECEWISE plan.
* ``static_attention``: the compressor runs every step and writes through a mask; keys
  are the whole compressed cache, masked. Every shape depends on the batch size only, so
  the FULL plan captures it.

Both attend over the raw tail as a fixed ``m - 1`` window, masked past the length. Both
write the same state, so either can continue the other's cache; on the same state they
agree to float tolerance (only the lengths of their reductions differ).

The eager form runs between graphs, where every torch call costs host time the GPU may
wait for. So everything that depends only on a position is precomputed once, per
(sequence, position), in ``PagedLayout`` tables: the pool slot of the new token, of the
compressor's window and of the tail window, and the additive mask (0 or -inf) of every
key. A step looks its rows up with the device positions: about ten kernels a layer
when nothing is due, where computing the indices took twenty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from graphflow.integrations.dsv4.config import DSV4Config
from graphflow.integrations.dsv4.weights import WeightSource

__all__ = ["Compressor", "PagedLayout", "eager_attention", "static_attention", "write_token"]


class PagedLayout(nn.Module):
    """Where token ``t`` of sequence ``b`` lives in a layer's pool [num_blocks, block_size, kv_dim].

    The block table [max_batch, blocks_per_seq] is a seeded permutation of the pool's
    pages, shared by every layer (like an engine's page allocator after some churn), so
    a sequence's pages are scattered and only the table finds them. It and the tables
    derived from it (module docstring) are registered module buffers, so capture knows
    them as the model's own, fixed tensors. A position ``p`` means length ``p + 1``.
    """

    def __init__(self, config: DSV4Config, device: torch.device):
        super().__init__()
        m, length = config.compress_every, config.max_len
        self.block_size = config.block_size
        self.max_len = length
        self.tail = m - 1
        generator = torch.Generator().manual_seed(config.seed + 1)
        table = torch.randperm(config.num_blocks, generator=generator).view(config.max_batch, config.blocks_per_seq)
        tokens = torch.arange(length)
        slots = table[:, tokens // config.block_size] * config.block_size + tokens % config.block_size
        lengths = tokens + 1
        tail = (lengths // m * m).unsqueeze(-1) + torch.arange(m - 1)  # [max_len, m-1] tokens after the compressed
        window = lengths.unsqueeze(-1) + torch.arange(-m, 0)  # [max_len, m] the last m tokens
        masked = torch.cat((torch.arange(m - 1) >= (lengths % m).unsqueeze(-1),
                            torch.arange(config.max_compressed) >= (lengths // m).unsqueeze(-1)), dim=1)
        bias = torch.zeros(masked.shape).masked_fill(masked, float("-inf")).to(getattr(torch, config.dtype))
        self.register_buffer("block_table", table.to(device))  # [max_batch, blocks_per_seq] int64
        self.register_buffer("slot_table", slots.to(device))  # [max_batch, max_len] int64
        self.register_buffer("tail_slots", slots[:, tail.clamp(max=length - 1)].to(device))  # [max_batch, max_len, m-1]
        self.register_buffer("window_slots", slots[:, window.clamp(min=0)].to(device))  # [max_batch, max_len, m]
        self.register_buffer("key_bias", bias.to(device))  # [max_len, m-1 + max_compressed]: tail keys, then compressed
        self.register_buffer("due", (lengths % m == 0).to(device))  # [max_len] bool: a compressed entry is due
        self.register_buffer("steps", torch.arange(max(length, config.max_batch), device=device))  # 0, 1, 2, …

    def slots(self, tokens: torch.Tensor) -> torch.Tensor:
        """Flat pool slots of tokens [B, T] (token index per sequence row) → [B, T]."""
        return torch.gather(self.slot_table[: tokens.shape[0]], 1, tokens.clamp(0, self.max_len - 1))

    def read(self, pool: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Latents at the slots ``table`` [max_batch, max_len, k] lists for each sequence's position → [B, k, kv_dim]."""
        slots = table[self.steps[: positions.shape[0]], positions]  # [B, k]
        return pool.view(-1, pool.shape[-1]).index_select(0, slots.flatten()).view(*slots.shape, pool.shape[-1])


class Compressor(nn.Module):
    """Folds ``m`` consecutive latents into one: a learned softmax over the window, then a projection."""

    def __init__(self, config: DSV4Config, source: WeightSource):
        super().__init__()
        self.every = config.compress_every
        self.gate = source.normal(config.compress_every, std=1.0)
        self.proj = source.normal(config.kv_dim, config.kv_dim)
        # The gate's softmax never changes: computed once, not once per call.
        self.register_buffer("mix", torch.softmax(self.gate.float(), dim=0).to(source.dtype))  # [m]

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """window [B, m, kv_dim] → [B, kv_dim]."""
        return torch.matmul(torch.matmul(self.mix, window), self.proj)


def write_token(layout: PagedLayout, pool: torch.Tensor, kv: torch.Tensor, positions: torch.Tensor) -> None:
    """Store each sequence's new latent kv [B, kv_dim] at its position's slot (slots are distinct)."""
    slots = torch.gather(layout.slot_table[: positions.shape[0]], 1, positions.unsqueeze(-1)).squeeze(-1)
    pool.view(-1, pool.shape[-1]).index_copy_(0, slots, kv)


def _compress(layout: PagedLayout, compressor: Compressor, pool: torch.Tensor, comp_cache: torch.Tensor,
              positions: torch.Tensor, due: torch.Tensor | None) -> None:
    """Fold each sequence's last m latents into its compressed entry n//m - 1, where due.

    ``due`` [B, 1] masks the rows whose length n = p + 1 is a multiple of m; None means
    every row is. For a due row n//m - 1 = p//m; any other row gets p//m too (always in
    range), rewritten with its own value.
    """
    entry = compressor(layout.read(pool, layout.window_slots, positions))
    rows = layout.steps[: comp_cache.shape[0]]
    index = torch.div(positions, compressor.every, rounding_mode="floor")
    comp_cache[rows, index] = entry if due is None else torch.where(due, entry, comp_cache[rows, index])


def _attend(layout: PagedLayout, q: torch.Tensor, pool: torch.Tensor, comp_cache: torch.Tensor,
            positions: torch.Tensor, n_comp: int, out: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention of q [B, H, D] over the tail window and the first n_comp compressed entries."""
    keys = torch.cat((layout.read(pool, layout.tail_slots, positions), comp_cache[:, :n_comp]), dim=1)  # [B, S, D]
    bias = layout.key_bias[:, : layout.tail + n_comp][positions]  # [B, S]: 0, or -inf past the length
    scores = torch.baddbmm(bias.unsqueeze(1), q, keys.transpose(1, 2), alpha=1.0 / math.sqrt(q.shape[-1]))
    return torch.bmm(torch.softmax(scores, dim=-1), keys, out=out)


def eager_attention(layout: PagedLayout, compressor: Compressor, q: torch.Tensor, kv: torch.Tensor,
                    positions: torch.Tensor, host_positions: Sequence[int], pool: torch.Tensor,
                    comp_cache: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with Python-int counts from ``host_positions`` (see the module docstring).

    ``positions`` [B] holds the same values on the device: it indexes, ``host_positions``
    sizes. Writes the result into ``out`` [B, H, kv_dim] when given, and returns it.
    """
    every = compressor.every
    write_token(layout, pool, kv, positions)
    due = [(p + 1) % every == 0 for p in host_positions]
    if any(due):
        _compress(layout, compressor, pool, comp_cache, positions,
                  None if all(due) else layout.due[positions].unsqueeze(-1))
    return _attend(layout, q, pool, comp_cache, positions, (max(host_positions) + 1) // every, out)


def static_attention(layout: PagedLayout, compressor: Compressor, q: torch.Tensor, kv: torch.Tensor,
                     positions: torch.Tensor, pool: torch.Tensor, comp_cache: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with device-side counts and fixed shapes (see the module docstring)."""
    write_token(layout, pool, kv, positions)
    _compress(layout, compressor, pool, comp_cache, positions, layout.due[positions].unsqueeze(-1))
    return _attend(layout, q, pool, comp_cache, positions, comp_cache.shape[1], out)
