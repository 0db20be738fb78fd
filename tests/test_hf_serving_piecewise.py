"""PIECEWISE serving keys (``graphflow.integrations.hf.batching.pieces``) on the CPU backend.

A PIECEWISE key is captured once per padded query size and serves every varlen batch of
that size: its attention calls run eagerly between the graph pieces, on the arguments of
the step being replayed. The CPU backend records no graph, so a "replay" runs the step
again with each attention call served as a cut graph's eager call serves it: the query,
key and value copied into the static buffers, the other arguments read from the current
batch by the paths mapped at capture. These tests check:

* the plan's size for Llama-3-8B's serving settings (block 32 x 2048 blocks,
  max_batch_tokens 1024, 64 requests, q interval 64, KV interval 4096), from a tiny model
  with the same settings: keys depend on the cache and batching alone;
* tokens identical to the engine's own eager steps under continuous batching, foreground
  and lazy, for mixed prefill and decode batches, with the paged SDPA and eager
  attentions, on full-attention, sliding-window and hybrid models; one PIECEWISE key
  serving batches that read different KV, and a replay handed a stale batch giving other
  tokens (the check is sensitive);
* decode-only steps on their FULL keys, the other steps on PIECEWISE keys;
* an argument no replay can make again is a ``CaptureError`` naming it, and its key is
  served eagerly; a batch missing a mapped argument fails the key's check; a step whose
  attention bypasses the registry fails its PIECEWISE keys;
* the static buffers: one set, shared by every layer and key; an output of another layout
  (flash's) served as the warm run returned it;
* ``close()`` gives transformers' attention registry back as it was;
* a thread warms one PIECEWISE key before capturing it (the others are captured cold,
  their static views sized from its run), and every FULL key;
* the default foreground: the PIECEWISE keys before serving, the FULL keys beside it
  (``full_in_background=False``: all before).
"""

from __future__ import annotations

import collections
import functools
import logging
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from graphflow.errors import CaptureError
from graphflow.integrations.hf.batching import ServingKey, serve, serving_plan
from graphflow.integrations.hf.batching.keys import DECODE, VARLEN
from graphflow.integrations.hf.batching.pieces import (
    AttentionBuffers,
    AttentionCall,
    FromBatch,
    FromStatic,
    Pieces,
)
from graphflow.plan import Mode
from tests.serving_models import (  # noqa: F401 - quick_gc: a module fixture
    EVERY_KEY_VERIFIED,
    build,
    manager,
    prompts,
    quick_gc,
    run,
)

NEW = 6
#: A prompt of 90 tokens is prefilled in three chunks of 32 query tokens reading 0, 32 and
#: 64 past tokens: one PIECEWISE key serves batches that read different KV.
MIXED = prompts((90, 6, 50, 3))



# -- the plan's size -----------------------------------------------------------------------

#: Llama-3-8B's serving on an H100: 2048 blocks of 32 tokens, batches of up to 1024 query
#: tokens and 64 requests, the query padded to 64 tokens and the KV read to 4096.
LLAMA3_8B_SERVING = {"block_size": 32, "num_blocks": 2048, "max_batch_tokens": 1024, "max_requests_per_batch": 64,
                     "q_padding_interval_size": 64, "kv_padding_interval_size": 4096}
#: The longest request of that server: prompt and new tokens.
LONGEST = 1152


