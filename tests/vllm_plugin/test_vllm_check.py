"""``graphflow vllm check`` against vLLM's real ``vllm serve`` parser.

Its graph counts must be those of the engine objects vLLM itself builds for the same
settings (``test_descriptors.py``'s cases: the real V2 ``CudaGraphManager`` of the
post-init config). In this process the platform is the H100 stand-in; a run in a fresh
process has no GPU at all, which is the command's usual situation.
"""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

pytest.importorskip("vllm")

import test_descriptors as cases  # noqa: E402
from standins import TINY_MODELS  # noqa: E402

from graphflow.cli import main  # noqa: E402

NGRAM_2 = json.dumps({**cases.NGRAM, "num_speculative_tokens": 2})
# (test_descriptors case, the same settings as 'vllm serve' arguments)
LINES = [
    ("default-256", ["--max-num-seqs", "256", "--max-num-batched-tokens", "8192"]),
    ("spec-2", ["--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--speculative-config", NGRAM_2]),
    ("spec-2", ["--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--spec-method", "ngram", "--spec-tokens", "2",
                "--speculative-config", '{"prompt_lookup_max": 3, "prompt_lookup_min": 1}']),
    ("O0", ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192", "-O0"]),
    ("piecewise", ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192",
                   "--compilation-config", '{"cudagraph_mode": "PIECEWISE"}']),
]


def check(capsys, *args):
    status = main(["vllm", "check", "--json", "--", "Qwen/Qwen3-0.6B", *args])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case, line", LINES, ids=[c for c, _ in LINES[:2]] + ["spec-2-flags"] + [c for c, _ in LINES[3:]])
def test_the_counts_are_those_of_vllms_own_engine_objects(vllm_world, capsys, monkeypatch, case, line):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    status, report = check(capsys, *line)
    kwargs = next(c[1] for c in cases.CASES if c[0] == case)
    engine = cases.resolved_engine(cases.harness.engine_config(**kwargs), "v2", "ALWAYS")
    truth = Counter(f"target {mode}" for mode, *_ in cases.vllm_keys(engine))
    assert status == 0 and report["runner"] == "v2"
    assert report["counts"] == dict(truth) and report["graphs"] == sum(truth.values())
    if case == "default-256":
        assert report["counts"] == {"target PIECEWISE": 51, "target FULL": 35}
    if case == "O0":
        assert report["graphs"] == 0 and report["cudagraph_mode"] == "NONE"
    if case == "spec-2":
        assert report["uniform_decode_query_len"] == 3
    assert any(u.startswith("the model's Hugging Face config: not read") for u in report["unknowns"])
    assert report["settings"]["GRAPHFLOW_VLLM_ON_FAILURE"] == "raise"


def test_an_eagle_line_counts_the_drafters_graphs_and_says_the_defaults_are_assumed(vllm_world, capsys):
    eagle = json.dumps({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3})
    status, report = check(capsys, "--max-num-seqs", "300", "--speculative-config", eagle, "-O3")
    assert status == 0 and report["uniform_decode_query_len"] == 4
    assert report["counts"] == {"target PIECEWISE": 51, "target FULL": 49, "drafter PIECEWISE": 51, "drafter FULL": 49
                                + 37}  # the drafter's prefill graphs are the target's; its decode ones q=1, up to 300
    assert not any("drafter" in u for u in report["unknowns"])
    assert any(u.startswith("max_num_batched_tokens: not given") and u.endswith("assumed 8192") for u in report["unknowns"])


def test_a_drafter_vllm_picks_from_the_draft_models_config_is_named_unknown(vllm_world, capsys):
    mtp = json.dumps({"method": "mtp", "num_speculative_tokens": 1})
    status, report = check(capsys, "--max-num-seqs", "64", "--speculative-config", mtp)
    (note,) = [u for u in report["unknowns"] if "drafter" in u]
    assert status == 0 and note.startswith("not predicted: drafter graphs (mtp with 1 speculative tokens), number "
                                           "unknown: vLLM picks the MTP drafter")
    assert set(report["counts"]) == {"target PIECEWISE", "target FULL"}


@pytest.mark.parametrize("model, routed, status", [("moe-tiny", "auto", 1), ("moe-tiny", "none", 0),
                                                   ("llama-tiny", "auto", 0), ("llama-tiny", "target", 1)])
