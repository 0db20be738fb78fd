"""graphflow serving transformers' continuous-batching engine (``serve``,
``graphflow.integrations.hf.batching``) on the CPU backend.

The CPU backend records no graph (a "graph" replays its calls eagerly), so these prove the
wiring, the keys, the coverage counts, the fallbacks, the rollback and that the tokens are
the engine's; nothing about CUDA itself.

* keys: every padded key a batch of the engine can have (from the engine's own
  ``pad_to_interval``/``pad_to_pow2`` applied to random batches, and from real batches the
  engine's ``prepare_batch_tensors`` builds) is in ``serving_keys``: each batch's
  PIECEWISE key, and a decode-only batch's FULL key;
* tokens: greedy tokens through the manager with graphflow (foreground and lazy) are the
  engine's own and Hugging Face's ``generate``, prompt by prompt, for Llama and for the
  sliding-window and hybrid models the engine runs (Mistral, Qwen2, Gemma-2, Gemma-3);
* coverage: every step counted once, with why it was eager;
* failures: a key that fails its capture or its verification is rolled back alone and
  served eagerly, with the same tokens; ``close`` gives the engine back as it was; async
  batching is refused.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import logging
import math
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.utils import (
    pad_to_interval,
    pad_to_pow2,
)

from graphflow.engine.backend import CpuBackend, PoolProbe
from graphflow.engine.first_use import Checks
from graphflow.engine.lazy import LazyCapture
from graphflow.errors import PlanError
from graphflow.integrations.hf.batching import Fallback, ServingKey, serve, serving_keys
from graphflow.integrations.hf.batching.keys import VARLEN, batch_keys, decode_only
from graphflow.integrations.hf.batching import serving as serving_module
from graphflow.integrations.hf.batching.serving import LAZY_TRIES
from graphflow.plan import Mode
from tests.serving_models import (  # noqa: F401 - quick_gc: a module fixture
    EVERY_KEY_VERIFIED,
    WINDOW,
    cb_config,
    build,
    fill_cache,
    hf_generate,
    manager,
    prompts,
    quick_gc,
    run,
    shared,
)

NEW = 6
PROMPTS = prompts()  # 5, 11, 19, 3 and 14 tokens: most longer than the window (8)
assert sum(map(len, PROMPTS)) > 32  # more than one batch holds: the first prefill is chunked



# -- keys ----------------------------------------------------------------------------------

#: Models whose caches differ in kind: full attention only, sliding only, both.
KINDS = ("llama", "mistral", "qwen2")


@st.composite
def engine_settings(draw):
    # Half the caches above 1024 pages (to 2560): only there does the padding of the longest
    # sequences (a power of two, at least 1024, at most the pages) have a choice.
    block_size, num_blocks = draw(st.one_of(st.tuples(st.sampled_from([8, 16, 32, 64]), st.integers(2, 16)),
                                            st.tuples(st.just(64), st.integers(17, 40))))
    pages = block_size * num_blocks
    max_batch_tokens = draw(st.integers(1, 48))
    requests = draw(st.integers(1, min(6, max_batch_tokens)))
    q_interval = draw(st.one_of(st.just(0), st.integers(max(1, max_batch_tokens // 8), max_batch_tokens + 8)))
    kv_interval = draw(st.one_of(st.just(0), st.integers(max(1, pages // 12), pages + 40)))
    # Without block sharing the plan leaves out a full-attention batch's query and past beyond the pages.
    sharing = draw(st.booleans())
    return dict(block_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                max_requests_per_batch=requests, q_padding_interval_size=q_interval,
                kv_padding_interval_size=kv_interval, allow_block_sharing=sharing)


def _batch(processor, wanted, longest=None, decoding=False):
    """Requests as the scheduler admits them, each with its query tokens and its past:
    ``wanted`` gives each request's query tokens and its past as a share of the room
    left (``decoding``: one query token each, and a past of one token at least). Within
    the token, request, KV-read, cache (and ``longest``) budgets; a request that does not
    fit is left out, as the scheduler leaves it waiting. Their blocks are allocated in the
    cache; the caller frees them. Returns [(FutureRequestState, query, past)]."""
    from transformers.generation.continuous_batching.requests import (
        FutureRequestState,
        RequestState,
        RequestStatus,
    )

    cache = processor.cache
    token_budget, kv_budget = cache.max_batch_tokens, cache.num_pages
    sliding_only = not cache.num_full_attention_groups
    groups = cache.num_full_attention_groups + cache.num_sliding_attention_groups  # they share the blocks
    chosen = []
    for index, (query, share) in enumerate(wanted[: processor.model_runner.cb_config.max_requests_per_batch]):
        query = 1 if decoding else query
        if sliding_only:
            # Its layers keep a ring of one window's blocks whatever its length
            # (``SlidingAttentionCacheAllocator``): the cache bounds neither its query nor its
            # past, only whether it gets its first block. A past beyond the window reads the same.
            query = min(query, token_budget, longest or query)
            past = int(share * min((longest or query + WINDOW) - query, WINDOW))
        else:  # its blocks hold its past and its query
            room = cache.get_num_free_blocks() * cache.block_size // groups
            query = min(query, token_budget, room, longest or room)
            past = int(share * (min(room, longest or room) - query))
        past = max(past, 1) if decoding else past
        read = min(past, WINDOW) if sliding_only else past  # the scheduler's read_cache_needed
        if query <= 0 or read > kv_budget or (longest is not None and past + query > longest):
            continue
        state = RequestState(request_id=f"r{index}", initial_tokens=[1] * (past + query), max_new_tokens=1)
        state._status = RequestStatus.PREFILLING
        state.tokens_to_process = [1] * query
        state.position_offset = past
        if cache.allocate_blocks(math.ceil((past + query) / cache.block_size), state.request_id, 0) is None:
            continue
        chosen.append((FutureRequestState(state, has_new_token=True, complete_blocks=0, query_length=query),
                       query, past))
        token_budget -= query
        kv_budget -= read
        if kv_budget <= 0:  # the scheduler stops a varlen batch whose KV budget is spent
            break
    return chosen


def _independent_key(processor, batch) -> ServingKey:
    """The FULL key of ``batch`` from the engine's own padding functions, computed here."""
    cache, config = processor.cache, processor.model_runner.cb_config
    sliding_only = not cache.num_full_attention_groups
    query = sum(q for _, q, _ in batch)
    read = sum(min(p, WINDOW) if sliding_only else p for _, _, p in batch)
    seqlens = []
    if cache.num_full_attention_groups:
        seqlens.append(max(q + p for _, q, p in batch))
    if cache.num_sliding_attention_groups:
        seqlens.append(max(q + min(p, WINDOW - 1) for _, q, p in batch))
    return ServingKey(VARLEN, pad_to_interval(query, config.q_padding_interval_size, cache.max_batch_tokens),
                      pad_to_interval(read, config.kv_padding_interval_size, cache.num_pages),
                      tuple(pad_to_pow2(n, cache.num_pages, 1024) for n in seqlens))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(KINDS), engine=engine_settings(),
       batches=st.lists(st.lists(st.tuples(st.integers(1, 48), st.floats(0, 1)), min_size=1, max_size=6),
                        min_size=1, max_size=4),
       fractions=st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=12),
       longest=st.one_of(st.none(), st.integers(1, 3000)), decoding=st.booleans())
