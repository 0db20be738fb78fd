"""vLLM's capture rules applied to config inputs, without vLLM (the real-vLLM comparison of
these predictions is tests/vllm_plugin/test_descriptors.py)."""

import enum
import subprocess
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphflow.errors import PlanError
from graphflow.integrations.vllm import VLLM_MODES, plan_from_vllm_config
from graphflow.plan import CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from graphflow.plan.rules import validate

PLAN = Plan(
    "decode",
    streams=[Stream("s0", "cuda:0")],
    segments=[Segment("step", SegmentKind.GRAPH, "forward", stream="s0")],
    capture=CaptureSettings(modes=(Mode.PIECEWISE,), sizes=(1, 2), size_symbol="N", warmup_iters=3, atol=0.5),
)
VLLM_DEFAULT_512 = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


def planned(config, **kwargs):
    return plan_from_vllm_config(config, model_plan=PLAN, **kwargs)


def sizes(plan, mode):
    return tuple(sorted({d.num_tokens for d in plan.descriptors if d.mode is mode}))


class TestModes:
    @pytest.mark.parametrize("mode, modes", [
        ("PIECEWISE", (Mode.PIECEWISE,)),
        ("FULL", (Mode.FULL,)),
        ("FULL_DECODE_ONLY", (Mode.FULL,)),
        ("FULL_AND_PIECEWISE", (Mode.PIECEWISE, Mode.FULL)),
        ("full_and_piecewise", (Mode.PIECEWISE, Mode.FULL)),
    ])
    def test_each_mode_captures_what_vllm_captures(self, mode, modes):
        plan = planned({"cudagraph_mode": mode, "cudagraph_capture_sizes": [4, 1], "max_num_seqs": 4})
        assert plan.plan.capture.modes == modes and plan.cudagraph_mode == mode.upper()

    @pytest.mark.parametrize("config", [{"cudagraph_mode": "NONE"}, {"enforce_eager": True}, {"optimization_level": 0},
                                        {"compilation_mode": "NONE", "cudagraph_mode": "PIECEWISE"},
                                        {"compilation_mode": 1}, {"compilation_mode": "STOCK_TORCH_COMPILE",
                                                                  "cudagraph_mode": "FULL", "runner": "v1"}])
    def test_what_captures_nothing(self, config):
        plan = planned({**config, "max_num_seqs": 8, "cudagraph_capture_sizes": [4, 1]})
        assert plan.descriptors == () and plan.plan.capture.modes == ()

    def test_an_unset_mode_follows_the_optimization_level(self):
        assert planned({"max_num_seqs": 8}).cudagraph_mode == "FULL_AND_PIECEWISE"
        assert planned({"max_num_seqs": 8, "optimization_level": "-O1"}).cudagraph_mode == "PIECEWISE"
        assert planned({"max_num_seqs": 8, "optimization_level": 3}).cudagraph_mode == "FULL_AND_PIECEWISE"

    def test_eagle_drafter_graphs_are_predicted_and_the_others_named_unknown(self):
        def drafter(**inputs):
            plan = planned({"max_num_seqs": 8, "num_speculative_tokens": 2, **inputs})
            return plan.family("drafter"), [u for u in plan.unknowns if u.startswith("not predicted: drafter graphs")]

        graphs, notes = drafter(speculative_method="eagle")
        assert notes == [] and {d.mode for d in graphs} == {Mode.PIECEWISE, Mode.FULL}
        assert {d.uniform_query_len for d in graphs if d.mode is Mode.FULL} == {1, 3}  # draft decodes, draft prefill
        graphs, notes = drafter(speculative_method="eagle", num_speculative_tokens=1)
        assert {d.uniform_query_len for d in graphs if d.mode is Mode.FULL} == {2}  # one step: no draft decode graph
        graphs, notes = drafter(speculative_method="mtp")
        assert graphs == () and len(notes) == 1 and "from the draft model's config" in notes[0]
        assert drafter(speculative_method="ngram") == ((), [])
        assert drafter(speculative_method="draft_model") == ((), [])  # V2's draft-model speculator captures none
        # V1 runs the drafter with graphs only inside the target's PIECEWISE captures
        assert drafter(speculative_method="eagle", cudagraph_mode="FULL", runner="v1") == ((), [])
        graphs, notes = drafter(speculative_method="draft_model", runner="v1")
        assert notes == [] and graphs and {d.mode for d in graphs} == {Mode.PIECEWISE}

    def test_without_vllm_compile_the_piecewise_half_is_dropped(self):
        assert planned({"max_num_seqs": 8, "compilation_mode": 0}).cudagraph_mode == "FULL_DECODE_ONLY"

    def test_pooling_and_encoder_decoder_models(self):
        assert planned({"max_num_seqs": 8, "pooling": True}).cudagraph_mode == "PIECEWISE"
        assert planned({"max_num_seqs": 8, "encoder_decoder": True}).cudagraph_mode == "FULL_DECODE_ONLY"

    def test_attention_support_downgrades_as_vllm_does(self):
        full = {"cudagraph_mode": "FULL", "max_num_seqs": 8}
        assert planned(full, attention_support="UNIFORM_BATCH").cudagraph_mode == "FULL_AND_PIECEWISE"
        spec = {"max_num_seqs": 8, "num_speculative_tokens": 2}
        assert planned(spec, attention_support="UNIFORM_SINGLE_TOKEN_DECODE").cudagraph_mode == "PIECEWISE"
        with pytest.raises(PlanError, match="does not support"):
            planned(full, attention_support="NEVER")

    def test_a_cudagraph_mode_enum_member_is_read_by_name(self):
        class CUDAGraphMode(enum.Enum):
            FULL_DECODE_ONLY = (2, 0)

        plan = planned({"cudagraph_mode": CUDAGraphMode.FULL_DECODE_ONLY, "cudagraph_capture_sizes": [2],
                        "max_num_seqs": 2})
        assert plan.plan.capture.modes == (Mode.FULL,)

    @pytest.mark.parametrize("mode", ["FULL_AND_EAGER", "", 3])
    def test_unknown_modes_are_rejected_listing_the_known_ones(self, mode):
        with pytest.raises(PlanError) as info:
            planned({"cudagraph_mode": mode, "cudagraph_capture_sizes": [1]})
        assert info.value.element == "cudagraph_mode"
        assert info.value.message == (f"unknown vLLM cudagraph_mode {mode!r}: expected one of NONE, PIECEWISE, "
                                      "FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE")

    def test_the_table_covers_every_vllm_mode(self):
        assert list(VLLM_MODES) == ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]

    def test_unknown_settings_are_named(self):
        with pytest.raises(PlanError, match="unknown vLLM setting.*max_num_seq\\b"):
            planned({"max_num_seq": 8})


