"""graphflow under transformers' continuous batching on the GPU: real graphs in place of the
engine's own, tokens identical to the engine's eager steps in both modes, a failed key
rolled back with memory back where it was, and the lazy path serving while it captures.
PIECEWISE keys (the step in pieces, the attention eager between them on the current
batch's arguments) serve the prefills and mixed steps, FULL keys the decode-only ones.

The reference is the engine itself without graphs (its own eager ``compute_batch``),
independent of graphflow. (The engine's own graphs are compared in bench/serve_bench.py,
in a process of its own: dropping a processor whose graphs the engine captured can abort
the process in a long test session, when its memory pool is freed before its graphs.)
"""

from __future__ import annotations

import collections
import json
import logging
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

transformers = pytest.importorskip("transformers")

from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

from graphflow.integrations.hf.batching import Fallback, serve, serving_plan  # noqa: E402
from graphflow.integrations.hf.batching.keys import batch_keys  # noqa: E402
from graphflow.integrations.hf.batching.plan import batch_processor  # noqa: E402
from graphflow.plan import Mode  # noqa: E402
from tests.cuda.memory import allocated  # noqa: E402

NEW_TOKENS = 12
#: Every key captured and verified before serving (``serve``'s default captures the FULL
#: keys beside serving and verifies the largest PIECEWISE key, the others on first use).
EVERY_KEY_VERIFIED = dict(full_in_background=False, verify="all")


#: The model every test here serves (``_model``); the engine's own graphs are run on it in a
#: process of their own (``_engine_graphs``).
LLAMA = dict(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024)


def _model():
    torch.manual_seed(0)
    built = LlamaForCausalLM(LlamaConfig(**LLAMA)).to("cuda", torch.bfloat16).eval()
    built.set_attn_implementation("paged|sdpa")
    return built


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(scope="module")
def prompts():
    generator = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in torch.randint(3, 90, (12,), generator=generator)]
    return [[int(t) for t in torch.randint(3, 2000, (n,), generator=generator)] for n in lengths]


def batching(**overrides) -> ContinuousBatchingConfig:
    settings = dict(block_size=32, num_blocks=64, max_batch_tokens=128, max_requests_per_batch=8,
                    q_padding_interval_size=32, kv_padding_interval_size=1024, use_async_batching=False,
                    use_cuda_graph=False)
    settings.update(overrides)
    return ContinuousBatchingConfig(**settings)


def generate(model, prompts, config, attach=None, during=None, padded=False, after=None):
    """The engine's tokens per request, with graphflow attached by ``attach(manager)``;
    ``during(serving)`` runs once the requests are added, ``after(serving)`` once every
    answer is in (before the engine stops); ``padded``: the engine alone with the padding
    graphflow turns on (its eager steps on the very batches graphflow's graphs replay:
    bf16 kernels sum in another order at another size, so padding alone can change a
    random model's tokens)."""
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    if padded:
        processor = batch_processor(manager)
        processor.model_runner.pad_inputs = processor.inputs_and_outputs.use_cuda_graph_varlen = True
    serving = attach(manager) if attach is not None else None
    try:
        manager.start()
        manager.add_requests(prompts, max_new_tokens=NEW_TOKENS)
        if during is not None:
            during(serving)
        results = {}
        for _ in prompts:
            result = manager.get_result(timeout=120)
            assert result is not None and result.error is None, result
            results[result.request_id] = result.generated_tokens
        if after is not None:
            after(serving)
        manager.stop(block=True)
        return results, serving
    finally:
        if serving is not None:
            serving.close()
        model.destroy_cached_continuous_batching_manager()


def test_foreground_and_lazy_tokens_match_the_engine(model, prompts):
    """The default foreground: the PIECEWISE keys before serving (the largest verified
    then, the others captured cold and checked on their first batch), the FULL keys beside
    serving; the step waits (``during``) until the capture thread is done, so that the pool
    measured is the whole plan's."""
    eager, _ = generate(model, prompts, batching())
    assert generate(model, prompts, batching(), padded=True)[0] == eager  # padding alone changes nothing here
    foreground, fg = generate(model, prompts, batching(), attach=lambda m: serve(m),
                              during=lambda serving: serving.wait_captured(120))
    assert foreground == eager
    summary = fg.coverage.as_dict()
    assert summary["graph_steps"] > 0
    assert summary["eager_steps"] == 0, fg.report()
    assert all(entry["state"] in ("live", "captured") for entry in summary["keys"].values()
               if entry["state"] != "unplanned"), fg.report()
    assert fg.checks.before_ready == 1 and fg.checks.failed == 0 and fg.checks.on_first_use > 0, fg.report()
    # The forecast made before any capture (a probed warm step of the largest key of each
    # mode, the PIECEWISE key's attention outside the probe) is the pool to within 5 %, or
    # one of the allocator's 2 MiB segments of small blocks, which is more than 5 % of this
    # model's pool. The largest PIECEWISE key alone forecast 2 MiB of a 22 MiB pool on the
    # H200: the FULL keys' attention took a 20 MiB segment (its KV read repeated per head, a
    # block over 1 MiB). Nothing but the steps' own tensors goes into it: before the
    # capture stream's cuBLAS workspace was made outside, its 32 MiB went in too.
    pool, forecast = fg.memory["pool_bytes"], fg.memory["estimated_pool_bytes"]
    assert pool > 0 and abs(forecast - pool) <= max(0.05 * pool, 2 << 20), (forecast, pool)
    lazy, lz = generate(model, prompts, batching(), attach=lambda m: serve(m, lazy=True))
    assert lazy == eager
    assert lz.wait_captured(120)
    assert lz.coverage.as_dict()["graph_steps"] > 0
    assert not [k for k, e in lz.coverage.as_dict()["keys"].items() if e["state"] == "failed"], lz.report()
    print(fg.report())
    print(lz.report())