# A sliding-only cache holds one block per request here: 17 query tokens in 16 pages.
@example(kind="mistral", engine={"block_size": 8, "num_blocks": 2, "max_batch_tokens": 17, "max_requests_per_batch": 2,
                                 "q_padding_interval_size": 2, "kv_padding_interval_size": 0,
                                 "allow_block_sharing": False},
         batches=[[(9, 0.0), (8, 0.0)]], fractions=[(0.0, 0.0)], longest=None, decoding=False)
def test_every_key_a_batch_can_have_is_planned(kind, engine, batches, fractions, longest, decoding):
    """Every batch's PIECEWISE key is planned, and a decode-only batch's FULL key too.
    ``longest``: the most tokens a request holds on the server (``serve(longest=...)``),
    when known; the requests then hold no more."""
    model, _ = shared(kind)
    processor = manager(model, 1, **engine)._create_batch_processor()
    cache, io = processor.cache, processor.inputs_and_outputs
    keys = serving_keys(processor, longest=longest)
    assert keys and len(set(keys)) == len(keys)
    piecewise = [k for k in keys if k.mode is Mode.PIECEWISE]
    full = [k for k in keys if k.mode is Mode.FULL]
    assert list(keys) == sorted(piecewise, reverse=True) + sorted(full, reverse=True)  # coverage first, largest first
    assert all(k.path == VARLEN and k.kv == 0 and not k.seqlens for k in piecewise)
    planned = set(keys)

    # Sizes alone: any query count, KV read and longest sequence the budgets allow.
    for fq, fk in fractions:
        if cache.num_full_attention_groups:
            room = min(cache.num_pages, longest or cache.num_pages)  # its blocks hold its past and its query
            query = max(1, round(fq * min(cache.max_batch_tokens, room)))
            past = round(fk * (room - query))
        else:  # sliding layers keep a window of it, whatever its length (see ``_batch``)
            query = max(1, round(fq * min(cache.max_batch_tokens, longest or cache.max_batch_tokens)))
            past = round(fk * min((longest or query + WINDOW) - query, WINDOW))
        batch = [(None, query, past)]  # one request: the longest sequence is the whole batch
        assert ServingKey.piecewise(_independent_key(processor, batch).q) in planned, (query, past)
        if past >= 1 and (longest is None or past + 1 <= longest):  # the request one step on, decoding
            assert _independent_key(processor, [(None, 1, past)]) in planned, ("decoding", past)

    # Real batches: the engine builds them, pads them as graphflow serves them
    # (``use_cuda_graph_varlen``: the longest sequences padded), and keys them itself.
    io.use_cuda_graph_varlen = True
    for wanted in batches:
        batch = _batch(processor, wanted, longest, decoding)
        try:
            if not batch:
                continue
            expected = _independent_key(processor, batch)
            io.prepare_batch_tensors([f for f, _, _ in batch], processor.logit_processor, False, expected.q,
                                     expected.kv, use_padding=True)
            io.get_model_kwargs(use_padding=True)
            got = batch_keys(io)
            assert got[-1] == ServingKey.piecewise(expected.q) and got[-1] in planned, [(q, p) for _, q, p in batch]
            assert decode_only(io) == all(q == 1 for _, q, _ in batch)
            if decode_only(io):
                assert got[0].engine_key == io._get_graph_key()
                assert got[0] == expected
                assert got[0] in planned, [(q, p) for _, q, p in batch]
                if any(n < cache.num_pages for n in got[0].seqlens):
                    event("a decode-only batch's longest sequence padded below the pages")
            event(f"{kind}: a real {'decode-only' if decode_only(io) else 'varlen'} batch of "
                  f"{min(len(batch), 3)}{'+' if len(batch) > 3 else ''} request(s)")
        finally:
            for future, _, _ in batch:
                cache.free_blocks(future.state.request_id)


class KeyMissing(AssertionError):
    """The planned-key check itself failed (not the set-up before it)."""


def test_a_batch_reading_shared_prefix_blocks_has_a_planned_key():
    """Request A (24 tokens, 3 full blocks) decodes while B (A's 24 tokens and 8 more)
    joins: B finds A's blocks by prefix sharing, so the batch has 9 query tokens and reads
    48 KV tokens, 57 > 48 pages. Its key, varlen(q=16, kv=48), was missing from the plan
    when every batch had a FULL key: that step ran eagerly as "key never captured". Its
    PIECEWISE key is planned."""
    model, _ = shared("llama")
    mgr = manager(model, 4, block_size=8, num_blocks=6, max_batch_tokens=32, max_requests_per_batch=4,
                  q_padding_interval_size=8, kv_padding_interval_size=8)
    serving = serve(mgr, keys=[])  # the plan is read in full; nothing captured: quick
    processor = mgr.batch_processor
    assert processor.cache.use_prefix_sharing
    full_plan = set(serving_keys(processor))
    try:
        mgr.current_batch = 0
        shared_prompt = list(range(10, 34))
        mgr.add_request(shared_prompt, request_id="A", max_new_tokens=4)
        mgr._generation_loop_body(processor, bootstrapping=False)  # A's prefill: its blocks become shareable
        mgr.add_request(shared_prompt + list(range(40, 48)), request_id="B", max_new_tokens=1)
        mgr._generation_loop_body(processor, bootstrapping=False)  # A decodes, B prefills beside it
        io = processor.inputs_and_outputs
        assert sorted(f.state.request_id for f in io.requests_in_batch) == ["A", "B"]
        assert (io.total_seqlen_q, io.max_kv_read) == (9, 48)
        if batch_keys(io)[-1] not in full_plan:
            raise KeyMissing(f"{batch_keys(io)[-1]} is not in the plan")
    finally:
        serving.close()