@pytest.fixture(scope="module")
def llama3_8b_serving():
    """A manager with Llama-3-8B's serving settings and positions on a tiny random Llama:
    the keys follow the cache and batching settings, not the model's width."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from tests.serving_models import cb_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1,
                                         max_position_embeddings=8192)).to(torch.bfloat16).eval()
    model.set_attn_implementation("paged|sdpa")
    generation = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0)
    yield model.init_continuous_batching(generation_config=generation,
                                         continuous_batching_config=cb_config(**LLAMA3_8B_SERVING))
    model.destroy_cached_continuous_batching_manager()


def test_the_llama3_8b_serving_plan_has_at_most_64_keys(llama3_8b_serving):
    """With a FULL key per (q, kv, seqlens) for every batch, these settings planned 512
    keys. Now: one PIECEWISE key per padded query size (64 to 1024), and FULL keys for
    the decode-only batches alone (64 requests at most: q=64; KV 4096 to 65536; the longest
    sequence, at most 1152 tokens, padded to 1024 or 2048)."""
    plan = serving_plan(llama3_8b_serving, longest=LONGEST)
    assert len(plan.keys) <= 64
    piecewise = [k for k in plan.keys if k.mode is Mode.PIECEWISE]
    full = [k for k in plan.keys if k.mode is Mode.FULL]
    assert piecewise == [ServingKey.piecewise(q) for q in range(1024, 0, -64)]
    assert {(k.path, k.q) for k in full} == {(VARLEN, 64)}
    assert {k.kv for k in full} == set(range(4096, 65536 + 1, 4096))
    assert {k.seqlens for k in full} == {(1024,), (2048,)}
    assert (len(piecewise), len(full), len(plan.keys)) == (16, 32, 48)
    assert plan.as_dict()["piecewise_keys"] == 16 and plan.as_dict()["full_keys"] == 32


def test_without_a_longest_request_the_cache_bounds_the_full_keys(llama3_8b_serving):
    """Documented: without ``longest`` a request may hold the whole cache (65,536 tokens),
    and a decode-only batch's longest sequence pads to any power of two up to that: 101
    FULL keys (1,616 keys in all when every batch had a FULL key). ``serve`` bounds it by
    the model's positions by default (8192 here, as Llama-3-8B's): 64 FULL keys."""
    unbounded = serving_plan(llama3_8b_serving, longest=None)
    assert (unbounded.count(Mode.PIECEWISE), unbounded.count(Mode.FULL)) == (16, 101)
    positions = serving_plan(llama3_8b_serving, longest=8192)
    assert (positions.count(Mode.PIECEWISE), positions.count(Mode.FULL)) == (16, 64)
    # The PIECEWISE keys do not depend on it.
    assert [k for k in unbounded.keys if k.mode is Mode.PIECEWISE] == \
        [k for k in serving_plan(llama3_8b_serving, longest=LONGEST).keys if k.mode is Mode.PIECEWISE]


@given(q=st.integers(1, 4096), kv=st.integers(0, 4096), seqlens=st.lists(st.integers(1, 4096), max_size=2))
def test_a_piecewise_key_fixes_the_query_tokens_alone(q, kv, seqlens):
    key = ServingKey.piecewise(q)
    assert (key.path, key.q, key.kv, key.seqlens, key.mode) == (VARLEN, q, 0, (), Mode.PIECEWISE)
    assert str(key) == f"piecewise(q={q})" and key.engine_key is None
    assert key != ServingKey(VARLEN, q) and key == ServingKey(VARLEN, q, mode="PIECEWISE")
    if kv or seqlens:
        with pytest.raises(ValueError, match="PIECEWISE key"):
            ServingKey(VARLEN, q, kv, tuple(seqlens), mode=Mode.PIECEWISE)
    with pytest.raises(ValueError, match="PIECEWISE key"):
        ServingKey(DECODE, q, mode=Mode.PIECEWISE)
    full = ServingKey(VARLEN, q, kv, tuple(seqlens))
    sorted([key, full])  # the modes order too: keys of both modes sort without raising


# -- tokens --------------------------------------------------------------------------------


@functools.cache
def _engine_alone(name: str, attention: str):
    """The engine's own tokens for ``MIXED``, without graphflow."""
    return run(build(name, attention)[0], MIXED, NEW).tokens