def test_a_local_config_and_the_plugins_settings_reach_the_findings(vllm_world, capsys, monkeypatch, model, routed,
                                                                    status):
    """vLLM's placeholder warmup feeding MoE routing (the config's experts, or GRAPHFLOW_VLLM_ROUTED) is GF503:
    the plugin would refuse the capture."""
    monkeypatch.setenv("GRAPHFLOW_VLLM", "1")
    monkeypatch.setenv("GRAPHFLOW_VLLM_WARMUP", "placeholder")
    monkeypatch.setenv("GRAPHFLOW_VLLM_ROUTED", routed)
    assert main(["vllm", "check", "--hf-config", str(TINY_MODELS / model), "--", "some/model",
                 "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "-tp", "2"]) == status
    out = capsys.readouterr().out
    assert ("GF503" in out and "the plugin would refuse this capture" in out) is (status == 1)
    assert "Hugging Face config: not read" not in out and f"GRAPHFLOW_VLLM_ROUTED={routed}" in out


def serve_check(*args, env=None):
    """The command in a fresh process: no GPU, no stand-ins."""
    return subprocess.run([sys.executable, "-m", "graphflow", "vllm", "check", "--", "Qwen/Qwen3-0.6B", *args],
                          capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)


def test_without_a_gpu_it_plans_with_vllms_parser_and_the_plugin_stays_quiet():
    """vLLM's parser loads the general plugins; the check's own process plans, and the
    plugin (on in the environment, for the settings it prints) neither wraps vLLM there nor
    says it cannot."""
    done = serve_check("--max-num-seqs", "256", "--max-num-batched-tokens", "8192", env={"GRAPHFLOW_VLLM": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "target PIECEWISE: 51 graphs" in done.stdout and "target FULL: 35 graphs" in done.stdout
    assert "  GRAPHFLOW_VLLM=1" in done.stdout.splitlines()
    assert "graphflow[" not in done.stdout + done.stderr and "plugin off" not in done.stderr


def test_a_flag_vllm_rejects_is_its_message_and_exit_2():
    done = serve_check("--max-num-seqz", "8")
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "graphflow: vllm serve: unrecognized arguments: --max-num-seqz 8"


def one_line_error(capsys, *serve_args):
    status = main(["vllm", "check", "--", "Qwen/Qwen3-0.6B", *serve_args])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == "" and "Traceback" not in captured.err
    (line,) = captured.err.splitlines()
    return line


def test_a_value_vllms_parser_fails_on_is_one_line_naming_the_option(vllm_world, capsys):
    """vLLM's own parser lets a KeyError out for an unknown cudagraph mode (``vllm serve``
    prints its traceback and exits 1): the check says which option and what it takes."""
    line = one_line_error(capsys, "-cc", '{"cudagraph_mode": "FULLEST"}')
    assert line == ("graphflow: vllm serve: argument --compilation-config/-cc: invalid value "
                    """'{"cudagraph_mode": "FULLEST"}': unknown CUDAGraphMode 'FULLEST': expected one of NONE, """
                    "PIECEWISE, FULL, FULL_DECODE_ONLY, FULL_AND_PIECEWISE")


@pytest.mark.parametrize("args", [["--speculative-config", '{"method": "suffix"}'], ["--spec-method", "suffix"]],
                         ids=["config", "flag"])
def test_a_speculative_method_vllm_refuses_is_refused_with_its_message(vllm_world, capsys, args):
    """Suffix decoding without its package: vLLM's engine refuses it at start-up (its
    ``SpeculativeConfig``), so the check does, with vLLM's words."""
    from vllm.utils.import_utils import has_arctic_inference

    if has_arctic_inference():
        pytest.skip("Arctic Inference is installed: vLLM accepts suffix decoding here")
    line = one_line_error(capsys, *args)
    assert line == ("graphflow: vllm serve: speculative decoding: Arctic Inference is required for suffix decoding. "
                    "Install via `pip install arctic-inference==0.1.1`.")


@pytest.mark.parametrize("gib, capability, name", [(40, 90, "NVIDIA L40S"), (80, 80, "NVIDIA A100-SXM4-80GB"),
                                                   (80, 90, "NVIDIA H100 80GB HBM3"), (141, 90, "NVIDIA H200"),
                                                   (180, 100, "NVIDIA B200")])
@pytest.mark.parametrize("mode", ["balanced", "throughput"])
def test_the_assumed_batch_defaults_are_those_vllm_picks_for_the_gpu(vllm_world, capsys, monkeypatch, gib, capability,
                                                                     name, mode):
    """``vllm serve``'s defaults (``EngineArgs.get_batch_defaults`` on a platform answering as
    that GPU, doubled in throughput mode) are what the check assumes and says."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.usage.usage_lib import UsageContext

    platform = type(current_platform)
    monkeypatch.setattr(platform, "get_device_total_memory", classmethod(lambda cls, device_id=0: gib << 30))
    monkeypatch.setattr(platform, "get_device_name", classmethod(lambda cls, device_id=0: name))
    tokens, seqs = (d[UsageContext.OPENAI_API_SERVER] for d in EngineArgs.get_batch_defaults(world_size=1))
    if mode == "throughput":
        tokens, seqs = tokens * 2, seqs * 2
    assert main(["vllm", "check", "--json", "--gpu-memory-gib", str(gib), "--device-capability", str(capability),
                 "--", "Qwen/Qwen3-0.6B", "--performance-mode", mode]) == 0
    unknowns = json.loads(capsys.readouterr().out)["unknowns"]
    assert any(u.startswith("max_num_batched_tokens: not given") and u.endswith(f"assumed {tokens}") for u in unknowns)
    assert any(u.startswith("max_num_seqs: not given") and u.endswith(f"assumed {seqs}") for u in unknowns)


def test_the_check_keeps_the_plugin_off_in_its_own_process(vllm_world, capsys, monkeypatch):
    """vLLM's parser loads the general plugins; with ``GRAPHFLOW_VLLM=1`` the plugin would wrap
    vLLM in a process that only plans (and, without a GPU, fail to and say so)."""
    import vllm.plugins

    from graphflow.integrations.vllm import plugin

    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)  # as in a fresh process
    monkeypatch.setenv("VLLM_PLUGINS", "graphflow")
    monkeypatch.setenv("GRAPHFLOW_VLLM", "1")
    try:
        assert main(["vllm", "check", "--", "Qwen/Qwen3-0.6B", "--max-num-seqs", "8"]) == 0
        assert plugin.registered() is None
    finally:
        plugin.unregister()
    assert "  GRAPHFLOW_VLLM=1" in capsys.readouterr().out.splitlines()
