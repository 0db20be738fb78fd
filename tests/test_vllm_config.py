"""vLLM's compilation config mapped onto a plan's capture settings (no vLLM needed)."""

from __future__ import annotations

import enum
import subprocess
import sys
import types

import pytest

from graphflow.errors import PlanError
from graphflow.integrations.vllm import VLLM_MODES, plan_from_vllm_config
from graphflow.plan import CaptureSettings, Mode, Plan, Segment, SegmentKind

PLAN = Plan(
    "decode",
    segments=[Segment("step", SegmentKind.GRAPH, "forward")],
    capture=CaptureSettings(modes=(Mode.PIECEWISE,), sizes=(1, 2), size_symbol="N", warmup_iters=3, atol=0.5),
)
VLLM_DEFAULT_512 = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))


def mapped(config, **kwargs) -> CaptureSettings:
    return plan_from_vllm_config(config, model_plan=PLAN, **kwargs).capture


class TestModes:
    @pytest.mark.parametrize("mode, modes", [
        ("PIECEWISE", (Mode.PIECEWISE,)),
        ("FULL", (Mode.FULL,)),
        ("FULL_DECODE_ONLY", (Mode.FULL,)),
        ("FULL_AND_PIECEWISE", (Mode.PIECEWISE, Mode.FULL)),
        ("full_and_piecewise", (Mode.PIECEWISE, Mode.FULL)),
    ])
    def test_each_mode_captures_what_vllm_captures_for_a_decode_step(self, mode, modes):
        capture = mapped({"cudagraph_mode": mode, "cudagraph_capture_sizes": [4, 1]})
        assert (capture.modes, capture.sizes) == (modes, (1, 4))

    def test_none_captures_nothing(self):
        capture = mapped({"cudagraph_mode": "NONE", "cudagraph_capture_sizes": [4, 1]})
        assert (capture.modes, capture.sizes) == ((), ())

    def test_unset_mode_is_vllms_default_full_and_piecewise(self):
        assert mapped({"cudagraph_capture_sizes": [8]}).modes == (Mode.PIECEWISE, Mode.FULL)

    def test_a_cudagraph_mode_enum_member_is_read_by_name(self):
        class CUDAGraphMode(enum.Enum):
            NONE = 0
            PIECEWISE = 1
            FULL = 2
            FULL_DECODE_ONLY = (2, 0)

        capture = mapped({"cudagraph_mode": CUDAGraphMode.FULL_DECODE_ONLY, "cudagraph_capture_sizes": [2]})
        assert capture.modes == (Mode.FULL,)

    @pytest.mark.parametrize("mode", ["FULL_AND_EAGER", "", 3])
    def test_unknown_modes_are_rejected_listing_the_known_ones(self, mode):
        with pytest.raises(PlanError) as info:
            mapped({"cudagraph_mode": mode, "cudagraph_capture_sizes": [1]})
        assert info.value.element == "cudagraph_mode"
        assert info.value.message == (f"unknown vLLM cudagraph_mode {mode!r}: expected one of NONE, PIECEWISE, "
                                      "FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE")

    def test_the_table_covers_every_vllm_mode(self):
        assert list(VLLM_MODES) == ["NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]


class TestSizes:
    def test_explicit_sizes_are_deduplicated_and_sorted(self):
        assert mapped({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [16, 1, 8, 1]}).sizes == (1, 8, 16)

    def test_maximum_alone_gives_vllms_default_list_cut_at_it(self):
        assert mapped({"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 512}).sizes == VLLM_DEFAULT_512
        assert mapped({"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 20}).sizes == (1, 2, 4, 8, 16)
        assert mapped({"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 300}).sizes[-3:] == (256, 272, 288)

    def test_the_512_size_default_has_51_sizes(self):
        # 3 + 31 multiples of 8 below 256 + 17 multiples of 16 from 256 (older vLLM stepped by 8: 67 sizes)
        assert len(mapped({"cudagraph_mode": "PIECEWISE", "max_cudagraph_capture_size": 512}).sizes) == 51

    def test_maximum_derived_from_max_num_seqs_and_speculative_tokens(self):
        capture = mapped({"cudagraph_mode": "FULL"}, max_num_seqs=16, num_speculative_tokens=1)
        assert capture.sizes == (1, 2, 4, *range(8, 65, 8))  # min(16 * 2 * 2, 512) = 64
        assert mapped({"cudagraph_mode": "FULL"}, max_num_seqs=1024).sizes == VLLM_DEFAULT_512

    def test_max_num_batched_tokens_drops_larger_sizes(self):
        capture = mapped({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 64, 128]}, max_num_batched_tokens=100)
        assert capture.sizes == (1, 64)
        capture = mapped({"cudagraph_mode": "FULL", "max_cudagraph_capture_size": 512}, max_num_batched_tokens=16)
        assert capture.sizes == (1, 2, 4, 8, 16)

    def test_inconsistent_maximum_is_refused_as_vllm_does(self):
        with pytest.raises(PlanError) as info:
            mapped({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 8], "max_cudagraph_capture_size": 16})
        assert (info.value.element, info.value.message) == (
            "max_cudagraph_capture_size",
            "max_cudagraph_capture_size (16) must equal the largest of cudagraph_capture_sizes (8), as vLLM requires")

    def test_consistent_maximum_is_accepted(self):
        config = {"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [8, 1], "max_cudagraph_capture_size": 8}
        assert mapped(config).sizes == (1, 8)

    def test_without_sizes_maximum_or_max_num_seqs_it_says_what_to_give(self):
        with pytest.raises(PlanError) as info:
            mapped({"cudagraph_mode": "PIECEWISE"})
        assert info.value.element == "cudagraph_capture_sizes"
        assert "pass max_num_seqs" in info.value.message

    @pytest.mark.parametrize("config, element", [
        ({"cudagraph_capture_sizes": []}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": "1,2"}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": [1, 0]}, "cudagraph_capture_sizes"),
        ({"cudagraph_capture_sizes": [1, True]}, "cudagraph_capture_sizes"),
        ({"max_cudagraph_capture_size": 0}, "max_cudagraph_capture_size"),
    ])
    def test_bad_sizes_are_rejected(self, config, element):
        with pytest.raises(PlanError) as info:
            mapped({"cudagraph_mode": "FULL", **config})
        assert info.value.element == element


class TestPlan:
    def test_only_modes_and_sizes_change(self):
        plan = plan_from_vllm_config({"cudagraph_mode": "FULL", "cudagraph_capture_sizes": [4]}, model_plan=PLAN)
        assert plan.capture == CaptureSettings((Mode.FULL,), (4,), "N", 3, 0.5, 0.0, 60.0)
        assert plan.segments == PLAN.segments and plan.name == PLAN.name
        assert PLAN.capture.sizes == (1, 2)

    def test_reads_a_compilation_config_object(self):
        config = types.SimpleNamespace(cudagraph_mode="PIECEWISE", cudagraph_capture_sizes=[2, 1],
                                       max_cudagraph_capture_size=2)
        assert mapped(config).sizes == (1, 2)

    def test_reads_a_vllm_config_object_with_its_scheduler_and_speculative_configs(self):
        config = types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=None,
                                                     max_cudagraph_capture_size=None),
            scheduler_config=types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=8192),
            speculative_config=types.SimpleNamespace(num_speculative_tokens=3),
        )
        capture = mapped(config)
        assert (capture.modes, capture.sizes) == ((Mode.FULL,), (1, 2, 4, 8, 16, 24, 32))  # min(4 * 4 * 2, 512)

    def test_importing_the_integration_imports_neither_vllm_nor_torch(self):
        code = ("import sys, graphflow.integrations.vllm; "
                "sys.exit(sorted(m for m in ('vllm', 'torch') if m in sys.modules) or 0)")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).parents[1])})
        assert result.returncode == 0, result.stderr
