"""graphflow under ``transformers serve`` (``graphflow.integrations.hf.batching.server``),
on the CPU backend.

* the hook, in this process: a manager started after ``install`` is served by graphflow
  with the engine's own tokens, logs its coverage when it stops, and is given back; a
  manager graphflow cannot serve is marked dead with why (so the server answers 503, not a
  request that waits forever); ``uninstall`` puts transformers' methods back;
* on the CPU backend, which captures no graph, a foreground install serves at once
  (lazily), whatever the number of keys;
* the entry point: a bad ``GRAPHFLOW_SERVE`` and a missing ``--continuous-batching`` are one
  line and exit 2, said before transformers is imported;
* the server (slow): transformers' own ``transformers serve`` and the entry point, in both
  capture modes, each a subprocess on loopback with a tiny random Llama saved with a local
  tokenizer; six concurrent greedy chat completions over HTTP give the same texts on all
  three, the graphflow servers say first what they start, log that they serve and, when
  stopped by a signal, their coverage, with steps on graphs, and exit by themselves with
  the signal's status (130 after SIGINT, 143 after SIGTERM) (``tests/hf_server_run.py``'s
  ``compare_servers``); and the GPU test's comparison (tests/cuda/test_cuda_hf_server.py:
  its 4-layer model, 1,016 words, settings and two rounds) on the CPU, with 16 requests.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from graphflow.integrations.hf.batching import server
from tests.hf_server_run import COVERAGE, WORDS, compare_servers, llama, prompts

PROMPTS = ["hello world", "the cat sat on the mat", "how are you", "a dog", "w5 w17 w99 w3 w42 w8 w61",
           "you are the dog on the mat hello"]
MAX_TOKENS = 12


# -- the hook, in this process -------------------------------------------------------------

def _session(model) -> dict[str, list[int]]:
    """One manager's whole life, as the server drives it: made, started, fed, stopped."""
    gen = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=3)
    cb = ContinuousBatchingConfig(block_size=16, num_blocks=32, max_batch_tokens=32, max_requests_per_batch=4)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    g = torch.Generator().manual_seed(1)
    manager.add_requests([[int(t) for t in torch.randint(4, len(WORDS), (n,), generator=g)] for n in (5, 9, 3, 14)],
                         max_new_tokens=MAX_TOKENS)
    results = {}
    for _ in range(4):
        result = manager.get_result(timeout=60)
        results[result.request_id] = result.generated_tokens
    manager.stop(block=True)
    return results


@pytest.fixture
def restored():
    """Whatever a test installs is uninstalled, and transformers' methods are its own again."""
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
    )

    own = ContinuousBatchingManager.start, ContinuousBatchingManager.stop
    yield
    if server._installed is not None:
        server._installed.uninstall()
    assert (ContinuousBatchingManager.start, ContinuousBatchingManager.stop) == own


@pytest.mark.parametrize("lazy", [False, True], ids=["foreground", "lazy"])
def test_install_serves_every_manager_started(restored, caplog, lazy):
    model = llama()
    expected = _session(model)
    installed = server.install(lazy=lazy)
    with pytest.raises(RuntimeError, match="already installed"):
        server.install()
    with caplog.at_level(logging.INFO, logger="graphflow.serving"):
        got = _session(model)
    assert got == expected
    assert installed.serving == {}  # closed at stop
    assert "graphflow serves llama-serving" in caplog.text
    steps = COVERAGE.search(caplog.text)
    assert steps is not None, caplog.text
    assert int(steps[2]) > 0
    if not lazy and torch.cuda.is_available():  # the keys covering every batch were captured before the first step
        assert steps[1] == steps[2]
    installed.uninstall()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="graphflow.serving"):
        assert _session(model) == expected
    assert "graphflow" not in caplog.text


def test_on_the_cpu_backend_a_foreground_install_serves_at_once(restored, caplog):
    """The CPU backend captures no graph: capturing each of docs/serving.md's 256 keys
    before the first step (each one run, recorded and checked) answered no request for
    minutes. There the manager is served lazily, and says why."""
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: the CPU backend is the one served lazily")
    server.install(lazy=False)
    gen = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=3)
    cb = ContinuousBatchingConfig(block_size=256, num_blocks=512, max_batch_tokens=2048)
    model = llama()
    model.config.max_position_embeddings = 4096  # as a real model's: the keys are the padding's, hundreds
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    began = time.monotonic()
    with caplog.at_level(logging.INFO, logger="graphflow.serving"):
        manager.start()
        try:
            manager.add_requests([[5, 6, 7], [8, 9]], max_new_tokens=MAX_TOKENS)
            for _ in range(2):
                assert manager.get_result(timeout=60) is not None
            answered_s = time.monotonic() - began
        finally:
            manager.stop(block=True)
    served = re.search(r"graphflow serves llama-serving: (\d+) keys, captured in the background", caplog.text)
    assert served is not None and int(served[1]) >= 256, caplog.text
    assert "the CPU backend captures no graph" in caplog.text
    assert answered_s < 60


