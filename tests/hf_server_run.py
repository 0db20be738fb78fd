"""Servers on a local model directory, started and asked over HTTP, for the server tests
(tests/test_hf_server.py on the CPU, tests/cuda/test_cuda_hf_server.py on a GPU).

* ``save_model``: a random Llama and a word-level tokenizer with a chat template, written
  with ``save_pretrained`` into one directory: nothing is downloaded, now or when a server
  loads it (``HF_HUB_OFFLINE=1``);
* ``Server``: one server subprocess on loopback (``transformers serve`` or graphflow's entry
  point, the same arguments), its output in a file;
* ``ask``: concurrent greedy chat completions, one thread a request, each one's text and
  latency;
* ``stop``: a graphflow server stopped by a signal, its exit status and the coverage it
  logged (``N of M steps on graphs``);
* ``compare_servers``: the whole comparison both tests make, on the device the serve
  arguments name: plain ``transformers serve`` and graphflow's entry point in both capture
  modes, started at once on one model directory, each asked the same questions in turn
  (``rounds`` times), the texts compared, the graphflow servers stopped by a signal and
  their coverage read; it returns the report (latencies per server and round, coverage).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import os
import pathlib
import re
import signal
import socket
import statistics
import subprocess
import sys
import time

import attrs
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: A tokenizer's words: special tokens first (ids 0-3), then plain words.
WORDS = ["<unk>", "<s>", "</s>", "<pad>", *(f"w{i}" for i in range(120)),
         "the", "a", "cat", "dog", "sat", "on", "mat", "hello", "world", "how", "are", "you"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + ' ' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")
#: A tiny Llama over ``WORDS``; a large ``initializer_range`` spreads its logits, so greedy
#: tokens do not hang on near ties.
MODEL = {"vocab_size": len(WORDS), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
         "initializer_range": 0.3, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}
COVERAGE = re.compile(r"(\d+) of (\d+) steps on graphs")
#: What ``transformers serve`` and these tests need beyond the CPU suite.
SERVING_DEPENDENCIES = ("fastapi", "uvicorn", "openai", "pydantic", "accelerate", "requests", "httpx")
ENTRY = ("-m", "graphflow.integrations.hf.batching.server")


def missing_dependencies() -> list[str]:
    return [name for name in SERVING_DEPENDENCIES if importlib.util.find_spec(name) is None]


def llama(config: dict = MODEL):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def save_model(path, words: list[str] = WORDS, config: dict = MODEL) -> pathlib.Path:
    """The model (``config``, random weights, float32) and a word-level tokenizer over
    ``words`` with ``CHAT_TEMPLATE``, saved into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    assert config["vocab_size"] == len(words), "one embedding row per word"
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # words joined by spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    model = llama(config)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return pathlib.Path(path)


def prompts(count: int, words: list[str] = WORDS, least: int = 3, most: int = 40, seed: int = 0) -> list[str]:
    """``count`` prompts of plain words (no special token), lengths drawn in ``[least, most]``."""
    import random

    plain = [w for w in words if not w.startswith("<")]
    draw = random.Random(seed)
    return [" ".join(draw.choices(plain, k=draw.randint(least, most))) for _ in range(count)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def environment(**extra: str) -> dict[str, str]:
    """The servers' environment: offline, unbuffered, this checkout importable."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{ROOT}{os.pathsep}{path}" if path else str(ROOT), **extra}


def serve_command(graphflow: bool) -> list[str]:
    """graphflow's entry point, or plain ``transformers serve``; the serve arguments follow."""
    return [sys.executable, *ENTRY] if graphflow else [sys.executable, "-m", "transformers.cli.transformers", "serve"]


@attrs.define
class Answers:
    """One round of concurrent requests to one server: texts and latencies in request order."""

    texts: list[str]
    latencies_s: list[float]
    wall_s: float

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]

    def summary(self) -> str:
        return (f"{len(self.texts)} answers in {self.wall_s:.2f} s, latency p50 {self.quantile(0.5) * 1e3:.0f} ms, "
                f"p99 {self.quantile(0.99) * 1e3:.0f} ms, mean {statistics.fmean(self.latencies_s) * 1e3:.0f} ms")


