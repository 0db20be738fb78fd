"""The warmup and prewarm phases: every kernel launched eagerly before any capture.

Warmup runs the whole step eagerly per descriptor, on the streams and schedule capture
will use, so lazy initialization (cuBLAS's per-stream workspaces, allocator growth, a JIT
kernel's first launch) happens outside capture; the detectors watch every graph
segment call. Prewarm then runs the plan's prewarm hooks: specializations warmup could
not reach (a collective whose warmup does not communicate), with no communication.
"""

from __future__ import annotations

import contextlib

import attrs

from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Call
from graphflow.engine.context import Context
from graphflow.engine.execute import bind, call_segment, run_eager
from graphflow.engine.written import checking
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.plan import Descriptor, Segment

__all__ = ["DescriptorTime", "check_findings", "eager_step", "prewarm", "warmup", "watched"]


@attrs.frozen
class DescriptorTime:
    """How long one descriptor took in one phase, and the pool after it (capture)."""

    phase: Phase
    descriptor: Descriptor
    seconds: float
    pool_bytes: int | None = None


def eager_step(ctx: Context, alloc: Allocation, size: int) -> tuple[tuple[Segment, Call], ...]:
    """This rank's whole step at one size, as (segment, bound call) pairs."""
    views = alloc.buffers.views(size)
    return tuple((s, bind(s, alloc.fns[s.name], views)) for s in ctx.segments)


def watched(ctx: Context, alloc: Allocation, phase: Phase, *, capturing: bool):
    """A segment runner that puts each graph segment call under the detectors' watch
    (eager breaks may sync: that is their job)."""
    detectors = alloc.detectors

    def run(segment: Segment, call: Call) -> None:
        watch = None
        if detectors is not None and segment.is_graph:
            watch = detectors.watch(segment.name, phase, capturing, alloc.device_of(ctx, segment))
        call_segment(ctx, segment, call, watch)

    return run


def check_findings(alloc: Allocation) -> None:
    """Raise the detectors' findings as one CaptureError. Any finding ends the run, so
    every finding there is new."""
    findings = alloc.detectors.findings if alloc.detectors is not None else ()
    if findings:
        lines = "; ".join(f"[{f.check.value}] {f.segment}: {f.call}: {f.message}" for f in findings)
        raise CaptureError(f"capture-safety detectors found {len(findings)} problem(s): {lines}",
                           segment=findings[0].segment,
                           hint="fix the segment or make it eager; silence one check with --disable-check NAME")


def warmup(ctx: Context, alloc: Allocation) -> tuple[DescriptorTime, ...]:
    """Per descriptor, largest first: the step eagerly ``warmup_iters`` times (the very
    first step checked for unwritten outputs, ``graphflow.engine.written``)."""
    times = []
    runner = watched(ctx, alloc, Phase.WARMUP, capturing=False)
    schedule = alloc.schedules[tuple(s.name for s in ctx.segments)]
    for index, descriptor in enumerate(ctx.descriptors, 1):
        with ctx.descriptor(descriptor, index) as block:
            step = eager_step(ctx, alloc, descriptor.size)
            for iteration in range(ctx.plan.capture.warmup_iters):
                # The first step also checks that every segment writes what it declares.
                first = index == 1 and iteration == 0
                run_eager(ctx.backend, schedule, step, checking(ctx, alloc, descriptor.size, runner) if first else runner)
            alloc.synchronize(ctx)
            check_findings(alloc)
        times.append(DescriptorTime(Phase.WARMUP, descriptor, block.seconds))
    return tuple(times)


def prewarm(ctx: Context, alloc: Allocation):
    """The JIT registry's specializations and the plan's prewarm hooks, on every device's
    capture stream; the registry's ``PrewarmReport``, or False (skipped) when there was
    nothing to prewarm.

    JIT kernels (``graphflow.jit``): every specialization warmup launched, and those the
    segments' declared ``kernels`` give for the descriptor sizes, compiled and launched
    once per device. Hooks: once per descriptor size (largest first) when ``per_size``,
    else once, on each device in turn (a module loads per device).
    """
    from graphflow.jit import registry

    streams = capture_streams(ctx, alloc)
    sizes = sorted({d.size for d in ctx.descriptors}, reverse=True)
    with ctx.locus.segment("prewarm JIT kernels"):
        report = registry.prewarm(streams, sizes=sizes, declared={s.name: s.kernels for s in ctx.segments})
    for hook in ctx.plan.prewarm:
        fn = alloc.hooks[hook.name]
        with ctx.locus.segment(f"prewarm {hook.name}"):
            for stream in streams.values() or (None,):
                with ctx.backend.on_stream(stream) if stream is not None else contextlib.nullcontext():
                    for size in sizes if hook.per_size else (None,):
                        fn(size) if size is not None else fn()
    alloc.synchronize(ctx)
    return report if report.entries or ctx.plan.prewarm else False


def capture_streams(ctx: Context, alloc: Allocation) -> dict:
    """Each device's capture stream: the stream of its first graph segment."""
    streams: dict = {}
    for segment in ctx.segments:
        if segment.is_graph:
            streams.setdefault(alloc.device_of(ctx, segment), alloc.streams[segment.name])
    return streams
