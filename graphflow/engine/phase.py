"""One phase of a run (its block, its begin and end events, its result), and one
descriptor's phases in order.

The pipeline runs each phase once per descriptor (warmup, capture, verify) or once
(allocate, prewarm, commit), and a lazy engine's capture thread runs warmup, capture and
verify itself: both go through ``run_phase``, so every phase is bracketed and timed alike,
and both run a descriptor through ``run_descriptor``, so the order of its phases (warmup,
prewarm after the run's first, capture, verify) is written once, with which descriptors
warm up and which verify (``Context.warms``, ``Context.verifies``). What differs between
the two is said by ``Hooks``: the thread runs the phases that use the static buffers
under the lock it shares with the serving side, and the pipeline may verify one
descriptor behind.
"""

from __future__ import annotations

import enum
import functools
import time
from collections.abc import Callable

import attrs

from graphflow.engine.allocate import Allocation
from graphflow.engine.capture import Captured, capture, open_capture
from graphflow.engine.context import Context
from graphflow.engine.verify import VerifyResult, verify
from graphflow.engine.warmup import DescriptorTime, Warmed, prewarm, warmup
from graphflow.events import EventKind, Phase
from graphflow.plan import Descriptor

__all__ = ["Hooks", "Outcome", "PhaseResult", "Tally", "Waiting", "run_descriptor", "run_phase", "run_verify",
           "summarize", "warm"]


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


@attrs.define(eq=False)
class Tally:
    """What a run's phases did so far, added to as each phase ends: a descriptor that
    fails half way (the capture thread rolls it back alone and goes on) keeps the times it
    took in the report."""

    phases: list[PhaseResult] = attrs.field(factory=list)
    times: list[DescriptorTime] = attrs.field(factory=list)
    verified: list[VerifyResult] = attrs.field(factory=list)
    #: The JIT registry's ``PrewarmReport``, when the run prewarmed anything.
    prewarm: object | None = None
    #: Per mode, what a pool of its own reserved for the first descriptor's step
    #: (``Warmed.pool_probe_bytes``): the capture pool forecast before any capture.
    pool_probe: dict[str, int] = attrs.field(factory=dict)
    #: A run that saves its graphs: each descriptor's distinct matrix multiplications, as
    #: its capture made them (``graphflow.engine.restart.matmuls``).
    matmuls: dict[Descriptor, tuple] = attrs.field(factory=dict)


@attrs.frozen
class Hooks:
    """How a caller runs each descriptor's phases; the defaults are the pipeline's."""

    #: Wraps a phase that runs the model on the static buffers (warmup, verify, and
    #: capture where the backend's capture runs the region): a lazy engine's capture
    #: thread runs it under its live switch's lock and gives serving's buffers back.
    #: A guarded descriptor's graphs are made ready outside the guard, right after its
    #: capture.
    guard: Callable[[Descriptor, Callable[[], object]], Callable[[], object]] | None = None
    #: Verify each descriptor after the next one's capture (``Allocation.behind``).
    behind: bool = False
    #: Whether PHASE_END events carry the capture pool's size: the pipeline's do, the
    #: capture thread's leave it to DESCRIPTOR_END.
    pool: bool = True
    #: Wraps a capture phase that only records (a real capture): a lazy capture records
    #: in its turn beside the server's steps, and ``pause`` before each segment it
    #: records gives way to a waiting step.
    record: Callable[[Callable[[], object]], Callable[[], object]] | None = None
    pause: Callable[[], None] | None = None
    #: Verify on first use (a lazy capture): each descriptor is checked on its first real
    #: batch, so none is verified here, and none warms up but where the step launches
    #: per-size JIT kernels (the first warmup ran before serving began).
    first_use: bool = False


@attrs.frozen(eq=False)
class Waiting:
    """A captured descriptor whose verify waits for the next descriptor's capture."""

    descriptor: Descriptor
    index: int
    warmed: Warmed