def test_a_batch_with_forked_requests_on_a_hybrid_model_has_a_planned_key():
    """``num_return_sequences`` forks a request after its prefill: the children share the
    parent's complete blocks (``allow_block_sharing``) even on a model whose sliding layers
    turn prefix sharing off. A parent of 41 tokens decoding with its 2 children beside a
    new 30-token prompt batched 32 query tokens reading 120 KV tokens of 128 pages, more
    than a batch of unshared blocks can; the plan missed its key when every batch had a
    FULL key. Its PIECEWISE key is planned."""
    from transformers import GenerationConfig

    model, _ = shared("qwen2")
    generation = GenerationConfig(max_new_tokens=2, do_sample=True, num_return_sequences=3, eos_token_id=None,
                                  pad_token_id=0)
    mgr = model.init_continuous_batching(generation_config=generation, continuous_batching_config=cb_config(
        block_size=8, num_blocks=16, max_batch_tokens=64, max_requests_per_batch=6, q_padding_interval_size=8,
        kv_padding_interval_size=8))
    serving = serve(mgr, keys=[])  # the plan is read in full; nothing captured: quick
    processor = mgr.batch_processor
    assert not processor.cache.use_prefix_sharing and processor.cache.allow_block_sharing
    full_plan = set(serving_keys(processor))
    try:
        mgr.current_batch = 0
        mgr.add_request(list(range(3, 44)), request_id="A")
        mgr._generation_loop_body(processor, bootstrapping=False)  # A's prefill, then its forks
        mgr.add_request(list(range(50, 80)), request_id="C")
        mgr._generation_loop_body(processor, bootstrapping=False)  # A and its children decode beside C
        io = processor.inputs_and_outputs
        assert sorted(f.state.request_id for f in io.requests_in_batch) == ["A", "A__child#0", "A__child#1", "C"]
        assert (io.total_seqlen_q, io.max_kv_read) == (32, 120)
        if batch_keys(io)[-1] not in full_plan:
            raise KeyMissing(f"{batch_keys(io)[-1]} is not in the plan")
    finally:
        serving.close()


# -- tokens --------------------------------------------------------------------------------


@functools.cache
def _engine_alone(name: str):
    return run(shared(name)[0], PROMPTS, NEW)


@functools.cache
def _reference(name: str):
    return hf_generate(shared(name)[1], PROMPTS, NEW)


def _check_tokens(name: str):
    model, _ = shared(name)
    want = _reference(name)
    assert all(len(t) == NEW for t in want) and len({tuple(t) for t in want}) == len(want)
    assert _engine_alone(name).tokens == want, "the engine itself differs from generate"
    foreground = run(model, PROMPTS, NEW, "fg")
    lazy = run(model, PROMPTS, NEW, "lazy")
    assert foreground.tokens == want
    assert lazy.tokens == want
    summary = foreground.serving.coverage.as_dict()
    assert summary["graph_steps"] == foreground.steps > 0
    assert lazy.serving.coverage.as_dict()["steps"] == lazy.steps


def test_tokens_are_the_engines_and_generates_llama():
    _check_tokens("llama")


@pytest.mark.parametrize("name", [
    "mistral",
    "qwen2",
    pytest.param("gemma2", marks=pytest.mark.slow),
    pytest.param("gemma3", marks=pytest.mark.slow),
])
def test_tokens_are_the_engines_and_generates_sliding(name):
    """The engine runs all four (sliding-only Mistral; Qwen2, Gemma-2 and Gemma-3 hybrid,
    full and sliding layers): graphflow serves them with the same tokens."""
    model, _ = shared(name)
    assert max(map(len, PROMPTS)) > WINDOW
    layer_types = serve_plan_layer_types(model)
    assert "sliding_attention" in layer_types
    _check_tokens(name)


def serve_plan_layer_types(model) -> list[str]:
    mgr = manager(model, 1)
    serving = serve(mgr, keys=[])
    try:
        return serving.plan.settings["layer_types"]
    finally:
        serving.close()


def test_the_window_matters_for_these_prompts():
    """Without its window Mistral gives other tokens: the sliding tests test a window."""
    _, reference = build("mistral")
    reference.config.sliding_window = None
    assert hf_generate(reference, PROMPTS, NEW) != _reference("mistral")


# -- coverage ------------------------------------------------------------------------------


@functools.cache
def _foreground_run():
    """Llama in foreground, every key captured and verified before serving, the requests
    queued before the start: the same batches (and keys) every run, so the failure tests
    below can aim at a key this workload uses."""
    return run(shared("llama")[0], PROMPTS, NEW, "fg", queue_first=True, serve_kwargs=EVERY_KEY_VERIFIED)


def _served(result) -> list[ServingKey]:
    """The key each step of ``result`` replays when every planned key is live: its batch's
    first key in the plan (a decode-only batch's FULL key, else its PIECEWISE key)."""
    planned = set(result.serving.plan.keys)
    return [next(k for k in keys if k in planned) for keys in result.keys]


def test_foreground_coverage_counts_every_step(caplog):
    result = _foreground_run()
    coverage = result.serving.coverage
    summary = coverage.as_dict()
    assert result.tokens == _reference("llama")
    assert summary["steps"] == result.steps == len(result.keys) > 1
    assert summary["graph_steps"] + summary["eager_steps"] == result.steps
    assert summary["graph_steps"] == result.steps and summary["eager_steps"] == 0
    assert summary["fallback_rate"] == 0.0
    for entry in summary["keys"].values():
        assert str(Fallback.NO_GRAPH_YET) not in entry["eager_steps"]
    steps_per_key = collections.Counter(_served(result))
    assert {k.mode for k in steps_per_key} == {Mode.PIECEWISE, Mode.FULL}  # prefills, and decode-only steps
    for key, n in steps_per_key.items():
        assert summary["keys"][str(key)]["graph_steps"] == n
        assert summary["keys"][str(key)]["state"] == "live"
    tokens_per_key = {str(k): v["tokens"] for k, v in summary["keys"].items() if v["graph_steps"]}
    assert sum(tokens_per_key.values()) == sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW - 1)
    assert summary["captured"] == len(result.serving.plan.keys)
    unused = {str(k) for k in result.serving.plan.keys} - {str(k) for k in steps_per_key}
    assert set(summary["unused"]) == unused and unused
    warnings = coverage.warnings()
    assert len(warnings) == 1 and f"{len(unused)} captured graph(s) never served a step" in warnings[0]
    report = result.serving.report()
    assert coverage.table() in report and f"warning: {warnings[0]}" in report
    assert f"{result.steps} of {result.steps} steps on graphs" in report
    assert result.serving.checks.before_ready == len(result.serving.plan.keys)
    assert f"checks against the engine's eager step: {len(result.serving.plan.keys)} keys before serving" in report