def test_a_failed_middle_key_rolls_back_alone(model, prompts, caplog):
    """A key whose capture raises is undone with its memory, logged, and served eagerly."""
    eager, _ = generate(model, prompts, batching())
    layer = model.model.layers[1]
    original = layer.forward
    planned = {}

    def attach(manager):
        keys = [k for k in _plan_keys(manager)]
        planned["key"] = keys[len(keys) // 2]

        def failing(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            if torch.cuda.is_current_stream_capturing() and hidden.shape[1] == planned["key"].q:
                raise RuntimeError("injected failure at a middle key")
            return original(*args, **kwargs)

        layer.forward = failing
        return serve(manager, full_in_background=False)  # every key's transaction before serving

    try:
        with caplog.at_level(logging.WARNING, logger="graphflow.serving"):
            tokens, serving = generate(model, prompts, batching(), attach=attach)
    finally:
        layer.__dict__.pop("forward", None)
    assert tokens == eager
    failed = [k for k, e in serving.coverage.as_dict()["keys"].items() if e["state"] == "failed"]
    assert failed and str(planned["key"]) in failed
    assert "injected failure" in caplog.text
    for key in failed:
        before, after = next(v for k, v in serving.key_memory.items() if str(k) == key)
        assert after == before, f"{key}: {after - before} bytes left behind by its rollback"
    assert serving.coverage.as_dict()["graph_steps"] > 0


def test_close_gives_the_memory_back(model):
    """Capture every key and close, then three times more on one engine: graphflow's
    graphs, pool and stream are given back whole (the engine's own cache and tensors stay,
    as they were).

    The count starts after the first cycle: its first captures on the capture stream make
    the libraries' per-stream state there (cuBLAS and cuDNN workspaces, kept by them for
    the stream's next use, 33.5 MB once on the H200), which is not graphflow's and is
    bounded here; every later cycle must give back all it took."""
    generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching())
    batch_processor(manager)
    start = allocated()
    serve(manager, **EVERY_KEY_VERIFIED).close()
    before = allocated()
    assert before - start <= 64 * 2**20, f"{(before - start) / 2**20:.1f} MiB left by the first cycle"
    for _ in range(3):
        serving = serve(manager, **EVERY_KEY_VERIFIED)
        assert serving.coverage.as_dict()["captured"] == len(serving.plan.keys)
        assert serving.memory["attention_buffer_bytes"] > 0  # the PIECEWISE keys' static buffers, given back too
        serving.close()
        assert allocated() == before
    model.destroy_cached_continuous_batching_manager()


def test_lazy_serves_while_it_captures(model, prompts):
    """Steps are served while the thread captures (none waits for a capture), on graphs
    as they go live, with the engine's tokens."""
    capturing = []

    def attach(manager):
        serving = serve(manager, lazy=True)
        processor = serving.processor
        step = processor._generation_step

        def counted(model_):
            capturing.append(serving.capturing)
            step(model_)

        processor._generation_step = counted
        return serving

    eager, _ = generate(model, prompts, batching())
    tokens, serving = generate(model, prompts, batching(), attach=attach)
    assert tokens == eager
    summary = serving.coverage.as_dict()
    no_graph_yet = sum(e["eager_steps"].get(str(Fallback.NO_GRAPH_YET), 0) for e in summary["keys"].values())
    assert any(capturing) and no_graph_yet > 0  # served while capturing, eagerly where no graph was live
    assert summary["steps"] == len(capturing)
    # Recordings paused for the steps with their captures open, and none of them broke.
    assert serving.retried == 0, serving.report()
    print(serving.report())


def _plan_keys(manager):
    return serving_plan(manager, longest=manager.model.config.max_position_embeddings).keys


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_models(family, prompts):
    """Sliding-window (Mistral, window 16 < the prompts) and hybrid (Gemma-2: full and
    sliding layers) models through the same engine: foreground and lazy tokens equal the
    engine's eager steps on the same padded batches."""
    torch.manual_seed(0)
    common = dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    if family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        built = MistralForCausalLM(MistralConfig(sliding_window=16, **common))
    else:
        from transformers import Gemma2Config, Gemma2ForCausalLM

        built = Gemma2ForCausalLM(Gemma2Config(sliding_window=16, head_dim=32, **common))
    built = built.to("cuda", torch.bfloat16).eval()
    built.set_attn_implementation("paged|sdpa")
    eager, _ = generate(built, prompts, batching(), padded=True)
    foreground, fg = generate(built, prompts, batching(), attach=lambda m: serve(m))
    assert foreground == eager
    assert fg.coverage.as_dict()["graph_steps"] > 0 and fg.coverage.as_dict()["eager_steps"] == 0, fg.report()
    lazy, _ = generate(built, prompts, batching(), attach=lambda m: serve(m, lazy=True))
    assert lazy == eager
    print(family, fg.plan.settings["layer_types"], len(fg.plan.keys), "keys")


#: KV padded to 64 tokens: the prefills and mixed steps of one padded query size read
#: several padded KV sizes, all served by that size's one PIECEWISE key.
FINE_KV = {"kv_padding_interval_size": 64}
REPO = pathlib.Path(__file__).resolve().parents[2]


def _engine_graphs(prompts, settings: dict) -> dict:
    """The engine's own CUDA graphs (a FULL graph per key, captured at first use), in a
    process of its own (dropping a processor whose graphs the engine captured can abort a
    long test session: the module docstring)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(REPO)!r})
from transformers import GenerationConfig
from tests.cuda.test_cuda_hf_serving import NEW_TOKENS, _model, batching
generation = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
manager = _model().init_continuous_batching(generation_config=generation,
                                            continuous_batching_config=batching(use_cuda_graph=True, **{settings!r}))
prompts = json.loads(sys.stdin.read())
manager.start()
manager.add_requests(prompts, max_new_tokens=NEW_TOKENS)
results = {{}}
for _ in prompts:
    result = manager.get_result(timeout=300)
    results[result.request_id] = result.generated_tokens
manager.stop(block=True)
print(json.dumps(results))
"""
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(prompts), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_piecewise_and_full_decode_keys_match_the_engine(model, prompts):
    """Foreground and lazy: tokens identical to the engine's own eager steps on the same
    padded batches and to the engine's own graphs. After the foreground capture every step
    is on a graph: the decode-only ones on their FULL keys, the others on PIECEWISE keys,
    one of which served batches that read different KV; the static attention buffers hold
    what the plan said. (That close gives them back: ``test_close_gives_the_memory_back``.)"""
    config = batching(**FINE_KV)
    eager, _ = generate(model, prompts, config, padded=True)
    assert _engine_graphs(prompts, FINE_KV) == eager
    steps = []

    def attach(manager, lazy=False):
        serving = serve(manager, lazy=True) if lazy else serve(manager, **EVERY_KEY_VERIFIED)
        processor = serving.processor
        step = processor._generation_step

        def recorded(model_):
            step(model_)
            io = processor.inputs_and_outputs
            steps.append((batch_keys(io), io.max_kv_read))

        processor._generation_step = recorded
        return serving

    foreground, fg = generate(model, prompts, config, attach=attach)
    assert foreground == eager
    summary = fg.coverage.as_dict()
    assert summary["eager_steps"] == 0 and summary["graph_steps"] == len(steps), fg.report()
    assert all(entry["state"] == "live" for entry in summary["keys"].values())
    reads = collections.defaultdict(set)
    for keys, read in steps:
        assert keys[0] in fg.plan.keys, keys  # a decode-only step's FULL key, another's PIECEWISE key
        reads[keys[0]].add(read)
    assert {key.mode for key in reads} == {Mode.PIECEWISE, Mode.FULL}
    assert any(key.mode is Mode.PIECEWISE and len(kv) > 1 for key, kv in reads.items()), reads
    assert fg.memory["attention_buffer_bytes"] == fg.plan.attention_buffer_bytes > 0
    lazy, lz = generate(model, prompts, config, attach=lambda m: attach(m, lazy=True))
    assert lazy == eager
    assert lz.wait_captured(120)
    assert not [k for k, e in lz.coverage.as_dict()["keys"].items() if e["state"] == "failed"], lz.report()
    # The default: the PIECEWISE keys before serving, the FULL ones beside it: every step on a graph.
    split, sp = generate(model, prompts, config, attach=lambda m: serve(m))
    assert split == eager
    assert sp.wait_captured(120)
    summary = sp.coverage.as_dict()
    assert summary["eager_steps"] == 0 and not [k for k, e in summary["keys"].items() if e["state"] == "failed"], \
        sp.report()
    print(fg.report())
    print(lz.report())
    print(sp.report())
