"""What the decode benchmarks share: timing a step, and keeping one failed part from ending a run."""

from __future__ import annotations

import time
import traceback

import torch

__all__ = ["guard", "sync", "time_ms"]


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_ms(step, iters: int, warmup: int = 3) -> float:
    """Milliseconds per call, synchronized around the timed loop only."""
    for _ in range(warmup):
        step()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - start) * 1e3 / iters


def guard(record: dict, key: str, measure) -> None:
    """``record[key] = measure()``; a failure is recorded under ``errors`` instead of ending the run."""
    try:
        record[key] = measure()
    except Exception as exc:  # noqa: BLE001 - one failed measurement must not lose the others
        traceback.print_exc()
        record.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:800]