def test_default_foreground_verifies_a_sample_and_checks_the_rest_on_their_first_batch():
    """``serve(manager)``: the PIECEWISE keys before serving, the largest verified then
    against the engine's eager step, the others captured unchecked; the FULL keys on the
    capture thread. Every other key's first batch checks it (an eager step served, the
    replay compared): every step on a graph, each key that served one live, the keys no
    step used still waiting for their check, and the counts say so."""
    model, _ = shared("llama")
    result = run(model, PROMPTS, NEW, "fg", queue_first=True, settle=True)
    assert result.tokens == _reference("llama")
    serving = result.serving
    summary = serving.coverage.as_dict()
    assert summary["graph_steps"] == result.steps and summary["eager_steps"] == 0
    largest = serving.plan.keys[0]
    assert largest.mode is Mode.PIECEWISE and summary["keys"][str(largest)]["state"] == "live"
    used = {k for keys in result.keys for k in keys if summary["keys"][str(k)]["graph_steps"]}
    assert {k.mode for k in used} == {Mode.PIECEWISE, Mode.FULL}
    assert all(summary["keys"][str(k)]["state"] == "live" for k in used)
    waiting = [k for k in serving.plan.keys if summary["keys"][str(k)]["state"] == "captured"]
    assert waiting and not set(waiting) & used
    assert serving.checks == Checks(before_ready=1, on_first_use=len(used - {largest}), waiting=len(waiting), failed=0)
    assert summary["checks"] == {"before_ready": 1, "on_first_use": len(used - {largest}),
                                 "waiting": len(waiting), "failed": 0}
    assert (f"checks against the engine's eager step: 1 keys before serving, {len(used - {largest})} on their first "
            f"batch; {len(waiting)} captured keys not checked yet") in serving.report()


@pytest.mark.parametrize("verify, before_ready", [("all", "piecewise"), ("sample", 1), (False, 0)])
def test_verify_says_which_keys_are_verified_before_serving(verify, before_ready):
    model, _ = shared("llama")
    serving = serve(manager(model, NEW), verify=verify)
    try:
        piecewise = [k for k in serving.plan.keys if k.mode is Mode.PIECEWISE]
        expected = len(piecewise) if before_ready == "piecewise" else before_ready
        assert serving.checks.before_ready == expected
        states = [serving.coverage.state(k) for k in piecewise]
        if verify is False:
            assert set(states) == {"live"}  # unchecked, then or later
            assert "checks against" not in serving.report()
        else:
            assert states[:expected] == ["live"] * expected and set(states[expected:]) <= {"captured"}
    finally:
        serving.close()


def test_an_unknown_verify_is_refused_naming_the_choices():
    with pytest.raises(PlanError, match="'sample', 'all', 'off'") as raised:
        serve(manager(shared("llama")[0], NEW), verify="most")
    assert raised.value.element == "verify"


def test_lazy_coverage_first_steps_have_no_graph_yet():
    model, _ = shared("llama")
    result = run(model, PROMPTS, NEW, "lazy", queue_first=True, settle=True)
    assert result.tokens == _reference("llama")
    summary = result.serving.coverage.as_dict()
    assert summary["steps"] == result.steps
    assert summary["graph_steps"] + summary["eager_steps"] == result.steps
    assert summary["graph_steps"] > 0
    # The first step ran before any capture: eagerly, "no graph yet", counted on the key
    # that covers its batch (its PIECEWISE key). A key's later steps ran on a graph (each
    # step waited for its keys' captures): a decode-only step on its FULL key once that
    # was live, else on its PIECEWISE key; only a PIECEWISE key serves a step eagerly, and
    # a key the thread captured (from the rest of the plan) before a step asked for it
    # has no eager step at all.
    first = summary["keys"][str(result.keys[0][-1])]
    assert first["eager_steps"] == {str(Fallback.NO_GRAPH_YET): 1}
    by_key = {str(k): k for keys in result.keys for k in keys}
    for name, entry in summary["keys"].items():
        eager = entry["eager_steps"].get(str(Fallback.NO_GRAPH_YET), 0)
        assert set(entry["eager_steps"]) <= {str(Fallback.NO_GRAPH_YET)} and eager <= 1, (name, entry)
        assert not eager or by_key[name].mode is Mode.PIECEWISE
        if entry["graph_steps"]:
            assert entry["state"] == "live"
    covering = {keys[-1] for keys in result.keys}
    assert 1 <= summary["eager_steps"] <= len(covering)
    served = {by_key[name].mode for name, e in summary["keys"].items() if e["graph_steps"]}
    assert served == {Mode.PIECEWISE, Mode.FULL}
    assert any("no graph yet" in w for w in result.serving.coverage.warnings())


def test_while_the_thread_records_a_decode_batch_replays_its_checked_piecewise_graph(monkeypatch):
    """A new graph's check is an eager step and a replay, host work the recordings would
    wait for: while the capture thread has a key to record, a decode-only batch whose
    FULL graph waits for its check replays its PIECEWISE key's checked graph, and no FULL
    graph is checked; the tokens stay the engine's. The thread captures only the keys
    steps ask for here (no plan is small enough to capture ahead), so it runs until
    stopped, and is held busy, so which graphs exist at each step does not depend on
    timing."""
    monkeypatch.setattr(serving_module, "AHEAD_MOST", 0)
    monkeypatch.setattr(LazyCapture, "busy", property(lambda self: not self.done))
    seen = {}

    def after_stop(serving):
        seen["summary"] = serving.coverage.as_dict()

    model, _ = shared("llama")
    result = run(model, PROMPTS, 24, "lazy", queue_first=True, after_stop=after_stop)
    assert result.tokens == run(model, PROMPTS, 24).tokens
    keys = seen["summary"]["keys"]
    decoding = {keys_[0] for keys_ in result.keys if keys_[0].mode is Mode.FULL}
    assert decoding, "the workload has decode-only batches"
    assert all(keys[str(k)]["graph_steps"] == 0 and keys[str(k)]["state"] != "live" for k in decoding), \
        "a FULL graph was checked (or replayed) while the thread recorded"
    assert any(keys[str(k)]["state"] == "captured" for k in decoding), "their FULL graphs were captured"
    assert sum(keys[str(k_[-1])]["graph_steps"] for k_ in result.keys if k_[0] in decoding) > 0


@pytest.mark.parametrize("lazy", [True, False])
def test_full_keys_asked_are_captured_once_a_step_asks_for_them_and_checked_when_the_thread_is_idle(lazy):
    """``full_keys="asked"``: a FULL key is recorded only after a decode-only batch of its
    sizes asked for it (the others stay planned: nothing spent on a speed-up the workload
    never reached), and is checked on a later batch once the thread has nothing to
    record; its tokens stay the engine's."""
    seen = {}

    def after_stop(serving):
        assert serving.wait_captured(30)
        seen["summary"] = serving.coverage.as_dict()
        seen["ready"] = serving.all_captured_s

    model, _ = shared("llama")
    result = run(model, PROMPTS, 24, "lazy" if lazy else "fg", queue_first=True, after_stop=after_stop,
                 serve_kwargs=dict(full_keys="asked"), num_blocks=64)
    assert result.tokens == run(model, PROMPTS, 24, num_blocks=64).tokens
    keys = seen["summary"]["keys"]
    asked = {keys_[0] for keys_ in result.keys if keys_[0].mode is Mode.FULL}
    planned_full = [k for k in result.serving.plan.keys if k.mode is Mode.FULL]
    never = [k for k in planned_full if k not in asked]
    assert asked and never, "the workload reaches some FULL keys and not others"
    assert all(keys[str(k)]["state"] == "planned" for k in never), "a FULL key no step asked for was captured"
    assert any(keys[str(k)]["state"] == "live" and keys[str(k)]["graph_steps"] > 0 for k in asked)
    assert seen["ready"] is not None


