"""The graph keys a continuous-batching engine's padding can ask for, and which of them
serve a batch.

transformers' engine pads every batch before its forward: the query tokens to a multiple of
``q_padding_interval_size`` (capped at ``max_batch_tokens``), the KV tokens read from the
paged cache to a multiple of ``kv_padding_interval_size`` (capped at the cache's pages), and
each layer type's longest key sequence to a power of two (at least 1024, capped at the
pages). Batches that pad alike launch the same kernels on the same views of its static
tensors. graphflow lists every key up front, from the engine's own padding functions
applied to every size a batch can have, so a plan says before any capture what will be
captured, and a key it never lists is a fallback it can name.

Two kinds of key (``Mode``):

* **PIECEWISE**, keyed by the padded query tokens alone (``piecewise(q=128)``): the step
  captured in pieces with its attention calls eager between them, on the current batch's
  masks and indices (``graphflow.integrations.hf.batching.pieces``). The attention is the
  only part of the step whose shapes follow the KV tokens read and the longest key
  sequences, so one such key serves every varlen batch of its q: they cover every batch.
* **FULL**, the whole step one graph, keyed by every padded size its step fixes: only
  where a whole graph pays most, the decode-only batches (every request one query token):
  their steps are the shortest, so the host's time for each layer's eager attention call
  weighs most there. On the varlen path (no decode fast path: SDPA and
  eager attention) such a key is (q, kv, seqlens), ``varlen(q=64, kv=4096,
  seqlen_k=1024)``; the decode fast path (a block table; flash attention only) is keyed
  by its padded request count alone, ``decode(q=32)``.

A step replays its batch's FULL key when there is one and it is live, else its PIECEWISE
key (``batch_keys``). A FULL key per (q, kv, seqlens) for every batch listed 512 keys for
Llama-3-8B's serving settings (2048 blocks of 32, 1024 batch tokens, 64 requests, the
longest request 1,152 tokens; 1,616 without that bound), most of them never served; the
same settings now plan 16 PIECEWISE and 32 FULL keys (tests/test_hf_serving_piecewise.py).
"""

from __future__ import annotations

import enum
import itertools

import attrs

from graphflow.plan import Mode

__all__ = ["DECODE", "VARLEN", "ForwardPath", "ServingKey", "batch_keys", "decode_only", "serving_keys"]


class ForwardPath(enum.StrEnum):
    """The engine's two forward paths: the varlen one (any batch), and the decode fast
    path (decode-only batches, through a block table: flash attention only)."""

    VARLEN = "varlen"
    DECODE = "decode"


VARLEN, DECODE = ForwardPath.VARLEN, ForwardPath.DECODE


@attrs.frozen(order=True)
class ServingKey:
    """One graph of the engine: a path, its padded sizes, and how it is captured.

    ``seqlens`` are the padded longest key sequences, one per layer type the cache has
    (full attention first, then sliding), as the engine orders them. A PIECEWISE key
    fixes the query tokens alone (``kv`` 0, no ``seqlens``): ``ServingKey.piecewise(q)``.
    """

    path: ForwardPath = attrs.field(converter=ForwardPath)
    q: int = attrs.field(validator=attrs.validators.ge(1))
    kv: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    seqlens: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    mode: Mode = attrs.field(default=Mode.FULL, converter=Mode, order=lambda mode: mode.value)

    def __attrs_post_init__(self) -> None:
        if self.mode is Mode.PIECEWISE and (self.path != VARLEN or self.kv or self.seqlens):
            raise ValueError(f"a PIECEWISE key is a varlen batch's padded query tokens alone, not {self!r}")

    @classmethod
    def piecewise(cls, q: int) -> ServingKey:
        """The PIECEWISE key of the varlen batches of ``q`` padded query tokens."""
        return cls(VARLEN, q, mode=Mode.PIECEWISE)

    @property
    def engine_key(self) -> tuple[int, ...] | None:
        """The tuple the engine keys its own graphs by (``ContinuousBatchingIOs._get_graph_key``);
        None for a PIECEWISE key: the engine captures whole steps only."""
        if self.mode is Mode.PIECEWISE:
            return None
        return (self.q,) if self.path == DECODE else (self.q, self.kv, *self.seqlens)

    def __str__(self) -> str:
        if self.mode is Mode.PIECEWISE:
            return f"piecewise(q={self.q})"
        if self.path == DECODE:
            return f"decode(q={self.q})"
        return f"varlen(q={self.q}, kv={self.kv}, seqlen_k={'/'.join(map(str, self.seqlens))})"


