"""The plan of a continuous-batching engine, read from its resolved objects.

Everything a graph of transformers' engine touches already exists when its batch processor
is built: the static input and output tensors of its ``ContinuousBatchingIOs`` (sized for
the largest batch) and the paged KV cache. graphflow allocates none of them: it adopts
them, so its graphs read and write the very tensors the engine's scheduler fills, and it
captures the keys the engine's padding allows (``keys``). This module says what those
are, and what memory they hold, before any capture.

The paged SDPA and eager attentions read a mask and indices whose shapes follow the KV
tokens a batch reads: a graph holding them is one per (q, kv, seqlens), hundreds for a
long cache. So most keys are PIECEWISE, one per padded query size, the attention eager
between graph pieces (``graphflow.integrations.hf.batching.pieces``), and only the
decode-only batches, whose short steps a whole graph speeds up most, have FULL keys
(``graphflow.integrations.hf.batching.keys``). The PIECEWISE keys share four static
buffers (the attention's query, key, value and output at ``max_batch_tokens``), which
graphflow allocates: ``attention_buffer_bytes``.
"""

from __future__ import annotations

import attrs
import torch

from graphflow.integrations.hf.batching.keys import DECODE, ServingKey, serving_keys
from graphflow.plan import Mode

__all__ = ["ServingBuffer", "ServingPlan", "batch_processor", "serving_plan"]


@attrs.frozen
class ServingBuffer:
    """A tensor of the engine the graphs adopt: where it lives on the engine, and its role."""

    name: str
    path: str
    shape: tuple[int, ...]
    dtype: str
    role: str  # input, output or state

    @property
    def bytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


@attrs.frozen
class ServingPlan:
    """What graphflow captures for one engine: its keys (largest first), the tensors they
    adopt, and the engine's settings that decided both."""

    name: str
    attention: str
    device: str
    keys: tuple[ServingKey, ...]
    buffers: tuple[ServingBuffer, ...]
    settings: dict = attrs.field(eq=False)
    #: The PIECEWISE keys' static attention buffers, from the model's heads (graphflow sizes
    #: them from the attention's calls at the first warm run: ``Serving.memory``).
    attention_buffer_bytes: int = 0

    @property
    def static_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.role != "state")

    @property
    def cache_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.role == "state")

    def count(self, mode: Mode) -> int:
        return sum(key.mode is mode for key in self.keys)

    def as_dict(self) -> dict:
        return {"name": self.name, "attention": self.attention, "device": self.device,
                "keys": [{"key": str(k), "mode": k.mode.value, "engine_key": None if k.engine_key is None
                          else list(k.engine_key)} for k in self.keys],
                "piecewise_keys": self.count(Mode.PIECEWISE), "full_keys": self.count(Mode.FULL),
                "buffers": [{"name": b.name, "adopts": b.path, "shape": list(b.shape), "dtype": b.dtype,
                             "role": b.role, "bytes": b.bytes} for b in self.buffers],
                "static_bytes": self.static_bytes, "cache_bytes": self.cache_bytes,
                "attention_buffer_bytes": self.attention_buffer_bytes, "settings": self.settings}

    def render(self) -> str:
        """Plain text for ``graphflow show --serving``: settings, keys and their modes,
        buffers, memory."""
        piecewise, full = self.count(Mode.PIECEWISE), self.count(Mode.FULL)
        lines = [(f"serving plan {self.name}: {len(self.keys)} graphs ({piecewise} PIECEWISE, {full} FULL) on "
                  f"{self.device}, attention {self.attention}"),
                 "engine: " + ", ".join(f"{k} {v}" for k, v in self.settings.items()),
                 f"keys ({len(self.keys)}, captured in this order: PIECEWISE, then FULL, each largest first):"]
        width = max((len(str(key)) for key in self.keys), default=0)
        lines += [f"  {key.mode.value:9}  {str(key).ljust(width)}  {_serves(key)}" for key in self.keys]
        lines.append("buffers (adopted from the engine, none allocated):")
        width = max((len(b.name) for b in self.buffers), default=0)
        lines += [f"  {b.name.ljust(width)}  {b.role:6}  {list(b.shape)} {b.dtype}  {_mib(b.bytes)}  <- {b.path}"
                  for b in self.buffers]
        lines.append(f"memory: static tensors {_mib(self.static_bytes)}, KV cache {_mib(self.cache_bytes)}"
                     + (f", static attention buffers of the PIECEWISE keys {_mib(self.attention_buffer_bytes)} "
                        "(allocated by graphflow)" if piecewise else "")
                     + "; graph pool: the largest key of each mode's step, probed warm before capture")
        return "\n".join(lines)