@pytest.mark.parametrize("name", ["mistral", "qwen2", "llama"])
@pytest.mark.parametrize("lengths", [(40, 3), (60, 5, 30)])
def test_a_lazy_graphs_check_leaves_the_cache_as_the_eager_step_does(name, lengths):
    """A new lazy graph's first step runs the engine's eager step, then the replay, on the
    same batch. A sliding-window layer reads the old KV before it writes the new, and the
    chunk of a prompt longer than the window overwrites slots it reads: run twice, the
    second run would read what the first wrote (wrong tokens later, or a good graph failed).
    Here every later key's first step is a check (all captured after the first step),
    the chunks of prompts of 40 and 60 tokens (the window is 8) included."""
    model, reference = shared(name)
    chosen = prompts(lengths)
    result = run(model, chosen, NEW, "lazy", queue_first=True, ahead=True)
    summary = result.serving.coverage.as_dict()
    assert summary["graph_steps"] > 0
    assert not [k for k, e in summary["keys"].items() if e["state"] == "failed"], result.serving.report()
    assert result.tokens == hf_generate(reference, chosen, NEW)


def test_full_keys_is_all_or_asked_and_asked_needs_a_thread():
    model, _ = shared("llama")
    with pytest.raises(PlanError, match="full_keys='some'"):
        serve(manager(model, NEW), full_keys="some")
    with pytest.raises(PlanError, match="full_keys='asked'"):
        serve(manager(model, NEW), full_keys="asked", full_in_background=False)


def test_a_key_outside_the_plan_is_served_eagerly_as_never_captured():
    """A PIECEWISE key left out: the steps it served run eagerly (the decode-only steps of
    its query size stay on their FULL keys)."""
    everything = _foreground_run()
    busiest, hits = collections.Counter(k for k in _served(everything) if k.mode is Mode.PIECEWISE).most_common(1)[0]
    assert hits > 1
    subset = [k for k in everything.serving.plan.keys if k != busiest]
    result = run(shared("llama")[0], PROMPTS, NEW, "fg", queue_first=True,
                 serve_kwargs=dict(EVERY_KEY_VERIFIED, keys=subset))
    assert result.keys == everything.keys
    assert result.tokens == everything.tokens == _reference("llama")
    coverage = result.serving.coverage
    summary = coverage.as_dict()
    entry = summary["keys"][str(busiest)]
    assert entry["state"] == "unplanned" and entry["graph_steps"] == 0
    assert entry["eager_steps"] == {str(Fallback.NOT_PLANNED): hits}
    assert summary["eager_steps"] == hits and summary["graph_steps"] == result.steps - hits
    assert busiest not in result.serving.plan.keys and len(result.serving.plan.keys) == len(subset)
    warnings = coverage.warnings()
    rate = [w for w in warnings if "ran eagerly" in w]
    assert rate and f"{hits} of {result.steps} steps ran eagerly" in rate[0]
    assert f"{hits} key never captured" in rate[0]
    assert any("never served a step" in w for w in warnings)
    report = result.serving.report()
    assert coverage.table() in report and str(busiest) in coverage.table()
    assert all(f"warning: {w}" in report for w in warnings)


# -- failures ------------------------------------------------------------------------------


class _Injected(RuntimeError):
    pass


@pytest.fixture
def capture_flags(monkeypatch):
    """``flags.capturing`` is set while graphflow's backend records a graph,
    ``flags.replaying`` while one of its graphs replays."""
    flags = threading.local()
    flags.capturing = flags.replaying = False
    state = {"capturing": 0, "replaying": 0}  # counts, across threads
    original = CpuBackend.capture

    def capture(self, *args, **kwargs):
        state["capturing"] += 1
        try:
            graph = original(self, *args, **kwargs)
        finally:
            state["capturing"] -= 1
        replay = graph.replay

        def flagged():
            state["replaying"] += 1
            try:
                replay()
            finally:
                state["replaying"] -= 1

        graph.replay = flagged
        return graph

    monkeypatch.setattr(CpuBackend, "capture", capture)
    return state


def _is_key(key: ServingKey, hidden, kwargs) -> bool:
    mask = kwargs.get("attention_mask")
    return hidden.shape[1] == key.q and mask is not None and mask.shape[-1] == key.q + key.kv


def _wrap_layer(layer, action):
    forward = layer.forward

    def wrapped(hidden_states, *args, **kwargs):
        out = forward(hidden_states, *args, **kwargs)
        return action(hidden_states, kwargs, out)

    layer.forward = wrapped


def _raise_in_capture_at(model, key, flags):
    def action(hidden, kwargs, out):
        if flags["capturing"] and _is_key(key, hidden, kwargs):
            raise _Injected(f"injected at {key}")
        return out

    _wrap_layer(model.model.layers[0], action)


def _differ_in_replay_at(model, key, flags):
    """The last layer's output negated in a replay of ``key`` only: the logits are negated,
    the greedy token becomes the least likely one."""
    def action(hidden, kwargs, out):
        if flags["replaying"] and _is_key(key, hidden, kwargs):
            return tuple(-o if i == 0 else o for i, o in enumerate(out)) if isinstance(out, tuple) else -out
        return out

    _wrap_layer(model.model.layers[-1], action)


def _middle_key(min_hits: int = 1) -> tuple[ServingKey, int]:
    """A PIECEWISE key the workload uses, not the first of the plan, and its steps: failed,
    they run eagerly (a FULL key's would run on their PIECEWISE key)."""
    everything = _foreground_run()
    keys = everything.serving.plan.keys
    hits = collections.Counter(_served(everything))
    middle = [(n, k) for k, n in hits.items() if k in keys[1:] and k.mode is Mode.PIECEWISE and n >= min_hits]
    assert middle, hits
    n, key = max(middle)
    return key, n