def test_with_a_graphs_directory_a_stopping_manager_saves_and_a_failed_save_is_said(restored, caplog, tmp_path):
    """``install(graphs=DIR)`` (``GRAPHFLOW_GRAPHS``): each manager saves its FULL keys'
    graphs there when it stops, and a foreground one serves from them once a server saved
    some. The CPU records no graph: the save is refused, said in one line, and the manager
    stops and is given back as without; with nothing saved, nothing is served from there."""
    installed = server.install(lazy=True, graphs=tmp_path / "graphs")
    model = llama()
    with caplog.at_level(logging.INFO, logger="graphflow.serving"):
        tokens = _session(model)
    assert len(tokens) == 4 and not installed.serving
    assert (f"graphflow: the graphs were not saved to {tmp_path / 'graphs'}: save_graphs: saving graphs needs graphs "
            "recorded on a GPU; this engine runs on cpu") in caplog.text
    assert "graphflow coverage of" in caplog.text
    assert not (tmp_path / "graphs").exists()
    assert not server._holds_graphs(str(tmp_path / "graphs"))
    (tmp_path / "graphs").mkdir()
    (tmp_path / "graphs" / "manifest.json").write_text("{}")
    assert server._holds_graphs(str(tmp_path / "graphs"))


def test_a_manager_graphflow_cannot_serve_is_marked_dead(restored):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: the cuda backend is what cannot serve here")
    server.install(backend="cuda")
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=3)
    manager = llama().init_continuous_batching(
        generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(block_size=16, num_blocks=16, max_batch_tokens=16))
    with pytest.raises(ValueError, match="cuda backend needs a CUDA GPU"):
        manager.start()
    assert not manager.is_running()
    assert "cuda backend" in str(manager.background_thread_status.fatal_error)


# -- the entry point's refusals ------------------------------------------------------------

@pytest.mark.parametrize(("env", "argv", "message"), [
    ("Lazy", ["model", "--continuous-batching"], "GRAPHFLOW_SERVE='Lazy': expected one of lazy, foreground"),
    ("foreground", ["model"], "add --continuous-batching"),
    ("lazy", ["model", "--continuous-batching", "--no-continuous-batching"], "add --continuous-batching"),
])
def test_entry_point_refuses(restored, monkeypatch, capsys, env, argv, message):
    monkeypatch.setenv(server.ENV, env)
    with pytest.raises(SystemExit) as exited:
        server.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert server._installed is None


def test_entry_point_refuses_before_transformers_is_imported():
    """transformers (and the model) take seconds to load, many on a busy machine: a refusal
    must not wait for them."""
    code = ("import runpy, sys\n"
            "sys.argv = ['server', 'model']\n"
            "try:\n"
            "    runpy.run_module('graphflow.integrations.hf.batching.server', run_name='__main__')\n"
            "except SystemExit as exit:\n"
            "    assert 'transformers' not in sys.modules, 'transformers was imported'\n"
            "    raise\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("add --continuous-batching to the serve arguments")


# -- the server ------------------------------------------------------------------------------

@pytest.mark.slow
def test_transformers_serve_with_graphflow(tmp_path):
    """Six concurrent chats on the tiny model, on the three servers (tests/hf_server_run.py)."""
    compare_servers(tmp_path, serve_args=["--continuous-batching", "--attn-implementation", "sdpa", "--device", "cpu",
                                          "--cb-block-size", "16", "--cb-num-blocks", "32",
                                          "--cb-max-batch-tokens", "32"],
                    questions=PROMPTS, max_tokens=MAX_TOKENS)


@pytest.mark.slow
def test_the_gpu_server_comparison_on_the_cpu(tmp_path):
    """tests/cuda/test_cuda_hf_server.py's comparison (its model, vocabulary, settings and
    two rounds) with ``--device cpu`` and fewer requests: its wiring, proven without a GPU."""
    from tests.cuda import test_cuda_hf_server as gpu

    print(compare_servers(tmp_path, serve_args=gpu.serve_args("cpu"),
                          questions=prompts(16, gpu.WORDS, least=4, most=40, seed=1), max_tokens=gpu.MAX_TOKENS,
                          words=gpu.WORDS, config=gpu.MODEL, rounds=("cold", "warm")))