def serving_plan(engine, name: str | None = None, longest: int | None = None) -> ServingPlan:
    """The plan of ``engine``: a ``ContinuousBatchingManager`` (its batch processor is
    built if it has none yet, as its own ``warmup`` does) or a ``ContinuousBatchProcessor``,
    padded as graphflow serves it (``graphflow.integrations.hf.batching.serving`` turns the
    padding on); ``longest`` as ``serving_keys`` takes it."""
    processor = batch_processor(engine)
    io, cache = processor.inputs_and_outputs, processor.cache
    config = processor.model_runner.cb_config
    buffers = [_buffer("bulk_inputs", "inputs_and_outputs._bulk_input_tensor", io._bulk_input_tensor, "input"),
               _buffer("write_index", "inputs_and_outputs.write_index_storage", io.write_index_storage, "input"),
               _buffer("read_index", "inputs_and_outputs.read_index_storage", io.read_index_storage, "input")]
    if io.block_table.numel():
        buffers.append(_buffer("block_table", "inputs_and_outputs.block_table", io.block_table, "input"))
    for layer_type, mask in (io.attention_mask or {}).items():
        buffers.append(_buffer(f"mask_{layer_type}", f"inputs_and_outputs.attention_mask[{layer_type!r}]", mask,
                               "input"))
    buffers.append(_buffer("output_ids", "inputs_and_outputs.output_ids", io.output_ids, "output"))
    for group, (keys, values) in enumerate(zip(cache.key_cache, cache.value_cache)):
        buffers.append(_buffer(f"k{group}", f"cache.key_cache[{group}]", keys, "state"))
        buffers.append(_buffer(f"v{group}", f"cache.value_cache[{group}]", values, "state"))
    graph_keys = serving_keys(processor, longest)
    settings = {"block_size": cache.block_size, "num_blocks": cache.num_blocks,
                "max_batch_tokens": cache.max_batch_tokens,
                "max_requests_per_batch": config.max_requests_per_batch,
                "q_padding_interval_size": config.q_padding_interval_size,
                "kv_padding_interval_size": config.kv_padding_interval_size,
                "layer_types": list(io.cumulative_seqlens_k), "longest_request": longest}
    model_config = processor.config
    return ServingPlan(name or f"{getattr(model_config, 'model_type', 'model')}-serving",
                       getattr(model_config, "_attn_implementation", "?"), str(io.device), graph_keys,
                       tuple(buffers), settings,
                       _attention_buffer_bytes(processor) if any(k.mode is Mode.PIECEWISE for k in graph_keys) else 0)


def batch_processor(engine):
    """A manager's batch processor (made if it has none), or ``engine`` itself if it is one."""
    if not hasattr(engine, "batch_processor"):
        return engine
    if engine.batch_processor is None:
        engine.batch_processor = engine._create_batch_processor()
    return engine.batch_processor


def _attention_buffer_bytes(processor) -> int:
    """The static query, key, value and output buffers at ``max_batch_tokens``, from the
    model's heads: the query and output of every attention head, the key and value of the
    cache's heads, in the cache's dtype."""
    cache = processor.cache
    heads = getattr(processor.config, "num_attention_heads", cache.num_key_value_heads)
    per_token = (2 * heads + 2 * cache.num_key_value_heads) * cache.head_dim
    return per_token * cache.max_batch_tokens * torch.empty((), dtype=cache.dtype).element_size()


def _serves(key: ServingKey) -> str:
    if key.mode is Mode.PIECEWISE:
        return "any varlen batch of these query tokens, its attention eager between pieces"
    return "decode fast path" if key.path == DECODE else "decode-only batches"


def _buffer(name: str, path: str, tensor: torch.Tensor, role: str) -> ServingBuffer:
    return ServingBuffer(name, path, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), role)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