def test_a_key_failing_its_foreground_capture_is_rolled_back_alone(capture_flags, caplog):
    key, hits = _middle_key()
    model, _ = build("llama")
    _raise_in_capture_at(model, key, capture_flags)
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(model, PROMPTS, NEW, "fg", queue_first=True, serve_kwargs=EVERY_KEY_VERIFIED)
    assert result.tokens == _foreground_run().tokens == _engine_alone("llama").tokens
    summary = result.serving.coverage.as_dict()
    entry = summary["keys"][str(key)]
    assert entry["state"] == "failed"
    assert entry["failure"] == f"_Injected: injected at {key}"
    assert entry["eager_steps"] == {str(Fallback.FAILED): hits} and entry["graph_steps"] == 0
    others = [k for k in result.serving.plan.keys if k != key]
    assert all(summary["keys"][str(k)]["state"] == "live" for k in others)
    assert summary["captured"] == len(others)
    assert summary["graph_steps"] == result.steps - hits
    warned = [r for r in caplog.records if r.name == "graphflow.serving" and r.levelno == logging.WARNING]
    assert len(warned) == 1 and str(key) in warned[0].getMessage() and "injected" in warned[0].getMessage()
    assert f"failed: _Injected: injected at {key}" in result.serving.coverage.table()


def test_a_graph_whose_instantiation_fails_is_rolled_back_alone(monkeypatch, caplog):
    """A key left out of the sample is instantiated beside the next captures (the CUDA
    backend's worker thread); ``serve`` waits for every one, and one whose instantiation
    raised is undone and served eagerly, before any step could replay it."""
    from graphflow.integrations.hf.batching.capture import KeyCapture

    key, hits = _middle_key()
    captured = KeyCapture._captured

    def failing(self, at, call):
        held = captured(self, at, call)
        if at == key:
            def ready():
                raise RuntimeError("injected: cudaGraphInstantiate failed")

            held.graph.ready = ready
        return held

    monkeypatch.setattr(KeyCapture, "_captured", failing)
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(shared("llama")[0], PROMPTS, NEW, "fg", queue_first=True,
                     serve_kwargs={"full_in_background": False})  # the key is captured unchecked
    assert result.tokens == _engine_alone("llama").tokens
    entry = result.serving.coverage.as_dict()["keys"][str(key)]
    assert entry["state"] == "failed" and "cudaGraphInstantiate failed" in entry["failure"]
    assert entry["eager_steps"] == {str(Fallback.FAILED): hits} and entry["graph_steps"] == 0
    assert key not in result.serving.capture.graphs
    assert any(str(key) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_key_whose_replay_differs_fails_foreground_verification(capture_flags, caplog):
    """Every key verified before serving (``verify="all"``). The cache zeroed first:
    verification fills it with random values of its own (the test below holds NaN there)."""
    key, hits = _middle_key()
    model, _ = build("llama")
    _differ_in_replay_at(model, key, capture_flags)
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(model, PROMPTS, NEW, "fg", queue_first=True, before_serve=fill_cache(0.0),
                     serve_kwargs=EVERY_KEY_VERIFIED)
    assert result.tokens == _engine_alone("llama").tokens
    summary = result.serving.coverage.as_dict()
    entry = summary["keys"][str(key)]
    assert entry["state"] == "failed" and "differ from the engine's eager step" in entry["failure"]
    assert entry["eager_steps"] == {str(Fallback.FAILED): hits}
    assert all(summary["keys"][str(k)]["state"] == "live" for k in result.serving.plan.keys if k != key)
    assert any(str(key) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_foreground_key_left_out_of_the_sample_is_checked_on_its_first_batch(capture_flags, caplog):
    """``serve(manager)``: a PIECEWISE key other than the largest goes in unchecked; its
    replay differs, so its first batch (an eager step served, the replay compared) takes it
    out, and every step of it is eager from then on, with the engine's tokens."""
    key, _ = _middle_key()
    model, _ = build("llama")
    _differ_in_replay_at(model, key, capture_flags)
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(model, PROMPTS, NEW, "fg", queue_first=True, settle=True)
    assert result.tokens == _engine_alone("llama").tokens
    entry = result.serving.coverage.as_dict()["keys"][str(key)]
    assert entry["state"] == "failed" and "its replay gave tokens" in entry["failure"]
    assert set(entry["eager_steps"]) == {str(Fallback.FAILED)} and entry["graph_steps"] == 0
    checks = result.serving.checks
    assert checks.before_ready == 1 and checks.failed == 1 and checks.on_first_use > 0
    assert "1 found wrong there, served eagerly" in result.serving.report()
    assert any(str(key) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


class VerifyMissed(AssertionError):
    """The verification let a replay that differs go live."""


def test_foreground_verification_catches_a_differing_replay_whatever_the_cache_held(capture_flags):
    key, _ = _middle_key()
    model, _ = build("llama")
    nan = fill_cache(float("nan"))
    # The engine itself never reads a slot no request wrote: NaN there changes none of its tokens.
    assert run(model, PROMPTS, NEW, queue_first=True, before_serve=nan).tokens == _engine_alone("llama").tokens
    _differ_in_replay_at(model, key, capture_flags)
    result = run(model, PROMPTS, NEW, "fg", queue_first=True, before_serve=nan, serve_kwargs=EVERY_KEY_VERIFIED)
    entry = result.serving.coverage.as_dict()["keys"][str(key)]
    if entry["state"] != "failed" or result.tokens != _engine_alone("llama").tokens:
        raise VerifyMissed(f"{key} is {entry['state']} and served other tokens")


def test_the_replay_perturbation_does_change_tokens(capture_flags):
    """The perturbation of the test above is real: with verification off, the key goes live
    and its steps give other tokens."""
    key, _ = _middle_key()
    model, _ = build("llama")
    _differ_in_replay_at(model, key, capture_flags)
    result = run(model, PROMPTS, NEW, "fg", queue_first=True, serve_kwargs=dict(verify=False))
    assert result.serving.coverage.as_dict()["keys"][str(key)]["state"] == "live"
    assert result.tokens != _engine_alone("llama").tokens


def _lazy_run_failing_at_a_middle_key(perturb, capture_flags, caplog):
    """A lazy run with ``perturb(model, key, flags)`` at a key of two steps or more: its
    tokens are the engine's alone; the run, the key and its steps."""
    key, hits = _middle_key(min_hits=2)
    model, _ = build("llama")
    perturb(model, key, capture_flags)
    with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
        result = run(model, PROMPTS, NEW, "lazy", queue_first=True, settle=True)
    assert result.tokens == _engine_alone("llama").tokens
    return result, key, hits


def test_a_key_failing_its_lazy_capture_is_served_eagerly(capture_flags, caplog):
    result, key, hits = _lazy_run_failing_at_a_middle_key(_raise_in_capture_at, capture_flags, caplog)
    summary = result.serving.coverage.as_dict()
    entry = summary["keys"][str(key)]
    assert entry["state"] == "failed" and entry["failure"] == f"_Injected: injected at {key}"
    # Its capture failed, before its first step or after that step asked for it (the
    # thread also captures keys no step asked for yet): every step of it eager, each after
    # the failure as "capture failed".
    _failed_from_its_first_steps(entry, hits)
    assert summary["steps"] == result.steps
    assert all(e["state"] in ("live", "captured") for k, e in summary["keys"].items() if k != str(key))
    assert any(str(key) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_lazy_graph_whose_first_replay_differs_serves_the_eager_tokens(capture_flags, caplog):
    result, key, hits = _lazy_run_failing_at_a_middle_key(_differ_in_replay_at, capture_flags, caplog)
    entry = result.serving.coverage.as_dict()["keys"][str(key)]
    assert entry["state"] == "failed" and "its replay gave tokens" in entry["failure"]
    # Its first step: no graph yet, unless the thread captured the key before any step
    # asked; the next, checked against the eager step, which it serves; then eager.
    _failed_from_its_first_steps(entry, hits)
    assert any(str(key) in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_a_pool_left_by_failed_captures_is_released_at_once(capture_flags, monkeypatch):
    """Every lazy capture fails (each try starts a new pool): a pool no graph uses is
    released as soon as captures go to the next one, not held until close. A server
    whose captures kept failing held every failed pool: 6.6 GiB on the H200."""
    pools, released = [], []
    new_pool, release_pool = CpuBackend.new_pool, CpuBackend.release_pool

    def counted_new(self, device):
        pools.append(new_pool(self, device))
        return pools[-1]

    def counted_release(self, pool):
        released.append(pool)
        release_pool(self, pool)

    monkeypatch.setattr(CpuBackend, "new_pool", counted_new)
    monkeypatch.setattr(CpuBackend, "release_pool", counted_release)
    model, _ = build("llama")

    def fail(hidden, kwargs, out):
        if capture_flags["capturing"]:
            raise _Injected("every capture fails")
        return out

    _wrap_layer(model.model.layers[0], fail)
    before_close = {}

    def after_stop(serving):
        assert serving.wait_captured(30)
        before_close.update(pools=list(serving.capture.pools), released=list(released))

    result = run(model, PROMPTS, NEW, "lazy", queue_first=True, after_stop=after_stop)
    assert result.tokens == _engine_alone("llama").tokens
    summary = result.serving.coverage.as_dict()
    assert all(e["state"] == "failed" for k, e in summary["keys"].items() if e["state"] != "unplanned")
    assert len(pools) == len(result.serving.plan.keys) * LAZY_TRIES + 1  # one more per failure
    assert before_close["pools"] == [pools[-1]] and before_close["released"] == pools[:-1]
    assert released == pools  # the last at close


def _failed_from_its_first_steps(entry: dict, hits: int) -> None:
    """Every one of the key's ``hits`` steps ran eagerly: at most the first for want of a
    graph, the others because its graph failed."""
    no_graph = entry["eager_steps"].get(str(Fallback.NO_GRAPH_YET), 0)
    assert no_graph <= 1 and entry["graph_steps"] == 0, entry
    assert entry["eager_steps"] == {**({str(Fallback.NO_GRAPH_YET): 1} if no_graph else {}),
                                    str(Fallback.FAILED): hits - no_graph}, entry


def _engine_settings(processor):
    runner, io = processor.model_runner, processor.inputs_and_outputs
    return (runner.pad_inputs, runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode, io.use_cuda_graph_varlen)


@pytest.mark.parametrize("lazy", [False, True])
def test_close_gives_the_engine_back(lazy):
    model, _ = shared("llama")
    mgr = manager(model, NEW)
    processor = mgr.batch_processor = mgr._create_batch_processor()
    runner = processor.model_runner
    before = _engine_settings(processor)
    serving = serve(mgr, lazy=lazy)
    assert {"compute_batch"} <= set(vars(runner))
    assert {"prepare_next_batch", "update_batch"} <= set(vars(processor))
    assert _engine_settings(processor) == (True, False, False, True)
    serving.close()  # lazy: while the thread may still be capturing
    assert "compute_batch" not in vars(runner)
    assert not {"prepare_next_batch", "update_batch"} & set(vars(processor))
    assert runner.compute_batch.__func__ is ModelRunner.compute_batch
    assert type(processor).prepare_next_batch is processor.prepare_next_batch.__func__
    assert type(processor).update_batch is processor.update_batch.__func__
    assert _engine_settings(processor) == before
    assert not serving.capturing
    # The engine serves alone again, with its own tokens.
    mgr.start()
    mgr.add_requests(PROMPTS, max_new_tokens=NEW)
    results = {}
    for _ in PROMPTS:
        result = mgr.get_result(timeout=60)
        results[result.request_id] = result.generated_tokens
    mgr.stop(block=True, timeout=60)
    assert [results[f"req_{i}"] for i in range(len(PROMPTS))] == _reference("llama")


def test_the_pool_forecast_is_a_warm_probed_run_of_each_modes_largest_key(monkeypatch):
    """Foreground capture forecasts the whole plan's pool before capturing anything: the
    first (largest) key of each mode, in capture order, once more after its warm run,
    into one pool probe; the bytes that probe reports are the forecast. A PIECEWISE key's
    attention runs outside the probe's pool (as outside its graphs), a FULL key's inside
    (as in its graph: the FULL keys' attention was most of a pool the PIECEWISE key alone
    forecast at a tenth on the H200). The FULL keys are captured beside serving, and are in
    the forecast all the same. (The CPU backend probes nothing: a stand-in probe here.)"""
    model, _ = shared("llama")
    events: list = []
    probe_state = {"inside": False}

    @contextlib.contextmanager
    def route():
        probe_state["inside"] = True
        yield
        probe_state["inside"] = False

    @contextlib.contextmanager
    def outside():
        assert probe_state["inside"], "outside() is only left from inside route()"
        probe_state["inside"] = False
        events.append("outside")
        yield
        probe_state["inside"] = True

    @contextlib.contextmanager
    def pool_probe(self, device):
        events.append("probe")
        probe = PoolProbe(route=route, outside=outside)
        yield probe
        probe.bytes = 4321
        events.append("probed all")

    def action(hidden, kwargs, out):
        events.append(("probed" if probe_state["inside"] else "run", hidden.shape[1]))
        return out

    monkeypatch.setattr(CpuBackend, "probes_pools", lambda self, device: True)
    monkeypatch.setattr(CpuBackend, "pool_probe", pool_probe)
    fresh = copy.deepcopy(model)
    _wrap_layer(fresh.model.layers[0], action)
    serving = serve(manager(fresh, NEW))
    try:
        plan = serving.plan.keys
        piecewise, full = plan[0], next(k for k in plan if k.mode is Mode.FULL)
        assert piecewise.mode is Mode.PIECEWISE and piecewise.q == max(k.q for k in plan)
        assert events.count("probe") == 1
        at = events.index("probe")
        layers = fresh.config.num_hidden_layers
        assert events[at:events.index("probed all") + 1] == [
            # layer 0's attention, then its output; the other layers' attention after it
            "probe", ("run", piecewise.q), "outside", ("probed", piecewise.q), *["outside"] * (layers - 1),
            ("run", full.q), ("probed", full.q), "probed all"], events
        assert sum(1 for e in events if e[0] == "probed") == 2
        assert serving.memory["estimated_pool_bytes"] == 4321
        assert "estimated 0.0 MiB before capture" in serving.report()
    finally:
        serving.close()


def test_a_foreground_capture_leaves_the_read_trash_block_zero():
    """Foreground capture fills the cache with random values before its verification
    batches (so that an eager step and a wrong replay cannot agree by reading zeros or
    NaN), but not the read-trash block: the engine zeroes it once, and every padded KV
    read of every later step reads it."""
    model, _ = shared("llama")
    mgr = manager(model, NEW)
    processor = mgr.batch_processor = mgr._create_batch_processor()
    cache = processor.cache
    trash = slice(cache.read_trash_index, cache.read_trash_index + cache.block_size)
    serving = serve(mgr)
    try:
        layers = (*cache.key_cache, *cache.value_cache)
        assert all(not t[trash].any() for t in layers)
        assert all(t[: cache.num_pages].abs().sum() > 0 for t in layers)  # the rest was filled
    finally:
        serving.close()
        model.destroy_cached_continuous_batching_manager()


def test_a_backend_that_cannot_probe_forecasts_nothing():
    serving = serve(manager(shared("llama")[0], NEW))
    try:
        assert serving.coverage.state(serving.plan.keys[0]) == "live"
        assert "estimated_pool_bytes" not in serving.memory
        assert "estimated" not in serving.report()
    finally:
        serving.close()


def test_async_batching_is_refused():
    from transformers.generation.continuous_batching.input_outputs import (
        ContinuousBatchingAsyncIOs,
    )

    model, _ = shared("llama")
    # The engine builds async batching only on CUDA:
    with pytest.raises(RuntimeError, match="requires CUDA"):
        manager(model, NEW, use_async_batching=True)._create_batch_processor()
    # so its IOs stand in, unbuilt, on a real processor.
    mgr = manager(model, NEW)
    processor = mgr.batch_processor = mgr._create_batch_processor()
    real_io = processor.inputs_and_outputs
    before = _engine_settings(processor)
    processor.inputs_and_outputs = ContinuousBatchingAsyncIOs.__new__(ContinuousBatchingAsyncIOs)
    try:
        with pytest.raises(PlanError, match="use_async_batching") as raised:
            serve(mgr)
        assert raised.value.element == "use_async_batching"
        assert "compute_batch" not in vars(processor.model_runner)
        assert not {"prepare_next_batch", "update_batch"} & set(vars(processor))
    finally:
        processor.inputs_and_outputs = real_io
    assert _engine_settings(processor) == before


def test_graphflow_show_serving_prints_the_plan_of_the_example(capsys):
    """`graphflow show --serving` on the example's manager: its keys and the engine tensors
    they adopt, before any capture; a factory that is no manager is one line, exit 2."""
    from graphflow.cli import main

    assert main(["show", "--serving", "examples.hf_serving.serving:manager", "--longest", "124"]) == 0
    out = capsys.readouterr().out
    assert "serving plan llama-serving: 6 graphs (4 PIECEWISE, 2 FULL)" in out
    assert "  PIECEWISE  piecewise(q=128)  " in out and "  FULL       varlen(q=32, kv=2048, seqlen_k=1024)  " in out
    assert "<- cache.key_cache[0]" in out and "static attention buffers of the PIECEWISE keys 0.4 MiB" in out
    assert main(["show", "--serving", "examples.hf_serving.serving:model"]) == 2
    err = capsys.readouterr().err
    assert "not a ContinuousBatchingManager" in err and "Traceback" not in err


def test_bad_serving_input_is_one_line_and_exit_2(capsys):
    """A factory reference without its colon and a longest request under one token."""
    from graphflow.cli import main

    assert main(["show", "--serving", "examples_hf_serving"]) == 2
    assert main(["show", "--serving", "examples.hf_serving.serving:manager", "--longest", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["graphflow: --serving examples_hf_serving: model 'examples_hf_serving' must be "
                   "'package.module:factory'",
                   "graphflow: --longest 0: the most tokens one request holds, at least 1"]


def test_serve_refuses_a_longest_request_under_one_token():
    model, _ = shared("llama")
    mgr = manager(model, 4, block_size=8, num_blocks=6, max_batch_tokens=32, max_requests_per_batch=4,
                  q_padding_interval_size=8, kv_padding_interval_size=8)
    with pytest.raises(PlanError) as caught:
        serve(mgr, longest=0)
    assert caught.value.element == "longest"
    assert "compute_batch" not in vars(mgr.batch_processor.model_runner)  # nothing attached


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_a_warm_run_on_the_scratch_ios_writes_nothing_the_engine_uses(name):
    """Lazy capture warms each key on this thread before capturing it, beside the engine's
    steps: on IO tensors of its own, whose indices reach only the cache's write-only trash
    block. The live IOs and every other cache slot are as they were."""
    from graphflow.integrations.hf.batching.plan import batch_processor
    from graphflow.integrations.hf.batching.capture import _scratch_io

    model = shared(name)[0]
    mgr = manager(model, NEW)
    processor = batch_processor(mgr)
    serving = serve(mgr, lazy=True, backend="cpu")
    try:
        io, cache = processor.inputs_and_outputs, processor.cache
        live = [io._bulk_input_tensor, io.output_ids, io.write_index_storage, io.read_index_storage,
                *(io.attention_mask or {}).values()]
        layers = [*cache.key_cache, *cache.value_cache]
        for tensor in layers:
            tensor.normal_()
        before_live, before_cache = [t.clone() for t in live], [t.clone() for t in layers]
        scratch = _scratch_io(processor)
        trash = slice(cache.write_trash_index, cache.write_trash_index + cache.block_size)
        keys = [k for k in serving.plan.keys if k.path == VARLEN]
        for key in keys:
            serving.capture._call(key, scratch)()
            assert all(torch.equal(a, b) for a, b in zip(live, before_live)), key
            for after, before in zip(layers, before_cache):
                assert torch.equal(after[: trash.start], before[: trash.start]), key
                assert torch.equal(after[trash.stop:], before[trash.stop:]), key
        assert any(not torch.equal(a[trash], b[trash]) for a, b in zip(layers, before_cache))  # it did run
        serving.capture._call(key)()  # the same call on the live IOs does write them: the check can fail
        assert not all(torch.equal(a, b) for a, b in zip(live, before_live))
    finally:
        serving.close()
        model.destroy_cached_continuous_batching_manager()