class TestSizes:
    def test_the_default_at_256_sequences_is_51_piecewise_and_35_full(self):
        plan = planned({"max_num_seqs": 256, "max_num_batched_tokens": 8192})
        assert plan.counts() == {("target", "PIECEWISE"): 51, ("target", "FULL"): 35}
        assert sizes(plan, Mode.PIECEWISE) == VLLM_DEFAULT_512
        assert sizes(plan, Mode.FULL) == tuple(s for s in VLLM_DEFAULT_512 if s <= 256)
        assert plan.plan.capture.sizes_for(Mode.FULL)[-1] == 256 and plan.plan.capture.all_sizes[-1] == 512
        assert validate(plan.plan).ok

    def test_full_decode_graphs_fix_requests_and_query_length(self):
        plan = planned({"max_num_seqs": 4, "max_num_batched_tokens": 64})
        full = [d for d in plan.descriptors if d.mode is Mode.FULL]
        assert [(d.num_tokens, d.num_reqs, d.uniform_query_len) for d in full] == [(4, 4, 1), (2, 2, 1), (1, 1, 1)]
        assert str(full[0]) == "target FULL(tokens=4, reqs=4, q=1)"

    def test_max_num_seqs_is_appended_when_it_fits(self):
        assert 300 in sizes(planned({"max_num_seqs": 300, "max_num_batched_tokens": 8192}), Mode.PIECEWISE)

    def test_max_num_batched_tokens_cuts_and_is_appended(self):
        plan = planned({"max_num_seqs": 64, "max_num_batched_tokens": 100})
        assert sizes(plan, Mode.PIECEWISE) == (1, 2, 4, *range(8, 97, 8), 100)

    def test_speculation_appends_uniform_decode_sizes_and_v1_rounds_them(self):
        inputs = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "num_speculative_tokens": 2}
        v2 = planned(inputs, runner="v2")
        assert sizes(v2, Mode.PIECEWISE) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, 48)
        assert sizes(planned(inputs, runner="v1"), Mode.PIECEWISE) == (3, 6, 9, 12, 18, 24, 33, 42, 48)
        assert all(d.uniform_query_len == 3 and d.num_tokens <= 24 for d in v2.descriptors if d.mode is Mode.FULL)

    def test_interactivity_captures_every_small_size(self):
        plan = planned({"max_num_seqs": 16, "max_num_batched_tokens": 2048, "performance_mode": "interactivity"})
        assert sizes(plan, Mode.PIECEWISE) == tuple(range(1, 33))

    def test_blackwell_raises_the_default_maximum(self):
        plan = planned({"max_num_seqs": 1024, "max_num_batched_tokens": 8192, "device_capability": 100})
        assert sizes(plan, Mode.PIECEWISE)[-1] == 1024

    def test_inconsistent_maximum_is_refused_as_vllm_does(self):
        with pytest.raises(PlanError) as info:
            planned({"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [1, 8],
                     "max_cudagraph_capture_size": 16})
        assert info.value.element == "max_cudagraph_capture_size"

    @pytest.mark.parametrize("config, element", [
        ({"cudagraph_mode": "PIECEWISE"}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": [4]}, "max_num_seqs"),
        ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": "1,2"}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": [1, 0]}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": [1, True]}, "cudagraph_capture_sizes"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
        ({"optimization_level": 7, "max_num_seqs": 8}, "optimization_level"),
    ])
    def test_bad_inputs_name_their_setting(self, config, element):
        with pytest.raises(PlanError) as info:
            planned(config)
        assert info.value.element == element

    @given(seqs=st.integers(1, 600), spec=st.integers(0, 4), tokens=st.integers(1, 16384),
           runner=st.sampled_from(["v1", "v2"]))
    def test_full_decode_graphs_stay_within_q_times_max_num_seqs(self, seqs, spec, tokens, runner):
        if tokens < seqs:
            return
        try:
            plan = planned({"max_num_seqs": seqs, "num_speculative_tokens": spec, "max_num_batched_tokens": tokens},
                           runner=runner)
        except PlanError as e:  # vLLM refuses these too: V1 rounds every size past the maximum
            assert runner == "v1" and "rounding to a multiple" in e.message
            return
        q = 1 + spec
        piecewise = set(sizes(plan, Mode.PIECEWISE))
        assert piecewise and max(piecewise) <= tokens
        for d in plan.descriptors:
            if d.mode is Mode.FULL:
                assert q <= d.num_tokens <= q * seqs and d.num_reqs <= seqs and d.uniform_query_len == q
                assert d.num_tokens % q == 0 or runner == "v1"
        assert validate(plan.plan).ok


