"""One phase of a run: its block, its begin and end events, and its result.

The pipeline runs each phase once per descriptor (warmup, capture, verify) or once
(allocate, prewarm, commit), and a lazy engine's capture thread runs warmup, capture and
verify itself: both go through ``run_phase``, so every phase is bracketed and timed alike.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable

import attrs

from graphflow.engine.context import Context
from graphflow.events import EventKind, Phase

__all__ = ["Outcome", "PhaseResult", "run_phase", "summarize"]


class Outcome(enum.Enum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@attrs.frozen
class PhaseResult:
    """One phase's outcome and its seconds, summed over the descriptors it ran for
    (pytest's ``CallInfo``)."""

    phase: Phase
    outcome: Outcome
    seconds: float
    error: BaseException | None = attrs.field(default=None, eq=False)


def run_phase(ctx: Context, results: list[PhaseResult], phase: Phase, body: Callable[[], object],
              pool: Callable[[object], int | None] = lambda _: None):
    """``body()`` in the phase's block between PHASE_BEGIN and PHASE_END, recorded in
    ``results``; its value. A body that returns False was skipped (nothing to do, or
    turned off); ``pool`` gives the END event's pool size from the body's result.
    """
    start = time.perf_counter()
    try:
        with ctx.locus.at(phase=phase):
            ctx.emit(EventKind.PHASE_BEGIN, total=len(ctx.descriptors))
            value = body()
            ctx.emit(EventKind.PHASE_END, elapsed_s=time.perf_counter() - start, total=len(ctx.descriptors),
                     pool_bytes=pool(value))
    except BaseException as exc:
        results.append(PhaseResult(phase, Outcome.FAILED, time.perf_counter() - start, exc))
        raise
    results.append(PhaseResult(phase, Outcome.SKIPPED if value is False else Outcome.PASSED,
                               time.perf_counter() - start))
    return value


def summarize(results: list[PhaseResult]) -> tuple[PhaseResult, ...]:
    """One result per phase, in lifecycle order: a phase that ran per descriptor adds up
    its seconds; one that never ran (verify turned off, no descriptor) was skipped, and
    one that only failed (a lazy engine's descriptors all rolled back) failed."""
    summary = []
    for phase in (Phase.ALLOCATE, Phase.WARMUP, Phase.PREWARM, Phase.CAPTURE, Phase.VERIFY, Phase.COMMIT):
        ran = [r for r in results if r.phase is phase]
        outcomes = {r.outcome for r in ran}
        outcome = (Outcome.PASSED if Outcome.PASSED in outcomes else
                   Outcome.FAILED if Outcome.FAILED in outcomes else Outcome.SKIPPED)
        summary.append(PhaseResult(phase, outcome, sum(r.seconds for r in ran)))
    return tuple(summary)
