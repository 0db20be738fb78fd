"""Greedy multi-step decode through graphflow's runtime and eagerly, side by side.

The pipeline's verify phase compares one step per descriptor. A decode compounds
steps: each step's argmax is the next step's token, and every step writes the KV and
compressed caches that later steps read, so a replay that is wrong in any bit of state
shows up as a different token sequence. ``decode_both`` runs the same greedy decode
through ``Runner`` (replaying the captured step) and through the plan's segments run
eagerly on a private copy of every buffer, from identical state.
"""

from __future__ import annotations

import attrs
import torch

from graphflow.runtime import Runner

__all__ = ["DecodeTrace", "decode_both"]


@attrs.frozen
class DecodeTrace:
    """The tokens [steps, B] fed at each step and the logits [steps, B, vocab] it produced."""

    tokens: torch.Tensor
    logits: torch.Tensor


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
    for feed, run in ((replayed, lambda tok, pos: runner.run(tok, pos)[0]),
                      (eager, lambda tok, pos: _eager_step(views, eager_calls, tok, pos))):
        tokens = first
        for step in range(steps):
            positions = torch.full((size,), step, dtype=torch.int64, device=device)
            logits = run(tokens, positions).clone()
            feed.append((tokens, logits))
            tokens = logits.argmax(dim=-1)
    return tuple(DecodeTrace(torch.stack([t for t, _ in f]), torch.stack([l for _, l in f]))
                 for f in (replayed, eager))


def _eager_step(views, calls, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    views["tokens"].copy_(tokens)
    views["positions"].copy_(positions)
    for call in calls:
        call()
    return views["logits"]
