"""The warmup and prewarm phases: every kernel launched eagerly before it is captured.

Warmup runs one descriptor's whole step eagerly, on the streams and schedule capture
will use, so lazy initialization (cuBLAS's per-stream workspaces, allocator growth, a JIT
kernel's first launch) happens outside capture; the detectors watch its graph segment
calls, and around them it checks that graph code changes no plain Python value the model
keeps in a way a replay could not reproduce (``graphflow.engine.model.host_state``: a
graph runs no Python), reading one more step for that when it must. Its inputs are
verify's random inputs, and when verify compares this descriptor it keeps what
verify needs (``Warmed``): the buffers the step started from and the buffers it wrote.
Verify then replays the graph from the same start and compares, so the eager reference
is computed once, here, instead of a second time in verify.

Prewarm, after the first descriptor's warmup, compiles and launches what warmup cannot
reach (the JIT registry's declared specializations, the plan's prewarm hooks) on every
device's capture stream, with no communication.
"""

from __future__ import annotations

import contextlib

import attrs
import torch

from graphflow.engine.detectors import Check
from graphflow.engine.model import host_state
from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Call
from graphflow.engine.context import Context
from graphflow.engine.execute import bind, call_segment, run_eager
from graphflow.engine.model.split import matching
from graphflow.engine.model.written import checking
from graphflow.errors import CaptureError, OptionFix
from graphflow.events import Phase
from graphflow.plan import BufferRole, Descriptor, Mode, Plan, Segment

__all__ = ["DescriptorTime", "Warmed", "capture_streams", "check_findings", "eager_step", "fill_inputs", "prewarm",
           "warmup", "watched"]


@attrs.frozen
class DescriptorTime:
    """How long one descriptor took in one phase, and the pool after it (capture);
    ``skipped``: the phase left this descriptor out (its warmup, ``capture.warmup: auto``)."""

    phase: Phase
    descriptor: Descriptor
    seconds: float
    pool_bytes: int | None = None
    skipped: bool = False


@attrs.frozen(eq=False)
class Warmed:
    """One descriptor's warmup: its time, and for verify (when the run verifies) the
    read and state buffers before the last warm run (``start``) and every buffer the
    step wrote after it (``expected``, in the order of each buffer's last write).

    Both are views of one of the allocation's ``snapshots`` pairs, which the next
    descriptor to use that pair overwrites: verify this descriptor first (with two pairs,
    the next descriptor's warmup uses the other one)."""

    time: DescriptorTime
    start: dict[str, torch.Tensor] = attrs.field(factory=dict)
    expected: dict[str, torch.Tensor] = attrs.field(factory=dict)
    #: The first descriptor of a mode only: the bytes a pool of its own reserved for one
    #: more run of its step, the segments capture records allocating in it and the eager
    #: breaks outside (``Backend.pool_probe``; None elsewhere, and where the backend
    #: cannot tell), the capture pool's forecast before anything is captured. A capture
    #: reserves its pool the same way: fresh segments, the allocator's block sizes and
    #: rounding, blocks reused as the step frees them. The peak of allocated bytes shows
    #: none of that (36 MiB against an 82 MiB pool, the 61-layer FULL plan on the H200),
    #: and over a first run it also counts what is made once and kept (cuBLAS's workspace
    #: at a stream's first matmul: 101 MiB there in a fresh process); the runs before the
    #: probed one have made that. The first descriptor is the mode's largest, and the
    #: smaller ones' graphs reuse its pool blocks.
    pool_probe_bytes: int | None = None


def eager_step(ctx: Context, alloc: Allocation, size: int, fns=None) -> tuple[tuple[Segment, Call], ...]:
    """This rank's whole step at one size, as (segment, bound call) pairs, calling
    ``fns`` (default: the callables warmup and capture run, compiled where the plan says)."""
    views = alloc.buffers.views(size)
    fns = alloc.fns if fns is None else fns
    return tuple((s, bind(s, fns[s.name], views)) for s in ctx.segments)