def decode_only(io) -> bool:
    """Whether every request of the batch ``io`` (a ``ContinuousBatchingIOs``) holds brings
    one query token (its real tokens, before padding, are its requests)."""
    return io.num_request_in_batch > 0 and io.total_seqlen_q == io.num_request_in_batch


def batch_keys(io) -> tuple[ServingKey, ...]:
    """The keys that may serve the batch ``io`` holds, preferred first, once its model
    arguments were taken (``get_model_kwargs`` pads the sequence lengths): its FULL key
    when it is decode-only, then its PIECEWISE key, which covers it whatever it holds.
    The decode fast path has its FULL key alone."""
    if io.use_block_table:
        return (ServingKey(DECODE, io.num_q_tokens),)
    covering = ServingKey.piecewise(io.num_q_tokens)
    if not decode_only(io):
        return (covering,)
    return ServingKey(VARLEN, io.num_q_tokens, io.max_kv_read, tuple(io.max_seqlen_k.values())), covering


def serving_keys(processor, longest: int | None = None) -> tuple[ServingKey, ...]:
    """Every key a batch of ``processor`` (a ``ContinuousBatchProcessor`` with padding on)
    can ask for: the PIECEWISE keys first, then the FULL ones, each largest first (a
    foreground capture's order: coverage first, and the pool sized by its largest graph
    first), as its own padding functions compute them.

    ``longest``: the most tokens one request holds (prompt and new tokens) on this server,
    when it is known: a layer's longest key sequence is at most that, so the FULL keys
    padded beyond it are left out (else the cache's pages bound them)."""
    from transformers.generation.continuous_batching.utils import pad_to_pow2

    cache = processor.cache
    config = processor.model_runner.cb_config
    pages = cache.num_pages
    qs, kvs = _sizes(processor)
    # A full-attention layer keeps a request's every token in its own blocks, so a batch's
    # query and past fit in the pages, unless blocks are shared: with ``allow_block_sharing``
    # requests that share a prefix, and the children a request with ``num_return_sequences``
    # forks (even on a hybrid model, where prefix sharing is off), each read the shared
    # blocks. A sliding-only cache keeps one window's ring of blocks per request whatever its
    # length (``SlidingAttentionCacheAllocator``): ``max_batch_tokens`` alone bounds its query.
    query_in_pages = cache.num_full_attention_groups > 0 and not cache.allow_block_sharing
    piecewise = [ServingKey.piecewise(q) for q, q_least in qs if not (query_in_pages and q_least > pages)]
    if processor.inputs_and_outputs.block_table.numel() > 0:  # the decode fast path (flash attention)
        most = config.max_requests_per_batch
        full = [ServingKey(DECODE, n) for n in sorted({pad_to_pow2(n, most) for n in _powers_up_to(most)})]
    else:
        full = _decode_only_keys(processor, qs, kvs, longest, query_in_pages)
    return (*sorted(set(piecewise), reverse=True), *sorted(set(full), reverse=True))


def _decode_only_keys(processor, qs, kvs, longest: int | None, query_in_pages: bool) -> list[ServingKey]:
    """The FULL keys of the decode-only varlen batches: n requests of one query token each
    (n up to ``max_requests_per_batch``), each reading at least one past token."""
    from transformers.generation.continuous_batching.utils import pad_to_pow2

    cache = processor.cache
    config = processor.model_runner.cb_config
    pages = cache.num_pages
    requests = config.max_requests_per_batch
    # The KV a request reads: at most the cache's pages, what the scheduler lets one read
    # (a sliding-window model's window) and what one holds (``longest``).
    per_request = min(n for n in (getattr(processor.scheduler, "read_cache_limit", None), longest, pages) if n)
    layer_types = list(processor.inputs_and_outputs.cumulative_seqlens_k)
    window = getattr(processor.config, "sliding_window", None) or pages
    keys = []
    for (q, q_least), (kv, kv_least) in itertools.product(qs, kvs):
        most_requests = min(q, requests)
        if q_least > requests or kv_least > most_requests * per_request \
                or (query_in_pages and q_least + kv_least > pages):
            continue  # no decode-only batch pads to it
        per_type = []
        for layer_type in layer_types:
            # A request's keys: its past and its one new token (a sliding layer keeps
            # window - 1 of the past).
            most = min(kv + 1, pages, longest or pages)
            if layer_type != "full_attention":
                most = min(most, window)
            per_type.append(sorted({pad_to_pow2(n, pages, 1024) for n in _powers_up_to(most)}))
        keys.extend(ServingKey(VARLEN, q, kv, seqlens) for seqlens in itertools.product(*per_type))
    return keys


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
