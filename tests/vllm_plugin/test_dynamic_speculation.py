"""Dynamic speculative decoding on model runner V2: the engine plan counts what V2 captures.

``num_speculative_tokens_per_batch_size`` makes V2 pick the draft width from the batch
size. The target's ``CudaGraphManager`` lists a FULL decode graph per width when it is
built; the speculator's decode ``SpeculatorCudaGraphManager`` rewrites its list inside
``capture`` (one graph per descriptor and width), after the plugin read it. Here vLLM's
real managers are built from a real ``VllmConfig``, and vLLM's real
``SpeculatorCudaGraphManager.capture`` does the rewrite (the base capture loop, which
needs a GPU model, is replaced by one that records the list it was given).
"""

import copy
import types

import pytest

pytest.importorskip("vllm")

import harness  # noqa: E402

from graphflow.integrations.vllm import plan_from_engine, plan_from_vllm_config  # noqa: E402
from graphflow.integrations.vllm.descriptors import descriptor_from_vllm  # noqa: E402
from graphflow.integrations.vllm.engine import speculative_widths  # noqa: E402
from graphflow.plan import Plan, Segment, SegmentKind  # noqa: E402

SCHEDULE = [(1, 2, 3), (3, 4, 2), (5, 8, 1)]
MODEL_PLAN = Plan("step", segments=[Segment("step", SegmentKind.GRAPH, "forward", stream="s")])


@pytest.fixture(scope="module")
def config():
    config = harness.engine_config(max_num_seqs=8, max_num_batched_tokens=256, speculative_config={
        "method": "ngram", "prompt_lookup_max": 3, "prompt_lookup_min": 1, "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": SCHEDULE})
    assert config.use_v2_model_runner and config.speculative_config.uses_dynamic_speculative_decoding()
    return config


def v2_engine(config, *, steps=3, fused=True):
    """A V2 runner's graph managers as vLLM builds them, with an EAGLE-style speculator."""
    import torch
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

    config = copy.deepcopy(config)
    q = config.uniform_decode_query_len
    mode = config.compilation_config.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.ALWAYS, "StandIn", q,
                                                                      use_v2_model_runner=True)
    device = torch.device("cuda:0")
    from vllm.config import CUDAGraphMode

    speculator = types.SimpleNamespace(  # as TargetDependentARSpeculator.init_cudagraph_manager builds them
        prefill_cudagraph_manager=SpeculatorCudaGraphManager(config, device, mode, steps + 1),
        decode_cudagraph_manager=SpeculatorCudaGraphManager(config, device, CUDAGraphMode.FULL_DECODE_ONLY, 1),
        num_speculative_steps=steps, supports_decode_metadata_update=fused)
    return types.SimpleNamespace(vllm_config=config, cudagraph_manager=CudaGraphManager(config, device, mode, q),
                                 speculator=speculator, model_state=None, device=device)


def captured_by_vllm(manager, monkeypatch, *, specialize):
    """The list vLLM's ``SpeculatorCudaGraphManager.capture`` hands its capture loop."""
    from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager

    seen = []
    monkeypatch.setattr(CudaGraphManager, "capture", lambda self, create, desc="": seen.extend(
        d for descs in self._capture_descs.values() for d in descs))
    manager.capture(None, None, None, None, None, None, specialize_spec_tokens=specialize)
    return sorted(descriptor_from_vllm("drafter", None, d) for d in seen)


def test_the_widths_are_vllms_schedule_lookup():
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    for schedule, seqs, k in [(SCHEDULE, 8, 3), (SCHEDULE, 2, 3), (SCHEDULE, 8, 2), ([(1, 4, 5), (9, 16, 2)], 6, 4),
                              ([(1, 4, 5), (9, 16, 2)], 12, 4), ([(1, 1, 0), (2, 64, 4)], 64, 4)]:
        dense = build_dynamic_sd_schedule_lookup(schedule, vllm_max_batch_size=seqs, vllm_num_speculative_tokens=k)
        assert speculative_widths(schedule, seqs, k) == tuple(sorted(set(dense) - {0, 1}, reverse=True))


def test_the_engine_plan_counts_the_drafter_graphs_v2_captures(vllm_world, config, monkeypatch):
    engine = v2_engine(config)
    plan = plan_from_engine(engine)  # read before capture, as the plugin does
    decode = engine.speculator.decode_cudagraph_manager
    listed = sum(len(ds) for ds in decode._capture_descs.values())
    truth = captured_by_vllm(decode, monkeypatch, specialize=True)
    assert len(truth) == 2 * listed  # widths 3 and 2
    planned = sorted(d for d in plan.family("drafter") if d.num_speculative_tokens is not None)
    assert planned == truth
    assert {d.num_speculative_tokens for d in planned} == {3, 2} and str(planned[-1]).endswith("k=3)")
    # the prefill manager is captured as listed
    prefill = [d for d in plan.family("drafter") if d.num_speculative_tokens is None]
    assert len(prefill) == sum(len(ds) for ds in engine.speculator.prefill_cudagraph_manager._capture_descs.values())


def test_the_target_lists_a_decode_graph_per_width(vllm_world, config):
    plan = plan_from_engine(v2_engine(config))
    widths = {d.uniform_query_len for d in plan.family("target") if d.mode.value == "FULL"}
    assert widths == {4, 3, 2}  # q = 1 + each width the schedule picks


def test_unfused_draft_decodes_are_captured_as_listed(vllm_world, config, monkeypatch):
    engine = v2_engine(config, fused=False)
    plan = plan_from_engine(engine)
    truth = captured_by_vllm(engine.speculator.decode_cudagraph_manager, monkeypatch, specialize=False)
    assert all(d.num_speculative_tokens is None for d in plan.family("drafter"))
    assert len(plan.family("drafter")) == len(truth) + sum(
        len(ds) for ds in engine.speculator.prefill_cudagraph_manager._capture_descs.values())


def test_one_speculative_step_captures_no_draft_decode_graphs(vllm_world, config):
    engine = v2_engine(config, steps=1)
    prefill = sum(len(ds) for ds in engine.speculator.prefill_cudagraph_manager._capture_descs.values())
    assert len(plan_from_engine(engine).family("drafter")) == prefill


def test_the_config_plan_names_dynamic_speculation_as_unknown(config):
    notes = [u for u in plan_from_vllm_config(config, model_plan=MODEL_PLAN, attention_support="ALWAYS").unknowns
             if "dynamic speculative decoding" in u]
    assert len(notes) == 1 and notes[0].startswith("not predicted:") and "number unknown" in notes[0]
    assert "draft widths 3, 2, 1" in notes[0]