def watched(ctx: Context, alloc: Allocation, phase: Phase, *, capturing: bool, descriptor: Descriptor):
    """A segment runner that puts each graph segment call under the detectors' watch when
    the run watches this descriptor (eager breaks may sync: that is their job)."""
    detectors = alloc.detectors if ctx.watches(descriptor) else None
    if detectors is None:
        return lambda segment, call: call_segment(ctx, segment, call)

    def run(segment: Segment, call: Call) -> None:
        if not segment.is_graph:
            call_segment(ctx, segment, call)
            return
        try:
            call_segment(ctx, segment, call, detectors.watch(segment.name, phase, capturing,
                                                             alloc.device_of(ctx, segment)))
        except Exception as exc:
            check_findings(alloc, cause=exc, failed=segment.name)
            raise

    return run


def check_findings(alloc: Allocation, *, cause: BaseException | None = None, failed: str | None = None) -> None:
    """Raise the detectors' findings as one CaptureError. Any finding ends the run, so
    every finding there is new.

    ``cause`` is an error a segment or the capture itself raised (``failed``: the
    segment running then, if any). A finding is recorded before its op runs, and the op
    that breaks a capture (``.item()``, a CPU operand, a copy to another device) is the
    one flagged: the findings, ``failed``'s first, are the error's headline and
    ``cause`` (the CUDA error) its cause. Without findings, or when ``cause`` is already
    graphflow's own error, this does nothing and the caller re-raises ``cause``.
    """
    findings = alloc.detectors.findings if alloc.detectors is not None else ()
    if not findings or isinstance(cause, CaptureError):
        return
    findings = sorted(findings, key=lambda f: f.segment != failed)  # stable: otherwise in the order found
    lines = "; ".join(f"[{f.check.value}] {f.segment}: {f.call}: {f.message}" for f in findings)
    message = f"capture-safety detectors found {len(findings)} problem(s): {lines}"
    if cause is not None:
        where = f" in segment {failed}" if failed is not None and failed != findings[0].segment else ""
        first = str(cause).strip().splitlines()
        message += f"; then{where} {type(cause).__name__}" + (f": {first[0]}" if first else "")
    raise CaptureError(message, segment=findings[0].segment, hint="fix the segment or make it eager; silence a check "
                       "with {0}", settings=(OptionFix("disabled_checks", {findings[0].check.value}),)) from cause


def warmup(ctx: Context, alloc: Allocation, descriptor: Descriptor, index: int) -> Warmed:
    """One descriptor: the step eagerly ``warmup_iters`` times on verify's inputs (the
    run's very first step checked for unwritten outputs, ``graphflow.engine.model.written``).
    A mode's first descriptor runs once more, in pools of its own (``pool_probe``): that
    run is the last, the one verify's snapshots surround. Where the host-state check
    needs a second step and there was one step only, one more runs after the snapshots."""
    runner = watched(ctx, alloc, Phase.WARMUP, capturing=False, descriptor=descriptor)
    schedule = alloc.schedules[tuple(s.name for s in ctx.segments)]
    keep = ctx.verifies(descriptor) and ctx.verify_plan.reuses_warmup
    host = _host_watch(ctx, alloc, descriptor)
    start: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    probed = tuple(d for d in dict.fromkeys(alloc.devices.values()) if ctx.backend.probes_pools(d)) \
        if ctx.first_of_mode(descriptor) else ()
    probes = []
    with ctx.descriptor(descriptor, index) as block:
        views = alloc.buffers.views(descriptor.size)
        fill_inputs(ctx.plan, views, descriptor.size, ctx.options.seed, strict=bool(ctx.options.verify))
        step = eager_step(ctx, alloc, descriptor.size)
        iters = ctx.plan.capture.warmup_iters + bool(probed)
        # Consecutive descriptors take turns when there are two pairs (``Allocation.behind``).
        pair = alloc.snapshots[index % len(alloc.snapshots)] if keep else None
        for i in range(iters):
            last = i == iters - 1
            if keep and last:
                start = pair[0].take(views, descriptor.size)
            # The first step also checks that every segment writes what it declares.
            first = index == 1 and i == 0
            read = host is not None and host.wants_step()
            with contextlib.ExitStack() as probing:
                run = host.runner(runner) if read else runner
                run = checking(ctx, alloc, descriptor.size, run) if first else run
                if probed and last:
                    probes = [probing.enter_context(ctx.backend.pool_probe(device)) for device in probed]
                    run = _probing(run, probes)
                if read:
                    probing.enter_context(host.stepping())
                run_eager(ctx.backend, schedule, step, run)
        alloc.synchronize(ctx)
        check_findings(alloc)
        if keep:
            expected = pair[1].take(views, descriptor.size)
        if host is not None and host.wants_step():
            # After the snapshots: verify's reference is one step from ``start``.
            with host.stepping():
                run_eager(ctx.backend, schedule, step, host.runner(runner))
            alloc.synchronize(ctx)
            check_findings(alloc)
        if host is not None:
            host.check()
    sizes = [probe.bytes for probe in probes]
    forecast = None if not sizes or None in sizes else sum(sizes)
    return Warmed(DescriptorTime(Phase.WARMUP, descriptor, block.seconds), start, expected, forecast)


