"""Greedy multi-step decode through graphflow's runtime and eagerly, side by side.

The pipeline's verify phase compares one step per descriptor. A decode compounds
steps: each step's argmax is the next step's token, and every step writes the KV and
compressed caches that later steps read, so a replay that is wrong in any bit of state
shows up as a different token sequence. ``decode_both`` runs the same greedy decode
through ``Runner`` (replaying the captured step) and through the plan's segments run
eagerly on a private copy of every buffer, from identical state.

Each step supplies the positions twice, as an engine's scheduler would: on the device
(``positions``, which the graphs read) and, when the plan declares it, on the host
(``positions_host``, which the eager attention sizes its work from without a sync).
"""

from __future__ import annotations

import attrs
import torch

from graphflow.runtime import Runner

__all__ = ["DecodeTrace", "decode_both", "step_inputs"]


@attrs.frozen
class DecodeTrace:
    """The tokens [steps, B] fed at each step and the logits [steps, B, vocab] it produced."""

    tokens: torch.Tensor
    logits: torch.Tensor


def step_inputs(names: tuple[str, ...], tokens: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, ...]:
    """One step's inputs in ``names`` order: tokens [B], positions [B] on tokens' device and on the host."""
    host = torch.tensor(positions, dtype=torch.int64)
    by_name = {"tokens": tokens, "positions": host.to(tokens.device), "positions_host": host}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise ValueError(f"the dsv4 decode supplies tokens, positions and positions_host, not {missing}")
    return tuple(by_name[n] for n in names)


def decode_both(engine, size: int, steps: int, *, seed: int = 0) -> tuple[DecodeTrace, DecodeTrace]:
    """Decode ``steps`` tokens for ``size`` sequences from position 0: (replayed, eager)."""
    views = {name: tensor.clone() for name, tensor in engine.buffers.views(size).items()}
    eager_calls = engine.eager_calls(size, views)
    runner = Runner(engine)
    vocab = views["logits"].shape[-1]
    device = views["tokens"].device
    generator = torch.Generator().manual_seed(seed)
    first = torch.randint(0, vocab, (size,), generator=generator).to(device)
    replayed, eager = [], []
    for feed, run in ((replayed, lambda inputs: runner.run(*inputs)[0]),
                      (eager, lambda inputs: _eager_step(views, eager_calls, runner.inputs, inputs))):
        tokens = first
        for step in range(steps):
            logits = run(step_inputs(runner.inputs, tokens, [step] * size)).clone()
            feed.append((tokens, logits))
            tokens = logits.argmax(dim=-1)
    return tuple(DecodeTrace(torch.stack([t for t, _ in f]), torch.stack([l for _, l in f]))
                 for f in (replayed, eager))


def _eager_step(views, calls, names: tuple[str, ...], inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    for name, value in zip(names, inputs):
        views[name].copy_(value)
    for call in calls:
        call()
    return views["logits"]