def run_descriptor(ctx: Context, alloc: Allocation, captured: Captured | None, descriptor: Descriptor, index: int,
                   tally: Tally, hooks: Hooks = Hooks(), waiting: Waiting | None = None
                   ) -> tuple[Captured, Waiting | None]:
    """One descriptor through warmup, capture and verify (``graphflow.engine.pipeline``,
    step 3); the capture so far, and the descriptor whose verify still waits, if any.

    ``captured`` is None for the run's first descriptor (``warm``). With ``hooks.behind``
    this descriptor's verify waits and ``waiting``, the one before, is verified instead,
    beside the instantiation of this one's graphs; the caller verifies the last one
    (``run_verify``).
    """
    warmed, captured = warm(ctx, alloc, captured, descriptor, index, tally, hooks)
    body = functools.partial(capture, ctx, alloc, captured, descriptor, index, hooks.pause)
    # A CUDA capture records without running the model; the CPU backend's runs the region.
    if not ctx.backend.captures_graphs:
        body = _guarded(hooks, descriptor, body)
    elif hooks.record is not None:
        body = hooks.record(body)
    tally.times.append(run_phase(ctx, tally.phases, Phase.CAPTURE, body, pool=_pool(hooks, captured)))
    if hooks.guard is not None:
        captured.settle()  # before verify takes the guard: steps go on while the graphs instantiate
    this = Waiting(descriptor, index, warmed) if ctx.verifies(descriptor) and not hooks.first_use else None
    if not hooks.behind:
        if this is not None:
            run_verify(ctx, alloc, captured, this, tally, hooks)
        return captured, None
    if waiting is not None:
        run_verify(ctx, alloc, captured, waiting, tally, hooks)
    return captured, this


def warm(ctx: Context, alloc: Allocation, captured: Captured | None, descriptor: Descriptor, index: int,
         tally: Tally, hooks: Hooks = Hooks()) -> tuple[Warmed, Captured]:
    """One descriptor's warmup; after the run's first (``captured`` None), prewarm and the
    capture opened (``open_capture``): prewarm compiles the JIT specializations that
    warmup launched, so it waits for one warmup, and the captures need it done.

    A descriptor that ``Context.warms`` leaves out (``capture.warmup: auto``) goes
    straight to capture: its warmup is recorded as skipped (a ``DESCRIPTOR_SKIPPED``
    event, a ``DescriptorTime`` with ``skipped``), so no report shows a silent gap."""
    each = captured is not None and captured.per_size is not None
    if captured is not None and not (each if hooks.first_use else ctx.warms(descriptor, each)):
        ctx.emit(EventKind.DESCRIPTOR_SKIPPED, phase=Phase.WARMUP, descriptor=descriptor, index=index,
                 total=len(ctx.descriptors))
        skipped = DescriptorTime(Phase.WARMUP, descriptor, 0.0, skipped=True)
        tally.times.append(skipped)
        return Warmed(skipped), captured
    warmed = run_phase(ctx, tally.phases, Phase.WARMUP,
                       _guarded(hooks, descriptor, functools.partial(warmup, ctx, alloc, descriptor, index)),
                       pool=_pool(hooks, captured))
    tally.times.append(warmed.time)
    if warmed.pool_probe_bytes is not None:
        tally.pool_probe.setdefault(descriptor.mode.value, warmed.pool_probe_bytes)
    if captured is None:
        prewarmed = run_phase(ctx, tally.phases, Phase.PREWARM, functools.partial(prewarm, ctx, alloc))
        tally.prewarm = prewarmed if prewarmed is not False else None
        captured = open_capture(ctx, jit=prewarmed is not False and _per_size_kernels(prewarmed))
    return warmed, captured


def _per_size_kernels(prewarmed) -> bool:
    """Whether warmup launched a JIT kernel that may specialize per batch size."""
    from graphflow.engine.jit import registry

    return any(registry.kernel(entry.spec.kernel).per_size for entry in prewarmed.entries)


def run_verify(ctx: Context, alloc: Allocation, captured: Captured, waiting: Waiting, tally: Tally,
               hooks: Hooks = Hooks()) -> None:
    """A captured descriptor's verify, a call of its own: verified one behind, the last
    descriptor is verified after the loop."""
    descriptor = waiting.descriptor
    result, took = run_phase(ctx, tally.phases, Phase.VERIFY, _guarded(hooks, descriptor, functools.partial(
        verify, ctx, alloc, captured, descriptor, waiting.index, waiting.warmed)), pool=_pool(hooks, captured))
    tally.verified.append(result)
    tally.times.append(took)


def _guarded(hooks: Hooks, descriptor: Descriptor, body: Callable[[], object]) -> Callable[[], object]:
    return body if hooks.guard is None else hooks.guard(descriptor, body)


def _pool(hooks: Hooks, captured: Captured | None) -> Callable[[object], int | None]:
    return lambda _: captured.pool_bytes if hooks.pool and captured is not None else None
