"""What the decode benchmarks share: timing a step, and keeping one failed part from ending a run."""

from __future__ import annotations

import time
import traceback

import torch

__all__ = ["guard", "sync", "time_ms", "verified_or_not"]


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


def verified_or_not(run):
    """``run(verify)`` with verify on; if verify refuses it (compiled segments beyond the
    plan's tolerance), the refusal recorded and ``run(False)``: the speed is still measured,
    and the table says the capture was not verified. ``(result, notes)``; ``pipeline_s`` in
    the notes is the time of the run returned, ``first_pipeline_s`` that of a refused one."""
    from graphflow.errors import CaptureError
    from graphflow.events import Phase

    start = time.perf_counter()
    try:
        result = run(True)
        return result, {"pipeline_s": time.perf_counter() - start}
    except CaptureError as error:
        if error.phase != Phase.VERIFY.value:
            raise
        notes = {"verify_error": str(error)[:800], "first_pipeline_s": time.perf_counter() - start, "verified": False}
    start = time.perf_counter()
    result = run(False)
    return result, {**notes, "pipeline_s": time.perf_counter() - start}