class Server:
    """One server subprocess on loopback, its output in a file (a pipe left unread would block it)."""

    def __init__(self, name: str, command: list[str], env: dict, log_path) -> None:
        self.name, self.port, self.log_path = name, free_port(), pathlib.Path(log_path)
        self._log = open(self.log_path, "w")  # noqa: SIM115 - the process writes it until kill() closes it
        # As from a terminal, Ctrl-C's signal acts: a runner that started the tests in the
        # background (a script's `cmd &`) passes SIGINT on ignored, and the server would
        # then stop on it (uvicorn's own handler) but exit 0.
        self.process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(self.port)], env=env,
                                        cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT,
                                        preexec_fn=_sigint_as_from_a_terminal)

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

    def chat(self, client, prompt: str, max_tokens: int, timeout: float = 300) -> tuple[str, float]:
        began = time.perf_counter()
        response = client.post(f"http://127.0.0.1:{self.port}/v1/chat/completions", timeout=timeout, json={
            "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})
        took = time.perf_counter() - began
        assert response.status_code == 200, (self.name, response.text, self.log()[-3000:])
        return response.json()["choices"][0]["message"]["content"], took

    def ask(self, client, questions: list[str], max_tokens: int) -> Answers:
        """Every question at once (one thread each), greedy."""
        began = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(len(questions)) as pool:
            answered = list(pool.map(lambda q: self.chat(client, q, max_tokens), questions))
        return Answers([text for text, _ in answered], [took for _, took in answered], time.perf_counter() - began)

    def stop(self, sig: signal.Signals, timeout: float = 60) -> tuple[int, str, tuple[int, int] | None]:
        """Send ``sig`` and wait for the process to exit by itself: its status, its whole log
        and the last coverage line's (steps on graphs, steps)."""
        self.process.send_signal(sig)
        status = self.process.wait(timeout=timeout)
        log = self.log()
        found = COVERAGE.findall(log)
        return status, log, (int(found[-1][0]), int(found[-1][1])) if found else None

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._log.close()


def _sigint_as_from_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def coverage_block(log: str) -> str:
    """The coverage a graphflow server logged at its exit: the table to the memory line."""
    start = log.rfind("graphflow coverage of")
    if start < 0:
        return ""
    lines = log[start:].splitlines()
    end = next((i for i, line in enumerate(lines) if line.startswith("graph memory")), len(lines) - 1)
    return "\n".join(lines[: end + 1])


def client(connections: int):
    import httpx

    return httpx.Client(limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))



#: The first line of graphflow's entry point.
START = "[graphflow.serving] graphflow: starting transformers serve"
#: The graphflow servers' stop signals, by capture mode: one of each.
STOPS = {"lazy": signal.SIGTERM, "foreground": signal.SIGINT}


def compare_servers(tmp_path, *, serve_args: list[str], questions: list[str], max_tokens: int, words=WORDS,
                    config=MODEL, rounds: tuple[str, ...] = ("cold",), all_on_graphs: tuple[str, ...] = (),
                    ready_within_s: float = 180) -> str:
    """Plain ``transformers serve`` and graphflow's entry point (``GRAPHFLOW_SERVE`` lazy and
    foreground) on one saved model (``config`` over ``words``) with ``serve_args`` (the
    model directory goes first): every question answered by each, the same texts as the
    plain server's in every round, distinct texts for most questions; each graphflow server
    stopped by a signal exits with 128 and its number, says first what it starts, and logs
    its coverage with steps on graphs (all of them for the modes in ``all_on_graphs``).
    Returns the report: each server's latencies per round and the coverage it logged."""
    from graphflow.integrations.hf.batching import server

    missing = missing_dependencies()
    if missing:
        pytest.fail(f"the server test needs {', '.join(missing)} (here: pip install -e '.[test]'; on the GPU "
                    "machine: scripts/serving_wheels.sh, then carry .whl, which scripts/gpu_check.sh installs)")
    model_dir = save_model(pathlib.Path(tmp_path) / "model", words, config)
    env = environment()
    plain = "transformers serve"
    servers: list[Server] = []
    answers: dict[str, list[Answers]] = {}
    began = time.monotonic()
    try:
        # All three start at once (most of a start is importing torch and transformers); each
        # is then asked alone, the others idle.
        servers.append(Server(plain, [*serve_command(False), str(model_dir), *serve_args], env,
                              pathlib.Path(tmp_path) / "plain.log"))
        for mode in server.MODES:
            servers.append(Server(f"graphflow {mode}", [*serve_command(True), str(model_dir), *serve_args],
                                  {**env, server.ENV: mode}, pathlib.Path(tmp_path) / f"{mode}.log"))
        with client(2 * len(questions)) as http:
            for each in servers:
                each.wait_ready(http, began + ready_within_s)
            ready_s = time.monotonic() - began
            for each in servers:
                answers[each.name] = [each.ask(http, questions, max_tokens) for _ in rounds]

        reference = answers[plain]
        for got in reference:
            assert len(got.texts) == len(questions) and all(got.texts), got.texts
        # Most questions lead to texts of their own: the comparison means something.
        assert len(set(reference[0].texts)) > len(questions) // 2, reference[0].texts
        for name, rounds_got in answers.items():
            for wave, got, expected in zip(rounds, rounds_got, reference):
                differing = [i for i, (a, b) in enumerate(zip(got.texts, expected.texts)) if a != b]
                assert not differing, (f"{name}, {wave} round: {len(differing)} of {len(questions)} texts differ from "
                                       f"{plain}'s, first question {differing[0]}: {got.texts[differing[0]]!r} != "
                                       f"{expected.texts[differing[0]]!r}")

        coverage = {}
        for each, mode in zip(servers[1:], server.MODES):
            stop = STOPS[mode]
            status, log, steps = each.stop(stop)  # it stops transformers' manager, so it exits by itself
            assert status == 128 + stop, f"{each.name} exited with status {status}:\n{log[-5000:]}"
            # It says what it starts first, before transformers and the model load (a warning
            # of torch's import may come before it).
            said = log.find(START)
            assert said >= 0 and "transformers" not in log[:said] and "graphflow" not in log[:said], log[:2000]
            assert "[graphflow.serving] graphflow serves llama-serving" in log, log[-5000:]
            assert "[graphflow.serving] graphflow coverage of llama-serving" in log, log[-5000:]
            assert steps is not None and steps[0] > 0, log[-5000:]
            if mode in all_on_graphs:  # the keys covering every batch captured before the first step
                assert steps[0] == steps[1], coverage_block(log)
            coverage[each.name] = (steps, coverage_block(log))
        assert "graphflow" not in servers[0].log()
    finally:
        for each in servers:
            each.kill()

    lines = [(f"{len(questions)} concurrent greedy chat completions of up to {max_tokens} tokens, "
              f"{len(rounds)} round(s); a random Llama ({config['num_hidden_layers']} layers, hidden "
              f"{config['hidden_size']}, vocab {config['vocab_size']}); serve arguments: {' '.join(serve_args)}; "
              f"the three servers ready after {ready_s:.1f} s")]
    for name, got in answers.items():
        for wave, one in zip(rounds, got):
            lines.append(f"{name:22} {wave}: {one.summary()}")
    for name, ((on_graphs, steps), block) in coverage.items():
        lines += [f"{name}: {on_graphs} of {steps} steps on graphs", block]
    return "\n".join(lines)
