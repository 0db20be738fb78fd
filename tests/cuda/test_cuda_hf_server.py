"""``transformers serve`` on the GPU, with graphflow and without (``tests/hf_server_run.py``'s
``compare_servers``): a local random model directory (a Llama saved with ``save_pretrained``
and a word-level tokenizer with a chat template, nothing downloaded), 64 concurrent greedy
chat completions over HTTP, twice (the graphs a lazy server captured in the first round
serve the second), on:

* plain ``transformers serve --continuous-batching`` (its engine eager: with SDPA's mask it
  captures no graph by default);
* graphflow's entry point, ``GRAPHFLOW_SERVE=lazy`` and ``foreground``, the same arguments.

Every answer comes back, the texts are the plain server's in both rounds, and the graphflow
servers, stopped by a signal, exit by themselves and log their coverage with steps on
graphs (foreground: every step). The model is float32: the servers batch the same requests
differently (their arrival differs), and bf16 sums in another order at another batch size
can flip a near tie in a random model's greedy token; float32 leaves the texts to the
wiring. p50/p99 latency per server and round, and the coverage, are printed and written to
``$OUT/hf_server.txt`` when ``OUT`` is set.

The GPU image lacks the server's packages (fastapi, uvicorn, openai, pydantic):
``bash scripts/serving_wheels.sh`` here, carry ``.whl``, and scripts/gpu_check.sh installs them.
Its CPU twin, the same call with ``--device cpu``, is tests/test_hf_server.py's
``test_the_gpu_server_comparison_on_the_cpu``.
"""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.hf_server_run import compare_servers, prompts

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

transformers = pytest.importorskip("transformers")

REQUESTS = int(os.environ.get("GRAPHFLOW_SERVER_REQUESTS", "64"))
MAX_TOKENS = 32
#: A word-level vocabulary of about a thousand words, so that texts differ.
WORDS = ["<unk>", "<s>", "</s>", "<pad>", *(f"w{i}" for i in range(1000)),
         "the", "a", "cat", "dog", "sat", "on", "mat", "hello", "world", "how", "are", "you"]
MODEL = {"vocab_size": len(WORDS), "hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 1024,
         "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3}


def serve_args(device: str) -> list[str]:
    """Small on purpose: 256 batch tokens (the query padded to 64: 4 sizes), 256 blocks of 32
    (the KV read pads to the cache's 8192 pages), 1024 positions: a plan of a few keys."""
    return ["--continuous-batching", "--attn-implementation", "sdpa", "--device", device, "--dtype", "float32",
            "--cb-block-size", "32", "--cb-num-blocks", "256", "--cb-max-batch-tokens", "256"]


def test_transformers_serve_on_the_gpu_with_and_without_graphflow(tmp_path):
    report = compare_servers(tmp_path, serve_args=serve_args("cuda:0"),
                             questions=prompts(REQUESTS, WORDS, least=4, most=40, seed=1), max_tokens=MAX_TOKENS,
                             words=WORDS, config=MODEL, rounds=("cold", "warm"), all_on_graphs=("foreground",),
                             ready_within_s=300)
    report = f"tests/cuda/test_cuda_hf_server.py, float32, cuda:0: {report}"
    print(report)
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], "hf_server.txt").write_text(report + "\n")
