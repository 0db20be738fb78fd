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
    ("O0", ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192", "-O0"]),
    ("piecewise", ["--max-num-seqs", "64", "--max-num-batched-tokens", "8192",
                   "--compilation-config", '{"cudagraph_mode": "PIECEWISE"}']),
]


def check(capsys, *args):
    status = main(["vllm", "check", "--json", "--", "Qwen/Qwen3-0.6B", *args])
    return status, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case, line", LINES, ids=[c for c, _ in LINES])
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


def test_an_eagle_line_says_the_drafter_is_not_predicted_and_defaults_are_assumed(vllm_world, capsys):
    eagle = json.dumps({"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3})
    status, report = check(capsys, "--max-num-seqs", "300", "--speculative-config", eagle, "-O3")
    assert status == 0 and report["uniform_decode_query_len"] == 4
    assert any(u.startswith("not predicted: drafter graphs (eagle with 3 speculative tokens)")
               for u in report["unknowns"])
    assert any(u.startswith("max_num_batched_tokens: not given") and "assumed 8192" in u for u in report["unknowns"])


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


def test_without_a_gpu_it_plans_with_vllms_parser():
    done = serve_check("--max-num-seqs", "256", "--max-num-batched-tokens", "8192")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "target PIECEWISE: 51 graphs" in done.stdout and "target FULL: 35 graphs" in done.stdout


def test_a_flag_vllm_rejects_is_its_message_and_exit_2():
    done = serve_check("--max-num-seqz", "8")
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == "graphflow: vllm serve: unrecognized arguments: --max-num-seqz 8"
