"""graphflow's plans against the descriptors vLLM itself produces, for real ``VllmConfig``s.

Each case builds a post-init ``VllmConfig`` from a local tiny HF config on the CPU, then
lets vLLM resolve it as a worker does (``resolve_cudagraph_mode_and_sizes`` with the
attention backends' support) and builds its real V1 ``CudagraphDispatcher`` and V2
``CudaGraphManager``. graphflow must predict the same graphs from the config inputs
alone (``plan_from_vllm_config``), from the post-init config, and read the same ones off
the engine's objects (``plan_from_engine``).
"""

import copy
import types

import pytest

pytest.importorskip("vllm")

import harness  # noqa: E402

from graphflow.integrations.vllm import plan_from_engine, plan_from_vllm_config  # noqa: E402
from graphflow.integrations.vllm.engine import engine_descriptors  # noqa: E402
from graphflow.plan import CaptureSettings, Plan, Segment, SegmentKind  # noqa: E402

MODEL_PLAN = Plan("step", segments=[Segment("step", SegmentKind.GRAPH, "forward", stream="s")],
                  capture=CaptureSettings())
NGRAM = {"method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1}

# (id, EngineArgs keywords, graphflow inputs beyond the shared ones, attention support)
CASES = [
    ("default-256", dict(max_num_seqs=256, max_num_batched_tokens=8192), {}, "ALWAYS"),
    ("default-128", dict(max_num_seqs=128, max_num_batched_tokens=8192), {}, "ALWAYS"),
    ("seqs-8", dict(max_num_seqs=8, max_num_batched_tokens=2048), {}, "ALWAYS"),
    ("seqs-300", dict(max_num_seqs=300, max_num_batched_tokens=8192), {}, "ALWAYS"),
    ("piecewise", dict(max_num_seqs=64, max_num_batched_tokens=8192, compilation_config={"cudagraph_mode": "PIECEWISE"}),
     {"cudagraph_mode": "PIECEWISE"}, "ALWAYS"),
    ("full-decode-only", dict(max_num_seqs=64, max_num_batched_tokens=8192,
                              compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"}),
     {"cudagraph_mode": "FULL_DECODE_ONLY"}, "ALWAYS"),
    ("full", dict(max_num_seqs=64, max_num_batched_tokens=8192, compilation_config={"cudagraph_mode": "FULL"}),
     {"cudagraph_mode": "FULL"}, "ALWAYS"),
    ("full-fa2", dict(max_num_seqs=64, max_num_batched_tokens=8192, compilation_config={"cudagraph_mode": "FULL"}),
     {"cudagraph_mode": "FULL"}, "UNIFORM_BATCH"),
    ("enforce-eager", dict(max_num_seqs=64, max_num_batched_tokens=8192, enforce_eager=True),
     {"enforce_eager": True}, "ALWAYS"),
    ("O0", dict(max_num_seqs=64, max_num_batched_tokens=8192, optimization_level=0), {"optimization_level": 0},
     "ALWAYS"),
    ("O1", dict(max_num_seqs=64, max_num_batched_tokens=8192, optimization_level=1), {"optimization_level": 1},
     "ALWAYS"),
    ("no-vllm-compile", dict(max_num_seqs=64, max_num_batched_tokens=8192, compilation_config={"mode": 0}),
     {"compilation_mode": 0}, "ALWAYS"),
    ("spec-2", dict(max_num_seqs=8, max_num_batched_tokens=2048, speculative_config={**NGRAM, "num_speculative_tokens": 2}),
     {"num_speculative_tokens": 2}, "ALWAYS"),
    ("spec-3-seqs-64", dict(max_num_seqs=64, max_num_batched_tokens=8192,
                            speculative_config={**NGRAM, "num_speculative_tokens": 3}),
     {"num_speculative_tokens": 3}, "ALWAYS"),
    ("spec-3-seqs-300", dict(max_num_seqs=300, max_num_batched_tokens=8192,
                             speculative_config={**NGRAM, "num_speculative_tokens": 3}),
     {"num_speculative_tokens": 3}, "ALWAYS"),
    ("spec-1-sizes", dict(max_num_seqs=16, max_num_batched_tokens=2048,
                          speculative_config={**NGRAM, "num_speculative_tokens": 1},
                          compilation_config={"cudagraph_capture_sizes": [1, 2, 3, 5, 8, 13]}),
     {"num_speculative_tokens": 1, "cudagraph_capture_sizes": [1, 2, 3, 5, 8, 13]}, "ALWAYS"),
    ("spec-2-single-token-attention", dict(max_num_seqs=8, max_num_batched_tokens=2048,
                                           speculative_config={**NGRAM, "num_speculative_tokens": 2}),
     {"num_speculative_tokens": 2}, "UNIFORM_SINGLE_TOKEN_DECODE"),
    ("sizes", dict(max_num_seqs=32, max_num_batched_tokens=2048, compilation_config={"cudagraph_capture_sizes": [16, 1, 3, 64, 40]}),
     {"cudagraph_capture_sizes": [16, 1, 3, 64, 40]}, "ALWAYS"),
    ("max-size-100", dict(max_num_seqs=128, max_num_batched_tokens=8192,
                          compilation_config={"max_cudagraph_capture_size": 100}),
     {"max_cudagraph_capture_size": 100}, "ALWAYS"),
    ("batched-tokens-100", dict(max_num_seqs=64, max_num_batched_tokens=100), {}, "ALWAYS"),
    ("interactivity", dict(max_num_seqs=16, max_num_batched_tokens=2048, performance_mode="interactivity"),
     {"performance_mode": "interactivity"}, "ALWAYS"),
    ("stock-torch-compile", dict(max_num_seqs=64, max_num_batched_tokens=8192, compilation_config={"mode": 1}),
     {"compilation_mode": 1}, "ALWAYS"),
    ("stock-torch-compile-full", dict(max_num_seqs=64, max_num_batched_tokens=8192,
                                      compilation_config={"mode": 1, "cudagraph_mode": "FULL"}),
     {"compilation_mode": 1, "cudagraph_mode": "FULL"}, "ALWAYS"),
]


def inputs(engine_kwargs, extra):
    return {"max_num_seqs": engine_kwargs["max_num_seqs"],
            "max_num_batched_tokens": engine_kwargs["max_num_batched_tokens"], **extra}


@pytest.fixture(scope="module")
def configs():
    return {case[0]: harness.engine_config(**case[1]) for case in CASES}


def resolved_engine(config, runner: str, support: str, *, drafter: bool = False):
    """What a worker holds after resolving the config: V1's dispatcher or V2's graph manager.

    ``drafter`` gives V1 an EAGLE drafter's dispatcher, its keys set by vLLM's own
    ``EagleProposer.initialize_cudagraph_keys``, and V2 an EAGLE speculator's graph
    managers, made by vLLM's own ``EagleSpeculator.init_cudagraph_manager`` (neither needs
    the drafter's model).
    """
    import torch
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator

    config = copy.deepcopy(config)
    mode = config.compilation_config.resolve_cudagraph_mode_and_sizes(
        AttentionCGSupport[support], "StandIn", config.uniform_decode_query_len, use_v2_model_runner=runner == "v2")
    if runner == "v1":
        dispatcher = CudagraphDispatcher(config)
        dispatcher.initialize_cudagraph_keys(mode, config.uniform_decode_query_len)
        proposer = None
        if drafter:
            proposer = types.SimpleNamespace(speculative_config=config.speculative_config,
                                             cudagraph_dispatcher=CudagraphDispatcher(config))
            EagleProposer.initialize_cudagraph_keys(proposer, mode)
        return types.SimpleNamespace(vllm_config=config, cudagraph_dispatcher=dispatcher, drafter=proposer,
                                     encoder_cudagraph_manager=None, device=torch.device("cuda:0"))
    manager = CudaGraphManager(config, torch.device("cuda:0"), mode, config.uniform_decode_query_len)
    speculator = None
    if drafter:
        speculator = types.SimpleNamespace(vllm_config=config, device=torch.device("cuda:0"),
                                           num_speculative_steps=config.num_speculative_tokens)
        EagleSpeculator.init_cudagraph_manager(speculator, mode)
    return types.SimpleNamespace(vllm_config=config, cudagraph_manager=manager, speculator=speculator, model_state=None,
                                 device=torch.device("cuda:0"))


def vllm_keys(engine) -> list[tuple]:
    """vLLM's own descriptors, read here without graphflow: (mode, tokens, reqs, q)."""
    if hasattr(engine, "cudagraph_dispatcher"):
        q = engine.cudagraph_dispatcher.uniform_decode_query_len
        return sorted((m.name, d.num_tokens, d.num_reqs, q if d.uniform else None)
                      for m, ds in engine.cudagraph_dispatcher.get_capture_descs() for d in ds)
    return sorted((d.cg_mode.name, d.num_tokens, d.num_reqs, d.uniform_token_count)
                  for ds in engine.cudagraph_manager._capture_descs.values() for d in ds)


def keys(descriptors) -> list[tuple]:
    return sorted((d.mode.value, d.num_tokens, d.num_reqs, d.uniform_query_len) for d in descriptors)


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_graphflow_plans_what_vllm_captures(vllm_world, configs, case, runner):
    name, engine_kwargs, extra, support = case
    engine = resolved_engine(configs[name], runner, support)
    truth = vllm_keys(engine)
    assert keys(engine_descriptors(engine)) == truth
    predicted = plan_from_vllm_config(inputs(engine_kwargs, extra), model_plan=MODEL_PLAN, runner=runner,
                                      attention_support=support)
    assert keys(predicted.descriptors) == truth
    from_config = plan_from_vllm_config(configs[name], model_plan=MODEL_PLAN, runner=runner,
                                        attention_support=support)
    assert keys(from_config.descriptors) == truth
    plan = plan_from_engine(engine).plan
    for mode in plan.capture.modes:
        assert plan.capture.sizes_for(mode) == tuple(sorted({t for m, t, _, _ in truth if m == mode.value}))


def test_the_default_at_256_sequences_is_51_piecewise_and_35_full_graphs(vllm_world, configs):
    engine = resolved_engine(configs["default-256"], "v1", "ALWAYS")
    plan = plan_from_engine(engine)
    assert plan.counts() == {("target", "PIECEWISE"): 51, ("target", "FULL"): 35}
    assert plan.summary() == "target PIECEWISE=51 (largest 512), target FULL=35 (largest 256)"
    assert plan.plan.capture.sizes_for(plan.plan.capture.modes[1])[-1] == 256


def test_v1_rounds_speculative_sizes_and_v2_does_not(vllm_world, configs):
    v1 = plan_from_engine(resolved_engine(configs["spec-1-sizes"], "v1", "ALWAYS")).descriptors
    v2 = plan_from_engine(resolved_engine(configs["spec-1-sizes"], "v2", "ALWAYS")).descriptors
    assert {d.num_tokens for d in v1} == {2, 4, 6, 8}  # 1 2 3 5 8 13 rounded to multiples of q=2, at most 13
    assert {d.num_tokens for d in v2 if d.mode.value == "PIECEWISE"} == {1, 2, 3, 5, 8, 13}
    assert all(d.uniform_query_len == 2 and d.num_tokens % 2 == 0 for d in v2 if d.mode.value == "FULL")


def test_a_prediction_says_what_it_cannot_know(configs):
    plan = plan_from_vllm_config({"max_num_seqs": 8}, model_plan=MODEL_PLAN)
    assert any("max_num_batched_tokens" in u for u in plan.unknowns)
    assert any("attention backends" in u for u in plan.unknowns)
    assert not any("attention backends" in u for u in
                   plan_from_vllm_config(configs["seqs-8"], model_plan=MODEL_PLAN, attention_support="ALWAYS").unknowns)


@pytest.fixture
def v1_config(monkeypatch):
    """A post-init ``VllmConfig`` for model runner V1 (its post-init differs from V2's)."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")

    def build(**engine_kwargs):
        config = harness.engine_config(**engine_kwargs)
        assert not config.use_v2_model_runner
        return config

    return build


def test_stock_torch_compile_captures_nothing_on_v1(vllm_world, v1_config):
    """V1's post-init keeps FULL_DECODE_ONLY and its dispatcher lists the keys, but V1's
    ``load_model`` compiles with stock torch.compile and returns before it wraps the model
    in a ``CUDAGraphWrapper``: no key captures a graph."""
    kwargs = dict(max_num_seqs=64, max_num_batched_tokens=8192, compilation_config={"mode": 1})
    config = v1_config(**kwargs)
    assert config.compilation_config.cudagraph_mode.name == "FULL_DECODE_ONLY"
    engine = resolved_engine(config, "v1", "ALWAYS")
    assert vllm_keys(engine)  # listed, never captured
    assert plan_from_engine(engine).descriptors == ()
    assert plan_from_vllm_config(config, model_plan=MODEL_PLAN, attention_support="ALWAYS").descriptors == ()
    predicted = plan_from_vllm_config(inputs(kwargs, {"compilation_mode": "STOCK_TORCH_COMPILE"}),
                                      model_plan=MODEL_PLAN, runner="v1", attention_support="ALWAYS")
    assert predicted.cudagraph_mode == "NONE" and predicted.summary() == "no graphs"


SPEC_2_SEQS_8 = dict(max_num_seqs=8, max_num_batched_tokens=2048,
                     speculative_config={**NGRAM, "num_speculative_tokens": 2})


def test_v1_captures_drafter_graphs_only_inside_the_targets_piecewise_captures(vllm_world, v1_config):
    """Under FULL the drafter's dispatcher lists PIECEWISE keys, but V1's ``_dummy_run``
    runs the drafter with graphs only while the target captures PIECEWISE: none here."""
    full = resolved_engine(v1_config(**SPEC_2_SEQS_8, compilation_config={"cudagraph_mode": "FULL"}), "v1", "ALWAYS",
                           drafter=True)
    listed = [d for _, ds in full.drafter.cudagraph_dispatcher.get_capture_descs() for d in ds]
    assert len(listed) == 9  # the sizes up to 48, rounded to multiples of q = 3
    assert {m.name for m, _ in full.drafter.cudagraph_dispatcher.get_capture_descs()} == {"PIECEWISE"}
    plan = plan_from_engine(full)
    assert plan.family("drafter") == () and set(plan.counts()) == {("target", "FULL")}

    both = resolved_engine(v1_config(**SPEC_2_SEQS_8), "v1", "ALWAYS", drafter=True)
    plan = plan_from_engine(both)
    drafter = plan.family("drafter")
    assert drafter and sorted(d.num_tokens for d in drafter) == sorted(
        d.num_tokens for _, ds in both.drafter.cudagraph_dispatcher.get_capture_descs() for d in ds)
    assert {d.num_tokens for d in drafter} == set(plan.plan.capture.sizes_for(plan.plan.capture.modes[0]))
    assert plan.plan.capture.modes[0].value == "PIECEWISE"


SPECULATIVE = [c[0] for c in CASES if c[0].startswith("spec-")]


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("name", SPECULATIVE)
def test_an_eagle_drafters_graphs_are_predicted_as_vllm_makes_them(vllm_world, configs, runner, name):
    """V1: PIECEWISE at the target's PIECEWISE sizes; V2: the draft prefill's graphs as the
    target's, and with more than one step the draft decodes', FULL at query length 1."""
    _, engine_kwargs, extra, support = next(c for c in CASES if c[0] == name)
    truth = keys(plan_from_engine(resolved_engine(configs[name], runner, support, drafter=True)).family("drafter"))
    predicted = plan_from_vllm_config({**inputs(engine_kwargs, extra), "speculative_method": "eagle"},
                                      model_plan=MODEL_PLAN, runner=runner, attention_support=support)
    assert keys(predicted.family("drafter")) == truth and not any("drafter" in u for u in predicted.unknowns)
    if runner == "v2" and name == "spec-3-seqs-300":  # graphflow vllm check's eagle example
        assert predicted.counts() == {("target", "PIECEWISE"): 51, ("target", "FULL"): 49,
                                      ("drafter", "PIECEWISE"): 51, ("drafter", "FULL"): 86}


def test_a_prediction_says_which_drafters_it_cannot_predict(configs):
    mtp = {"max_num_seqs": 300, "max_num_batched_tokens": 8192, "num_speculative_tokens": 4,
           "speculative_method": "deepseek_mtp"}
    notes = [u for u in plan_from_vllm_config(mtp, model_plan=MODEL_PLAN, runner="v2").unknowns
             if u.startswith("not predicted: drafter graphs")]
    assert len(notes) == 1 and "deepseek_mtp with 4 speculative tokens" in notes[0] and "number unknown" in notes[0]
    assert "vLLM picks the MTP drafter" in notes[0]
    # V1 runs the drafter with graphs only inside PIECEWISE target captures: under FULL it knows there are none
    v1_full = plan_from_vllm_config({**mtp, "cudagraph_mode": "FULL"}, model_plan=MODEL_PLAN, runner="v1")
    assert not any("drafter" in u for u in v1_full.unknowns) and not v1_full.family("drafter")
    # n-gram proposals run no model, so no drafter graph
    assert not any("not predicted: drafter" in u for u in
                   plan_from_vllm_config(configs["spec-2"], model_plan=MODEL_PLAN, attention_support="ALWAYS").unknowns)