def _host_watch(ctx: Context, alloc: Allocation, descriptor: Descriptor) -> host_state.StepWatch | None:
    """The host-state check of this descriptor's warmup, where the detectors watch it and
    the check is on. In a PIECEWISE descriptor a graph segment's breaks run eagerly, at
    every replay, so what they change is not the graph's: the check brackets them, except
    in a compiled segment (hooks on its submodules would change what dynamo compiled).
    Ranks whose collectives pair up step by step read two steps each, as decided here
    from what every rank knows."""
    if not ctx.watches(descriptor) or Check.HOST_STATE in ctx.options.disabled_checks:
        return None
    breaks = {}
    if descriptor.mode is Mode.PIECEWISE:
        for segment in ctx.segments:
            if segment.is_graph and segment.breaks and not (ctx.options.compile and ctx.plan.compile_of(segment)):
                breaks[segment.name] = [m for found in matching(alloc.model, segment.breaks).values() for m in found]
    paired = bool(ctx.plan.channels) or max(ctx.plan.world_size, ctx.world_size) > 1
    return host_state.StepWatch(alloc.model, alloc.owned.holders, breaks, paired=paired)


def _probing(runner, probes):
    """``runner``, with the graph segments allocating in the probes' pools and the eager
    breaks where they allocate at replay, outside (a FULL region holds graph segments
    only). The breaks' own allocations, in the probe, took blocks the graphs' then reused,
    and the probe said 82 MiB for a 96 MiB pool (the 61-layer PIECEWISE plan on the H200;
    96 MiB with the breaks outside)."""
    def run(segment: Segment, call: Call) -> None:
        if not segment.is_graph:
            runner(segment, call)
            return
        with contextlib.ExitStack() as routed:
            for probe in probes:
                routed.enter_context(probe.route())
            runner(segment, call)

    return run


def fill_inputs(plan: Plan, views: dict[str, torch.Tensor], size: int, seed: int, *, strict: bool) -> None:
    """Fill the input buffers at ``size`` with seeded random values: floats standard
    normal (or uniform in ``values``), ints uniform in ``values``. ``strict=False``
    leaves an integer input that declares no values as it is."""
    for buffer in plan.buffers:
        if buffer.role is not BufferRole.INPUT:
            continue
        floating = buffer.dtype.startswith(("float", "bfloat"))
        if buffer.values is None and not floating and not strict:
            continue
        view = views[buffer.name]
        generator = torch.Generator(device=view.device).manual_seed(seed * 1_000_003 + size)
        if buffer.values is not None:
            low, high = buffer.values
            if floating:
                fresh = torch.rand(view.shape, generator=generator, device=view.device) * (high - low) + low
            else:
                fresh = torch.randint(int(low), int(high), view.shape, generator=generator, device=view.device)
        else:
            fresh = torch.randn(view.shape, generator=generator, device=view.device)
        view.copy_(fresh.to(view.dtype))


def prewarm(ctx: Context, alloc: Allocation):
    """The JIT registry's specializations and the plan's prewarm hooks, on every device's
    capture stream; the registry's ``PrewarmReport``, or False (skipped) when there was
    nothing to prewarm.

    JIT kernels (``graphflow.engine.jit``): every specialization warmup launched, and those the
    segments' declared ``kernels`` give for the descriptor sizes, compiled and launched
    once per device. Hooks: once per descriptor size (largest first) when ``per_size``,
    else once, on each device in turn (a module loads per device).
    """
    from graphflow.engine.jit import registry

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
