"""The plan of a continuous-batching engine, read from its resolved objects.

Everything a graph of transformers' engine touches already exists when its batch processor
is built: the static input and output tensors of its ``ContinuousBatchingIOs`` (sized for
the largest batch) and the paged KV cache. graphflow allocates none of them: it adopts
them, so its graphs read and write the very tensors the engine's scheduler fills, and it
captures one graph per key the engine's padding allows (``keys``). This module says what
those are, and what memory they hold, before any capture.

Every key is captured FULL: the paged SDPA/eager attention of a varlen key reads a mask
and indices whose shapes the key fixes, so the whole step is static. (PIECEWISE, with the
attention eager between graphs, is what a key with a shape the graph cannot fix needs;
this engine has none.)
"""

from __future__ import annotations

import attrs
import torch

from graphflow.integrations.hf.batching.keys import ServingKey, serving_keys

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

    @property
    def static_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.role != "state")

    @property
    def cache_bytes(self) -> int:
        return sum(b.bytes for b in self.buffers if b.role == "state")

    def as_dict(self) -> dict:
        return {"name": self.name, "attention": self.attention, "device": self.device, "mode": "FULL",
                "keys": [str(k) for k in self.keys], "engine_keys": [list(k.engine_key) for k in self.keys],
                "buffers": [{"name": b.name, "adopts": b.path, "shape": list(b.shape), "dtype": b.dtype,
                             "role": b.role, "bytes": b.bytes} for b in self.buffers],
                "static_bytes": self.static_bytes, "cache_bytes": self.cache_bytes, "settings": self.settings}

    def render(self) -> str:
        """Plain text for ``graphflow show --serving``: settings, keys, buffers, memory."""
        lines = [f"serving plan {self.name}: {len(self.keys)} FULL graphs on {self.device}, attention "
                 f"{self.attention}",
                 "engine: " + ", ".join(f"{k} {v}" for k, v in self.settings.items()),
                 f"keys ({len(self.keys)}, captured largest first):"]
        lines += [f"  {key}" for key in self.keys]
        lines.append("buffers (adopted from the engine, none allocated):")
        width = max((len(b.name) for b in self.buffers), default=0)
        lines += [f"  {b.name.ljust(width)}  {b.role:6}  {list(b.shape)} {b.dtype}  {_mib(b.bytes)}  <- {b.path}"
                  for b in self.buffers]
        lines.append(f"memory: static tensors {_mib(self.static_bytes)}, KV cache {_mib(self.cache_bytes)}; "
                     "graph pool: the largest key's step, measured at its warmup before capture")
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
    settings = {"block_size": cache.block_size, "num_blocks": cache.num_blocks,
                "max_batch_tokens": cache.max_batch_tokens,
                "max_requests_per_batch": config.max_requests_per_batch,
                "q_padding_interval_size": config.q_padding_interval_size,
                "kv_padding_interval_size": config.kv_padding_interval_size,
                "layer_types": list(io.cumulative_seqlens_k), "longest_request": longest}
    model_config = processor.config
    return ServingPlan(name or f"{getattr(model_config, 'model_type', 'model')}-serving",
                       getattr(model_config, "_attn_implementation", "?"), str(io.device),
                       serving_keys(processor, longest), tuple(buffers), settings)


def batch_processor(engine):
    """A manager's batch processor (made if it has none), or ``engine`` itself if it is one."""
    if not hasattr(engine, "batch_processor"):
        return engine
    if engine.batch_processor is None:
        engine.batch_processor = engine._create_batch_processor()
    return engine.batch_processor


def _buffer(name: str, path: str, tensor: torch.Tensor, role: str) -> ServingBuffer:
    return ServingBuffer(name, path, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), role)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