@pytest.mark.parametrize(("name", "attention"), [
    ("llama", "paged|sdpa"),
    ("llama", "paged|eager"),
    ("mistral", "paged|sdpa"),
    ("qwen2", "paged|sdpa"),
    ("qwen2", "paged|eager"),
    pytest.param("gemma2", "paged|sdpa", marks=pytest.mark.slow),
    pytest.param("gemma3", "paged|sdpa", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("mode", ["fg", "fg-all", "lazy"])
def test_tokens_are_the_engines_under_continuous_batching(name, attention, mode):
    """Requests added after the start: prefill chunks beside decoding requests, then
    decode-only batches. Every step of a foreground run is on a graph (the PIECEWISE keys
    cover every batch): the prefills and mixed steps on PIECEWISE keys, one of which serves
    batches reading different KV; with every key captured before serving (``fg-all``) the
    decode-only steps on FULL keys (a sliding-only cache reads one window's KV at most, a
    single padded size here)."""
    model, _ = build(name, attention)
    result = run(model, MIXED, NEW, "lazy" if mode == "lazy" else "fg",
                 serve_kwargs={"full_in_background": False} if mode == "fg-all" else None)
    assert result.tokens == _engine_alone(name, attention)
    summary = result.serving.coverage.as_dict()
    assert summary["steps"] == result.steps
    assert not [k for k, e in summary["keys"].items() if e["state"] == "failed"], result.serving.report()
    if mode == "lazy":
        return
    assert summary["graph_steps"] == result.steps
    if mode == "fg":
        return
    on = collections.defaultdict(set)  # the KV each key's steps read
    for keys, read in zip(result.keys, result.reads):
        on[keys[0]].add(read)
    if "full_attention" in result.serving.plan.settings["layer_types"]:  # a sliding-only cache reads a window
        assert any(key.mode is Mode.PIECEWISE and len(reads) > 1 for key, reads in on.items()), on
    decode_only = [keys[0] for keys in result.keys if keys[0].mode is Mode.FULL]
    assert decode_only and all(summary["keys"][str(k)]["graph_steps"] for k in decode_only)


def test_a_replay_handed_a_stale_batch_gives_other_tokens(monkeypatch):
    """The check above is sensitive: a PIECEWISE replay whose attention read the first
    batch it served, not the current one (verification off, so the graph goes live
    unchecked), gives other tokens."""
    first: dict[int, dict] = {}
    replay = Pieces.replay

    def stale(self, graph, batch):
        replay(self, graph, first.setdefault(id(self), batch))

    monkeypatch.setattr(Pieces, "replay", stale)
    model, _ = build("llama")
    result = run(model, MIXED, NEW, "fg", serve_kwargs={"verify": False})
    assert result.tokens != _engine_alone("llama", "paged|sdpa")


def test_foreground_captures_the_piecewise_keys_first():
    """Every key before serving: the PIECEWISE keys first, then the FULL ones; the largest
    of each mode verified then (live), the others waiting for their first batch."""
    lines: list[str] = []
    model, _ = build("llama")
    serving = serve(manager(model, NEW), full_in_background=False, progress=lines.append)
    try:
        keys = serving.plan.keys
        modes = [keys[i].mode for i in range(len(lines))]
        assert len(lines) == len(keys)
        assert modes == sorted(modes, key=lambda m: m is Mode.FULL) and len(set(modes)) == 2
        assert all(str(key) in line for key, line in zip(keys, lines))
        firsts = {next(k for k in keys if k.mode is mode) for mode in Mode if any(k.mode is mode for k in keys)}
        assert all(serving.coverage.state(key) == ("live" if key in firsts else "captured") for key in keys)
        assert serving.checks.before_ready == 2 and serving.checks.waiting == len(keys) - 2
    finally:
        serving.close()


@pytest.mark.parametrize("tokens, warmed", [(32, [32]), (16, [16, 8])])
def test_a_thread_warms_one_piecewise_key_and_every_full_key(monkeypatch, tokens, warmed):
    """A warm run before a capture makes the libraries' per-thread state and sizes the
    static attention buffers and output views. A PIECEWISE key's attention runs outside
    its graphs, so after the first on a thread the others are captured cold, their views
    sized from that run; each FULL key keeps its own (its attention is in its graph). With
    ``max_batch_tokens`` 16 the first run's query tokens equal the head dim (16): its
    output has two dimensions of 16, and the next key's run of 8 tells them apart. Another
    thread (the capture thread) warms once more."""
    from graphflow.integrations.hf.batching.capture import KeyCapture

    runs: list = []
    warming = KeyCapture._warming

    def counted(self, key):
        runs.append(key)
        return warming(self, key)

    monkeypatch.setattr(KeyCapture, "_warming", counted)
    model, _ = build("llama")
    assert model.config.hidden_size // model.config.num_attention_heads == 16
    serving = serve(manager(model, NEW, max_batch_tokens=tokens), full_in_background=False)
    try:
        keys = serving.plan.keys
        assert [k.q for k in runs if k.mode is Mode.PIECEWISE] == warmed
        assert [k for k in runs if k.mode is Mode.FULL] == [k for k in keys if k.mode is Mode.FULL]
        assert all(serving.coverage.state(k) in ("live", "captured") for k in keys)
        cut = serving.capture.cut
        assert not cut.needs_warming()
        elsewhere: list[bool] = []
        thread = threading.Thread(target=lambda: elsewhere.append(cut.needs_warming()))
        thread.start()
        thread.join()
        assert elsewhere == [True]
    finally:
        serving.close()
    result = run(model, MIXED, NEW, "fg", max_batch_tokens=tokens)
    assert result.tokens == run(model, MIXED, NEW, max_batch_tokens=tokens).tokens
    assert result.serving.coverage.as_dict()["graph_steps"] == result.steps


def test_an_output_view_follows_the_dimension_of_tokens_the_warm_runs_found():
    buffers = AttentionBuffers(max_tokens=32)
    query = torch.empty(1, 2, 32, 16)
    buffers.fit(32, query, query, query, torch.empty(1, 32, 2, 16))
    buffers.remember(32, 0, torch.empty(1, 32, 2, 16))
    assert buffers.derives
    assert buffers.output_like(8, 0, query[:, :, :8], query[:, :, :8]).shape == (1, 8, 2, 16)
    flat = torch.empty(32, 2, 16).transpose(0, 1)  # another layout: its order is kept
    buffers.remember(32, 1, flat)
    view = buffers.output_like(8, 1, query[:, :, :8], query[:, :, :8])
    assert view.shape == (2, 8, 16) and view.stride() == (16, 32, 1)
    ambiguous = AttentionBuffers(max_tokens=16)
    ambiguous.fit(16, query, query, query, query)
    ambiguous.remember(16, 0, torch.empty(1, 16, 2, 16))  # tokens, or the head dim?
    assert not ambiguous.derives
    assert ambiguous.output_like(8, 0, query[:, :, :8], query[:, :, :8]).shape == (1, 8, 2, 16)  # the interface's
    ambiguous.remember(8, 0, torch.empty(1, 8, 2, 16))
    assert ambiguous.derives and ambiguous.output_like(4, 0, query, query).shape == (1, 4, 2, 16)


# -- arguments -----------------------------------------------------------------------------


def test_an_argument_no_replay_can_make_again_is_a_capture_error_naming_it(caplog):
    """Layer 1's attention given a tensor of its own (no entry of the step's batch, no
    weight of the module): every PIECEWISE key fails, naming the argument, and serves
    eagerly; the FULL keys (the whole step in one graph) are live; the tokens are the
    engine's."""
    model, _ = build("llama")
    attention = model.model.layers[1].self_attn
    attention.forward = functools.partial(type(attention).forward, attention, bias_of_mine=torch.zeros(1))
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(model, MIXED, NEW, "fg", serve_kwargs=EVERY_KEY_VERIFIED)
    _piecewise_failed_full_live(result, "the attention of layer 1 (LlamaAttention)",
                                "'bias_of_mine' holds a tensor that is neither an entry of the step's batch")
    assert "bias_of_mine" in caplog.text


def test_a_step_whose_attention_bypasses_the_registry_fails_its_piecewise_keys(monkeypatch):
    """A model that looks its attention up elsewhere than transformers' registry (here a
    registry of its own): a PIECEWISE capture would hold the attention inside its pieces,
    fixed to the KV of the batch captured. Those keys fail, saying so; the FULL keys are
    live; the tokens are the engine's."""
    from transformers.modeling_utils import AttentionInterface
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", AttentionInterface())
    model, _ = build("llama")
    result = run(model, MIXED, NEW, "fg", serve_kwargs=EVERY_KEY_VERIFIED)
    _piecewise_failed_full_live(result, "never called the attention through ALL_ATTENTION_FUNCTIONS['paged|sdpa']")


def _piecewise_failed_full_live(result, *why: str) -> None:
    """The engine's tokens; every PIECEWISE key failed, its failure saying ``why``; every FULL key live."""
    assert result.tokens == _engine_alone("llama", "paged|sdpa")
    summary = result.serving.coverage.as_dict()
    for key in result.serving.plan.keys:
        entry = summary["keys"][str(key)]
        if key.mode is Mode.PIECEWISE:
            assert entry["state"] == "failed"
            assert all(part in entry["failure"] for part in why), entry["failure"]
        else:
            assert entry["state"] == "live"


def test_arguments_are_mapped_by_identity_and_keyword():
    weight = torch.nn.Parameter(torch.ones(2))
    module = torch.nn.Module()
    module.sinks = weight
    mask = {"full_attention": torch.zeros(1, 1, 4, 8)}
    batch = {"attention_mask": mask, "read_index": [torch.arange(8)], "max_seqlen_q": 4, "cache": object(),
             "block_table": None}
    q = k = v = torch.zeros(1, 2, 4, 8)
    call = AttentionCall.of((module, q, k, v, mask["full_attention"]),
                            {"read_index": batch["read_index"], "max_seqlen_q": 4, "cache": batch["cache"],
                             "s_aux": weight, "sliding_window": None, "scaling": 0.5}, batch)
    sources = dict(call.kwargs)
    assert call.args[1:4] == (FromStatic("query"), FromStatic("key"), FromStatic("value"))
    assert call.args[4] == FromBatch(("attention_mask", "full_attention"))
    assert sources["read_index"] == FromBatch(("read_index",))
    assert sources["max_seqlen_q"] == FromBatch(("max_seqlen_q",))
    assert sources["cache"] == FromBatch(("cache",))
    # A weight of the module and plain values are constants; None is never found by identity.
    assert sources["s_aux"].constant is weight and sources["sliding_window"].constant is None
    assert sources["scaling"].constant == 0.5
    # At replay: the query, key and value from the static buffers, the rest from the batch;
    # a batch without an argument's path is an error naming it.
    buffers = AttentionBuffers(max_tokens=4)
    output = buffers.output_like(4, 0, q, v)
    assert output.shape == (1, 4, 2, 8)  # the attention interface's, without a warm run
    buffers.fit(4, q, k, v, output)
    views = buffers.views(q, k, v, output)
    args, kwargs = call.arguments(views, batch)
    assert args[1] is views.query and args[4] is mask["full_attention"] and kwargs["cache"] is batch["cache"]
    with pytest.raises(CaptureError, match=r"the step's batch has no batch\['read_index'\]"):
        call.arguments(views, {k: val for k, val in batch.items() if k != "read_index"})
    # A tensor inside the batch's list entry is found by its place.
    inner = AttentionCall.of((module, q, k, v, None), {"index": batch["read_index"][0]}, batch)
    assert dict(inner.kwargs)["index"] == FromBatch(("read_index", 0))
    with pytest.raises(CaptureError, match="positional arguments"):
        AttentionCall.of((module, q), {}, batch)


def test_a_batch_missing_a_mapped_argument_fails_the_keys_check(monkeypatch, caplog):
    """Lazy: a PIECEWISE graph's first step checks it; a replay whose batch lacks an
    argument its capture mapped raises, and the key fails with the path; the step serves
    the engine's eager tokens."""
    from graphflow.integrations.hf.batching.capture import KeyCapture

    replay = KeyCapture.replay

    def without_read_index(self, held, batch):
        replay(self, held, {k: v for k, v in batch.items() if k != "read_index"})

    monkeypatch.setattr(KeyCapture, "replay", without_read_index)
    model, _ = build("llama")
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(model, MIXED, NEW, "lazy", settle=True)
    assert result.tokens == _engine_alone("llama", "paged|sdpa")
    failed = {k: e["failure"] for k, e in result.serving.coverage.as_dict()["keys"].items() if e["state"] == "failed"}
    assert failed and all(k.startswith("piecewise") for k in failed)
    assert all("the step's batch has no batch['read_index']" in why for why in failed.values())


# -- the static buffers ----------------------------------------------------------------------


def test_one_set_of_static_buffers_serves_every_layer_and_key():
    model, _ = build("qwen2")
    mgr = manager(model, NEW)
    serving = serve(mgr)
    try:
        pieces = [held.pieces for held in serving.capture.graphs.values() if held.pieces is not None]
        assert len(pieces) == serving.plan.count(Mode.PIECEWISE) > 1
        calls = [views for p in pieces for _, views in p.calls]
        assert len(calls) == len(pieces) * model.config.num_hidden_layers
        for role in ("query", "key", "value", "output"):
            storages = {getattr(v, role).untyped_storage().data_ptr() for v in calls}
            assert len(storages) == 1, role
        config, tokens = model.config, mgr.batch_processor.cache.max_batch_tokens
        head_dim = config.hidden_size // config.num_attention_heads
        expected = (2 * config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim * tokens * 4
        assert serving.memory["attention_buffer_bytes"] == serving.plan.attention_buffer_bytes == expected
        assert "static attention buffers" in serving.report()
    finally:
        serving.close()


@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=4), data=st.data())
@settings(max_examples=60, deadline=None)
def test_a_static_view_has_the_shape_and_strides_of_the_dense_tensor_it_holds(shape, data):
    """The query, key and value arrive as views of a projection (the query of shape
    (batch, heads, tokens, head dim) transposed from (batch, tokens, heads, head dim)):
    their static copies keep the layout."""
    order = data.draw(st.permutations(range(len(shape))))
    base = torch.randn([shape[d] for d in order])
    tensor = base.permute([order.index(d) for d in range(len(shape))])
    assert tuple(tensor.shape) == tuple(shape)
    buffers = AttentionBuffers(max_tokens=8)
    flat = tensor.reshape(1, 1, -1, 1)
    buffers.fit(1, flat, flat, flat, flat)
    view = buffers._like("query", tensor)
    assert view.shape == tensor.shape
    assert all(a == b for a, b, n in zip(view.stride(), tensor.stride(), shape) if n > 1)  # a lone row has any
    assert view.is_contiguous() == tensor.is_contiguous()
    view.copy_(tensor)
    assert torch.equal(view, tensor)


# -- the registry ----------------------------------------------------------------------------


def _entry():
    return ALL_ATTENTION_FUNCTIONS._local_mapping.get("paged|sdpa", "absent"), ALL_ATTENTION_FUNCTIONS["paged|sdpa"]


def test_close_gives_the_attention_registry_back():
    """Two engines served at once share the registry's one wrapper; it goes with the last."""
    before = _entry()
    assert before == ("absent", sdpa_attention_paged_forward)
    model, _ = build("llama")
    first, second = serve(manager(model, NEW), lazy=True), serve(manager(model, NEW), lazy=True)
    try:
        assert ALL_ATTENTION_FUNCTIONS["paged|sdpa"] is not sdpa_attention_paged_forward
    finally:
        first.close()
    try:
        assert _entry()[1] is not sdpa_attention_paged_forward
    finally:
        second.close()
    assert _entry() == before
    # A plan with no PIECEWISE key takes nothing.
    only_full = serve(manager(model, NEW), keys=[k for k in first.plan.keys if k.mode is Mode.FULL])
    assert _entry() == before
    only_full.close()


def test_close_puts_back_an_attention_registered_before():
    def mine(*args, **kwargs):
        return sdpa_attention_paged_forward(*args, **kwargs)

    ALL_ATTENTION_FUNCTIONS["paged|sdpa"] = mine
    try:
        model, _ = build("llama")
        result = run(model, MIXED, NEW, "fg")
        assert result.tokens == _engine_alone("llama", "paged|sdpa")
        assert ALL_ATTENTION_FUNCTIONS["paged|sdpa"] is mine
    finally:
        del ALL_ATTENTION_FUNCTIONS["paged|sdpa"]
    assert _entry() == ("absent", sdpa_attention_paged_forward)


def test_an_attention_output_of_another_layout_is_served_as_its_warm_run_returned_it():
    """Flash's varlen attention returns (tokens, heads, head dim), not the attention
    interface's (batch, tokens, heads, head dim): a key's static output view takes the
    layout its warm run returned. (Here the paged SDPA, its output so reshaped, stands in:
    flash runs on a GPU only.)"""
    def flat(*args, **kwargs):
        output, weights = sdpa_attention_paged_forward(*args, **kwargs)
        return output[0], weights

    ALL_ATTENTION_FUNCTIONS["paged|sdpa"] = flat
    try:
        model, _ = build("llama")
        serving = serve(manager(model, NEW))
        try:
            outputs = [views.output for held in serving.capture.graphs.values() if held.pieces is not None
                       for _, views in held.pieces.calls]
            assert outputs and all(out.dim() == 3 for out in outputs)
        finally:
            serving.close()
        alone = run(model, MIXED, NEW).tokens
        result = run(model, MIXED, NEW, "fg")
        summary = result.serving.coverage.as_dict()
        assert result.tokens == alone and summary["graph_steps"] == result.steps, result.serving.report()
    finally:
        del ALL_ATTENTION_FUNCTIONS["paged|sdpa"]


def test_a_failed_serve_gives_the_registry_back(monkeypatch):
    from graphflow.integrations.hf.batching.capture import KeyCapture

    def broken(self, progress=None, keys=None):
        raise RuntimeError("injected")

    monkeypatch.setattr(KeyCapture, "capture_all", broken)
    model, _ = build("llama")
    with pytest.raises(RuntimeError, match="injected"):
        serve(manager(model, NEW))
    assert _entry() == ("absent", sdpa_attention_paged_forward)


# -- FULL keys in the background -------------------------------------------------------------


def test_foreground_captures_the_full_keys_in_the_background():
    """``serve(manager)`` returns once the PIECEWISE keys (which cover every batch) are
    captured; the FULL keys are captured beside serving by the lazy-capture thread, each
    checked on its first batch, and the decode-only steps move to them as they go live.
    Tokens: the engine's."""
    lines: list[str] = []
    model, _ = build("llama")
    mgr = manager(model, NEW)
    serving = serve(mgr, progress=lines.append)
    try:
        plan = serving.plan
        piecewise = [k for k in plan.keys if k.mode is Mode.PIECEWISE]
        full = [k for k in plan.keys if k.mode is Mode.FULL]
        assert len(lines) == len(piecewise) and all(str(k) in line for k, line in zip(piecewise, lines))
        states_at_start = {k: serving.coverage.state(k) for k in plan.keys}
        assert states_at_start[piecewise[0]] == "live"  # the sample, verified before serving
        assert all(states_at_start[k] == "captured" for k in piecewise[1:])  # checked on their first batch
        assert all(states_at_start[k] == "planned" for k in full)  # the thread waits for the first step
        assert serving.capturing and not serving.lazy
    finally:
        serving.close()
    assert not serving.capturing
    result = run(model, MIXED, NEW, "fg", settle=True)
    assert result.tokens == _engine_alone("llama", "paged|sdpa")
    summary = result.serving.coverage.as_dict()
    assert summary["eager_steps"] == 0 and summary["graph_steps"] == result.steps
    served = {k.mode for keys in result.keys for k in keys if summary["keys"].get(str(k), {}).get("graph_steps")}
    assert served == {Mode.PIECEWISE, Mode.FULL}, result.serving.report()
    assert "lazy capture:" in result.serving.report()


def test_lazy_captures_every_key_beside_serving_already():
    from graphflow.errors import PlanError

    model, _ = build("llama")
    with pytest.raises(PlanError, match="full_in_background") as raised:
        serve(manager(model, NEW), lazy=True, full_in_background=False)
    assert raised.value.element == "full_in_background"
    assert _entry() == ("absent", sdpa_attention_paged_forward)
    serve(manager(model, NEW), lazy=True).close()  # the default asks for nothing lazy does not do
