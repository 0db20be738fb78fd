"""The capture phase: each region of each descriptor recorded as one graph.

PIECEWISE then FULL descriptors, largest first (a smaller graph then reuses the larger
ones' pool blocks), with the garbage collector frozen: a collection during capture
scans only what capture creates. A region is captured on its origin stream (its first
segment's), its side streams forked from it and joined back, into its device's shared
pool, every graph segment call under the detectors' watch. The result is each
descriptor's step program: graph replays and bound eager breaks, in order, which the
runtime calls as bare callables.
"""

from __future__ import annotations

import gc

import attrs
import torch

from graphflow.engine.allocate import Allocation, step_items
from graphflow.engine.backend import Call, Graph
from graphflow.engine.context import Context
from graphflow.engine.execute import bind, run_scheduled
from graphflow.engine.warmup import DescriptorTime, check_findings, watched
from graphflow.events import EventKind, Phase
from graphflow.jit import registry as jit_registry
from graphflow.plan import CaptureRegion, Descriptor, Segment

__all__ = ["Captured", "capture"]


@attrs.frozen(eq=False)
class Captured:
    """Each descriptor's step program, the graphs behind them, and the time each took."""

    programs: dict[Descriptor, tuple[Call, ...]]
    graphs: list[Graph]
    times: tuple[DescriptorTime, ...]
    pool_bytes: int | None


def capture(ctx: Context, alloc: Allocation) -> Captured:
    gc.collect()
    # Everything alive now leaves the collector's generations: a collection during capture
    # scans only what capture creates, and stays short.
    gc.freeze()
    unfreeze = ctx.stack.push("unfreeze the garbage collector", gc.unfreeze)
    # A JIT compile or module load while a stream captures becomes a named CaptureError
    # (graphflow.jit); the tripwires cost one check outside a capture and go when it ends.
    tripwires = jit_registry.tripwires()
    tripwires.install()
    untrip = ctx.stack.push("remove the JIT tripwires", tripwires.remove)
    programs: dict[Descriptor, tuple[Call, ...]] = {}
    graphs: list[Graph] = []
    times = []
    ctx.stack.push("drop the step programs", programs.clear)
    pool_bytes = None
    runner = watched(ctx, alloc, Phase.CAPTURE, capturing=True)
    for index, descriptor in enumerate(ctx.descriptors, 1):
        with ctx.descriptor(descriptor, index) as block:
            views = alloc.buffers.views(descriptor.size)
            program: list[Call] = []
            for item in step_items(ctx, descriptor.mode):
                if isinstance(item, Segment):
                    program.append(bind(item, alloc.fns[item.name], views))
                    continue
                region, segments = item
                graph = _capture_region(ctx, alloc, index, region, segments, views, runner)
                graphs.append(graph)
                program.append(graph.replay)
            programs[descriptor] = tuple(program)
            # The pool's size costs an allocator snapshot: only worth it when someone listens.
            if ctx.listeners:
                pool_bytes = block.pool_bytes = alloc.pool_bytes(ctx)
        times.append(DescriptorTime(Phase.CAPTURE, descriptor, block.seconds, block.pool_bytes))
    ctx.stack.run_now(untrip)
    ctx.stack.run_now(unfreeze)
    return Captured(programs, graphs, tuple(times), pool_bytes)


def _capture_region(ctx: Context, alloc: Allocation, index: int, region: CaptureRegion,
                    segments: tuple[Segment, ...], views: dict[str, torch.Tensor], runner) -> Graph:
    with ctx.locus.at(region=region.name):
        ctx.emit(EventKind.REGION_BEGIN, index=index, total=len(ctx.descriptors))
        calls = [bind(s, alloc.fns[s.name], views) for s in segments]
        scheduled = alloc.schedules[tuple(s.name for s in segments)]

        def recording() -> None:
            run_scheduled(ctx.backend, scheduled, tuple(zip(segments, calls)), runner)

        try:
            graph = ctx.backend.capture(tuple(calls), recording, scheduled.origin,
                                        alloc.pools[alloc.device_of(ctx, segments[0])], scheduled.side)
        except Exception as exc:
            # Capture can also break after the segments ran (ending it reports an op that
            # invalidated it): a finding made during the region is still the headline.
            check_findings(alloc, cause=exc, failed=ctx.locus.failure(exc).segment)
            raise
        finally:
            # A traceback keeps ``recording`` alive through its frame even after the frame
            # is cleared; emptied, its closure no longer holds views of the static buffers.
            calls.clear()
        ctx.stack.push(f"destroy graph {region.name} {ctx.locus.here.descriptor}", graph.destroy)
        check_findings(alloc)
        ctx.emit(EventKind.REGION_END, index=index, total=len(ctx.descriptors))
    return graph
