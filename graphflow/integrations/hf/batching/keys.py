"""The graph keys a continuous-batching engine's padding can ask for, and a batch that asks
for each.

transformers' engine pads every batch before its forward: the query tokens to a multiple of
``q_padding_interval_size`` (capped at ``max_batch_tokens``), the KV tokens read from the
paged cache to a multiple of ``kv_padding_interval_size`` (capped at the cache's pages), and
each layer type's longest key sequence to a power of two (at least 1024, capped at the
pages). Batches that pad alike launch the same kernels on the same views of its static
tensors, so one graph serves them all: the padded sizes are the key. The engine captures a
key the first time a batch asks for it; graphflow lists them all up front, from the engine's
own padding functions applied to every size a batch can have, so a plan says before any
capture what will be captured, and a key it never lists is a fallback it can name.

The decode fast path (a block table, flash attention only) is keyed by its padded request
count alone.
"""

from __future__ import annotations

import enum
import itertools

import attrs

__all__ = ["DECODE", "VARLEN", "ForwardPath", "ServingKey", "key_of", "serving_keys"]

class ForwardPath(enum.StrEnum):
    """The engine's two forward paths: prefill and mixed batches, and decode-only batches."""

    VARLEN = "varlen"
    DECODE = "decode"


VARLEN, DECODE = ForwardPath.VARLEN, ForwardPath.DECODE


@attrs.frozen(order=True)
class ServingKey:
    """One graph of the engine: a path and its padded sizes.

    ``seqlens`` are the padded longest key sequences, one per layer type the cache has
    (full attention first, then sliding), as the engine orders them.
    """

    path: ForwardPath = attrs.field(converter=ForwardPath)
    q: int = attrs.field(validator=attrs.validators.ge(1))
    kv: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    seqlens: tuple[int, ...] = attrs.field(default=(), converter=tuple)

    @property
    def engine_key(self) -> tuple[int, ...]:
        """The tuple the engine keys its own graphs by (``ContinuousBatchingIOs._get_graph_key``)."""
        return (self.q,) if self.path == DECODE else (self.q, self.kv, *self.seqlens)

    def __str__(self) -> str:
        if self.path == DECODE:
            return f"decode(q={self.q})"
        return f"varlen(q={self.q}, kv={self.kv}, seqlen_k={'/'.join(map(str, self.seqlens))})"


def key_of(io) -> ServingKey:
    """The key of the batch ``io`` (a ``ContinuousBatchingIOs``) holds, once its model
    arguments were taken (``get_model_kwargs`` pads the sequence lengths)."""
    if io.use_block_table:
        return ServingKey(DECODE, io.num_q_tokens)
    return ServingKey(VARLEN, io.num_q_tokens, io.max_kv_read, tuple(io.max_seqlen_k.values()))


def serving_keys(processor, longest: int | None = None) -> tuple[ServingKey, ...]:
    """Every key a batch of ``processor`` (a ``ContinuousBatchProcessor`` with padding on)
    can have, largest first, as its own padding functions compute them.

    ``longest``: the most tokens one request holds (prompt and new tokens) on this server,
    when it is known: a layer's longest key sequence is at most that, so the keys padded
    beyond it are left out (else the cache's pages bound them)."""
    from transformers.generation.continuous_batching.utils import pad_to_pow2

    cache = processor.cache
    config = processor.model_runner.cb_config
    pages = cache.num_pages
    qs, kvs = _sizes(processor)
    # The KV a batch reads: at most the cache's pages, and per request at most what the
    # scheduler lets one read (a sliding-window model's window) or holds (``longest``).
    per_request = min(n for n in (getattr(processor.scheduler, "read_cache_limit", None), longest, pages) if n)
    kv_most = min(pages, config.max_requests_per_batch * per_request)
    # A full-attention layer keeps a request's every token in its own blocks, so a batch's
    # query and past fit in the pages, unless blocks are shared: with ``allow_block_sharing``
    # requests that share a prefix, and the children a request with ``num_return_sequences``
    # forks (even on a hybrid model, where prefix sharing is off), each read the shared
    # blocks. A sliding-only cache keeps one window's ring of blocks per request whatever its
    # length (``SlidingAttentionCacheAllocator``): ``max_batch_tokens`` alone bounds its query.
    query_in_pages = cache.num_full_attention_groups > 0 and not cache.allow_block_sharing
    keys = []
    layer_types = list(processor.inputs_and_outputs.cumulative_seqlens_k)
    window = getattr(processor.config, "sliding_window", None) or pages
    for (q, q_least), (kv, kv_least) in itertools.product(qs, kvs):
        if kv_least > kv_most or (query_in_pages and q_least + kv_least > pages):
            continue  # the scheduler never makes its smallest batch
        per_type = []
        for layer_type in layer_types:
            # A request's keys: its past and its query (a sliding layer keeps window - 1 of the past).
            most = min(kv + q, pages, longest or pages)
            if layer_type != "full_attention":
                most = min(most, q + window - 1)
            per_type.append(sorted({pad_to_pow2(n, pages, 1024) for n in _powers_up_to(most)}))
        keys.extend(ServingKey(VARLEN, q, kv, seqlens) for seqlens in itertools.product(*per_type))
    if processor.inputs_and_outputs.block_table.numel() > 0:  # the decode fast path (flash attention)
        most = config.max_requests_per_batch
        keys.extend(ServingKey(DECODE, n) for n in sorted({pad_to_pow2(n, most) for n in _powers_up_to(most)}))
    return tuple(sorted(set(keys), reverse=True))


def _sizes(processor) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The padded query and KV sizes, each with the least size padded to it."""
    from transformers.generation.continuous_batching.utils import pad_to_interval

    cache, config = processor.cache, processor.model_runner.cb_config
    pages, tokens = cache.num_pages, cache.max_batch_tokens
    qs = _padded(lambda n: pad_to_interval(n, config.q_padding_interval_size, tokens), 1, tokens,
                 config.q_padding_interval_size)
    kvs = _padded(lambda n: pad_to_interval(n, config.kv_padding_interval_size, pages), 0, pages,
                  config.kv_padding_interval_size)
    return qs, kvs


def _padded(pad, low: int, high: int, step: int) -> list[tuple[int, int]]:
    """The values ``pad`` takes on ``low..high``, each with the least size padded to it:
    ``pad`` changes value only after multiples of ``step``."""
    step = max(step, 1)
    points = sorted({low, high, *range(low, high + 1, step), *range(low + 1, high + 1, step)})
    least: dict[int, int] = {}
    for n in points:
        if low <= n <= high:
            least.setdefault(pad(n), n)
    return sorted(least.items())


def _powers_up_to(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n``: the points where padding to a power of two changes."""
    return sorted({*(2 ** i for i in range(max(n, 1).bit_length()) if 2 ** i <= n), max(n, 1)})
