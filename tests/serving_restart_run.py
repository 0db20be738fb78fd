"""One process of tests/cuda/test_cuda_hf_serving_restart.py: a server that saves its FULL
keys, or a new one that serves from them (run as ``python -m tests.serving_restart_run
ROLE DIRECTORY``; prints one JSON line).

* ``save``: the engine's eager tokens, then graphflow's foreground serve; once the capture
  thread has every key, ``save_graphs(DIRECTORY)``;
* ``restore``: ``serve(manager, graphs_from=DIRECTORY)``, the same requests;
* ``changed``: the same with another cache size (another serving plan): refused in one line.
"""

from __future__ import annotations

import json
import pathlib
import sys

import attrs
import torch

from graphflow.integrations.hf.batching import serve
from tests.cuda.test_cuda_hf_serving import _model, batching, generate


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in torch.randint(3, 90, (12,), generator=generator)]
    return [[int(t) for t in torch.randint(3, 2000, (n,), generator=generator)] for n in lengths]


def main(role: str, directory: pathlib.Path) -> dict:
    model, prompts = _model(), _prompts()
    if role == "save":
        eager, _ = generate(model, prompts, batching())
        saved = {}

        def save(serving) -> None:
            assert serving.wait_captured(120), serving.report()
            saved.update(attrs.asdict(serving.save_graphs(directory)))

        # Every FULL key captured before serving: saved whether or not a step asked for it.
        tokens, serving = generate(model, prompts, batching(), attach=lambda m: serve(m, full_in_background=False),
                                   after=save)
        return {"eager": eager, "tokens": tokens, "saved": saved, "report": serving.report()}
    config = batching(num_blocks=96) if role == "changed" else batching()
    tokens, serving = generate(model, prompts, config, attach=lambda manager: serve(manager, graphs_from=directory))
    return {"tokens": tokens, "restart": attrs.asdict(serving.restart), "checks": attrs.asdict(serving.checks),
            "report": serving.report()}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], pathlib.Path(sys.argv[2]))))