class TestPlan:
    def test_only_modes_and_sizes_change(self):
        plan = planned({"cudagraph_mode": "PIECEWISE", "cudagraph_capture_sizes": [4]}).plan
        assert plan.capture == CaptureSettings(modes=(Mode.PIECEWISE,), sizes=(4,), size_symbol="N", warmup_iters=3,
                                               atol=0.5, rtol=0.0, barrier_timeout_s=60.0)
        assert plan.segments == PLAN.segments and plan.name == PLAN.name

    def test_reads_a_vllm_config_object_as_resolved(self):
        config = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(cudagraph_mode="FULL_AND_PIECEWISE",
                                                     cudagraph_capture_sizes=[1, 2, 4, 8],
                                                     max_cudagraph_capture_size=8, mode=3),
            scheduler_config=types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=64),
            num_speculative_tokens=0, use_v2_model_runner=False)
        plan = planned(config, attention_support="ALWAYS")
        assert plan.runner == "v1" and plan.summary() == "target PIECEWISE=4 (largest 8), target FULL=3 (largest 4)"
        assert plan.unknowns and not any("attention backends" in u for u in plan.unknowns)

    def test_importing_the_integration_imports_neither_vllm_nor_torch(self):
        code = ("import sys, graphflow.integrations.vllm; "
                "sys.exit(sorted(m for m in ('vllm', 'torch') if m in sys.modules) or 0)")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
        assert result.returncode == 0, result.stderr
