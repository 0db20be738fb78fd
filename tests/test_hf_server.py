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
  the signal's status (130 after SIGINT, 143 after SIGTERM).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

transformers = pytest.importorskip("transformers")

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from graphflow.integrations.hf.batching import server

WORDS = ["<unk>", "<s>", "</s>", "<pad>", *(f"w{i}" for i in range(120)),
         "the", "a", "cat", "dog", "sat", "on", "mat", "hello", "world", "how", "are", "you"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
MODEL = {"vocab_size": len(WORDS), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
         "initializer_range": 0.3, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
PROMPTS = ["hello world", "the cat sat on the mat", "how are you", "a dog", "w5 w17 w99 w3 w42 w8 w61",
           "you are the dog on the mat hello"]
MAX_TOKENS = 12
COVERAGE = re.compile(r"(\d+) of (\d+) steps on graphs")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL)).eval()


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
    model = _model()
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
    if not lazy and torch.cuda.is_available():  # every key was captured before the first step
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
    model = _model()
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


def test_a_manager_graphflow_cannot_serve_is_marked_dead(restored):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA: the cuda backend is what cannot serve here")
    server.install(backend="cuda")
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=3)
    manager = _model().init_continuous_batching(
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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().endswith("add --continuous-batching to the serve arguments")


# -- the server ------------------------------------------------------------------------------

SERVING_DEPENDENCIES = ("fastapi", "uvicorn", "openai", "pydantic", "accelerate", "requests", "httpx")


def _save_model(path) -> None:
    """The tiny Llama and a word-level tokenizer with a chat template, built here: nothing
    is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # words joined by spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    model = _model()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model.save_pretrained(path)
    fast.save_pretrained(path)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Server:
    """One server subprocess, its output in a file (a pipe left unread would block it)."""

    def __init__(self, name: str, command: list[str], env: dict, log_path) -> None:
        self.name, self.port, self.log_path = name, _free_port(), log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the process writes it until kill() closes it
        self.process = subprocess.Popen([*command, "--port", str(self.port)], env=env, stdout=self._log,
                                        stderr=subprocess.STDOUT)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, client, deadline: float) -> None:
        import httpx

        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.process.returncode} before it was ready:\n{self.log()}")
            with contextlib.suppress(httpx.TransportError):  # not listening yet
                if client.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        pytest.fail(f"{self.name} not ready in time:\n{self.log()}")

    def chat(self, client, prompt: str) -> str:
        response = client.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS, "temperature": 0})
        assert response.status_code == 200, (self.name, response.text)
        return response.json()["choices"][0]["message"]["content"]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


@pytest.mark.slow
def test_transformers_serve_with_graphflow(tmp_path):
    missing = [name for name in SERVING_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.fail(f"the server test needs {', '.join(missing)} (the test extra: pip install -e '.[test]')")
    import httpx

    model_dir = tmp_path / "model"
    _save_model(model_dir)
    serve_args = [str(model_dir), "--continuous-batching", "--attn-implementation", "sdpa", "--device", "cpu",
                  "--host", "127.0.0.1", "--cb-block-size", "16", "--cb-num-blocks", "32",
                  "--cb-max-batch-tokens", "32"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1"}
    entry = [sys.executable, "-m", "graphflow.integrations.hf.batching.server", *serve_args]
    servers = []
    try:
        # All three start at once: most of a server's start is importing torch and transformers.
        servers.append(_Server("transformers serve", [sys.executable, "-m", "transformers.cli.transformers", "serve",
                                                      *serve_args], env, tmp_path / "plain.log"))
        for mode in server.MODES:
            servers.append(_Server(f"graphflow {mode}", entry, {**env, server.ENV: mode}, tmp_path / f"{mode}.log"))
        deadline = time.monotonic() + 180
        texts = {}
        with httpx.Client() as client, concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            for each in servers:
                each.wait_ready(client, deadline)
            for each in servers:
                texts[each.name] = list(pool.map(lambda prompt, s=each: s.chat(client, prompt), PROMPTS))
        plain = texts["transformers serve"]
        assert all(plain), plain
        assert len(set(plain)) > 1, plain  # the prompts lead to different texts: the comparison means something
        for mode in server.MODES:
            assert texts[f"graphflow {mode}"] == plain, mode

        for each, stop in zip(servers[1:], (signal.SIGTERM, signal.SIGINT)):
            each.process.send_signal(stop)
            status = each.process.wait(timeout=60)  # it stops transformers' manager, so it exits by itself
            log = each.log()
            assert status == 128 + stop, log
            assert log.startswith("[graphflow.serving] graphflow: starting transformers serve"), log
            assert "[graphflow.serving] graphflow serves llama-serving" in log, log
            assert "[graphflow.serving] graphflow coverage of llama-serving" in log, log
            steps = COVERAGE.search(log)
            assert steps is not None and int(steps[1]) > 0, log
        assert "graphflow" not in servers[0].log()
    finally:
        for each in servers:
            each.kill()
