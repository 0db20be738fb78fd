"""The capture phase: each region of a descriptor recorded as one graph.

Captures run PIECEWISE then FULL, largest first (a smaller graph then reuses the larger
ones' pool blocks), with the garbage collector frozen from the first capture on: a
collection during capture scans only what capture creates. A region is captured on its
origin stream (its first segment's), its side streams forked from it and joined back,
into its device's shared pool; room is made in the device's memory before a
descriptor's captures when it is short (``Backend.make_room``), not before every graph as
``torch.cuda.graph`` does. The result is each descriptor's step
program: graph replays and bound eager breaks, in order, which the runtime calls as bare
callables. The backend may still be instantiating a descriptor's graphs when its capture
returns (the CUDA backend does it on a worker thread, overlapping the next capture or
warmup): ``Captured.settle`` waits for them before verify or commit replays anything.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import attrs
import torch

from graphflow.engine.allocate import Allocation, step_items
from graphflow.engine.backend import Call, Graph
from graphflow.engine.context import Context, per_size_warmup
from graphflow.engine.execute import bind, run_scheduled
from graphflow.engine.memory import pool_estimate
from graphflow.engine.model.returned import Placed, placeable
from graphflow.engine.warmup import DescriptorTime, check_findings, watched
from graphflow.errors import CaptureError, OptionFix
from graphflow.events import EventKind, Phase
from graphflow.engine.jit import registry as jit_registry
from graphflow.plan import CaptureRegion, Descriptor, Segment
from graphflow.units import format_bytes

__all__ = ["Captured", "capture", "open_capture"]

#: How often the pool's size (an allocator snapshot) is read for progress events, at most.
POOL_READ_INTERVAL_S = 1.0


@attrs.define(eq=False)
class Captured:
    """The step programs captured so far, the graphs behind them, and the pool's size.

    ``close()`` ends the capture settings ``open_capture`` made (frozen gc, JIT
    tripwires); rollback undoes them as well if it comes first.
    """

    programs: dict[Descriptor, tuple[Call, ...]] = attrs.field(factory=dict)
    graphs: list[Graph] = attrs.field(factory=list)
    pool_bytes: int | None = None
    #: Per mode, the pool once all of its descriptors are captured, estimated after its two largest.
    pool_estimate: dict[str, int] = attrs.field(factory=dict)
    _pool_by_mode: dict = attrs.field(factory=dict)  # mode -> pool sizes after its first captures
    _pool_read_at: float = 0.0
    #: The outputs whose returned tensor capture keeps (``graphflow.engine.model.returned``).
    placeable: frozenset[str] = frozenset()
    #: Why every descriptor warms up before its capture (``per_size_warmup``), or None:
    #: only those ``Context.warms`` names. Decided once the first warmup has shown
    #: whether the step launches JIT kernels, for the pipeline and a lazy engine's thread.
    per_size: str | None = None
    _undos: tuple = ()
    _ctx: Context | None = None
    #: descriptor -> its graphs not known ready yet (``settle``), with each one's region
    #: and place in the descriptor's program.
    _unready: dict = attrs.field(factory=dict)
    #: Each descriptor's graphs, so that one found wrong later can be rolled back alone.
    graphs_of: dict = attrs.field(factory=dict)

    def settle(self) -> None:
        """Wait until every graph captured so far can replay (the backend may still be
        instantiating them, ``Graph.ready``), and put their bare replays in the programs.
        Verify and commit call it before anything replays."""
        unready, self._unready = self._unready, {}
        for descriptor, graphs in unready.items():
            if descriptor not in self.programs:  # its capture failed, and was rolled back
                continue
            program = list(self.programs[descriptor])
            for position, region, graph in graphs:
                try:
                    graph.ready()
                except Exception as exc:
                    raise CaptureError(f"graph of region {region} could not be made replayable: "
                                       f"{type(exc).__name__}: {exc}", phase=Phase.CAPTURE.value,
                                       descriptor=descriptor,
                                       hint="instantiating a captured graph failed (device memory, or a graph "
                                            "the driver refuses): capture fewer sizes, or report the graph"
                                       ) from exc
                program[position] = graph.replay
            self.programs[descriptor] = tuple(program)

    def close(self) -> None:
        for undo in self._undos:
            self._ctx.stack.run_now(undo)
        self._undos = ()


def open_capture(ctx: Context, *, jit: bool = False) -> Captured:
    """Freeze the collector and install the JIT tripwires for the captures to come;
    ``jit``: the first warmup launched JIT kernels (prewarm had some to compile)."""
    # Everything alive now leaves the collector's generations: a collection during capture
    # scans only what capture creates, and stays short. No full collection first: in a
    # process holding a framework and a model it costs tens of milliseconds or more, and
    # the garbage it would find is only kept until the unfreeze. A process that froze its
    # heap itself (a server after start-up, as vLLM does) keeps it frozen: the collector
    # cannot unfreeze part of it, so graphflow then leaves it alone.
    unfreeze = None
    if gc.get_freeze_count() == 0:
        gc.freeze()
        unfreeze = ctx.stack.push("unfreeze the garbage collector", gc.unfreeze)
    # A JIT compile or module load while a stream captures becomes a named CaptureError
    # (graphflow.engine.jit); the tripwires cost one check outside a capture and go at the end.
    tripwires = jit_registry.tripwires()
    tripwires.install()
    untrip = ctx.stack.push("remove the JIT tripwires", tripwires.remove)
    # Outputs kept where the graphs return them: not in lazy capture (``graphflow.engine.model.returned``).
    keep = ctx.backend.captures_graphs and not ctx.options.lazy
    per_size = per_size_warmup(ctx.plan, ctx.segments, compiled=ctx.options.compile, jit=jit,
                               world_size=ctx.world_size)
    undos = (untrip,) if unfreeze is None else (untrip, unfreeze)
    captured = Captured(placeable=placeable(ctx.plan, ctx.segments) if keep else frozenset(), per_size=per_size,
                        undos=undos, ctx=ctx)
    ctx.stack.push("drop the step programs", captured.programs.clear)
    return captured


def capture(ctx: Context, alloc: Allocation, captured: Captured, descriptor: Descriptor, index: int,
            pause: Callable[[], None] | None = None) -> DescriptorTime:
    """Capture one descriptor's regions; its program goes into ``captured.programs``.
    ``pause`` is called before each segment is recorded (a lazy capture gives way to the
    server's steps there, ``graphflow.engine.turns``)."""
    runner = watched(ctx, alloc, Phase.CAPTURE, capturing=True, descriptor=descriptor)
    with ctx.descriptor(descriptor, index) as block:
        for device in alloc.pools:
            ctx.backend.make_room(device)
        views = alloc.buffers.views(descriptor.size)
        placed = (Placed(captured.placeable, views, alloc.detectors if ctx.watches(descriptor) else None)
                  if captured.placeable else None)
        program: list[Call] = []
        unready = captured._unready.setdefault(descriptor, [])
        for item in step_items(ctx, descriptor.mode):
            if isinstance(item, Segment):
                program.append(bind(item, alloc.fns[item.name], views))
                continue
            region, segments = item
            graph = _capture_region(ctx, alloc, index, region, segments, views,
                                    runner if pause is None else _pausing(runner, pause), placed)
            captured.graphs.append(graph)
            captured.graphs_of.setdefault(descriptor, []).append(graph)
            unready.append((len(program), region.name, graph))
            program.append(graph.replay)
        if placed is not None and placed.tensors:
            alloc.buffers.place(descriptor, placed.unowned())
            ctx.stack.push(f"forget the outputs {descriptor}'s graphs return",
                           lambda: alloc.buffers.unplace(descriptor))
        captured.programs[descriptor] = tuple(program)
        _estimate_pool(ctx, alloc, captured, descriptor)
        # The pool's size costs an allocator snapshot: read it for listeners, not too often.
        now = time.perf_counter()
        if ctx.listeners and (now - captured._pool_read_at >= POOL_READ_INTERVAL_S or index == len(ctx.descriptors)):
            captured.pool_bytes = alloc.pool_bytes(ctx)
            captured._pool_read_at = now
        block.pool_bytes = captured.pool_bytes
    return DescriptorTime(Phase.CAPTURE, descriptor, block.seconds, block.pool_bytes)


def _estimate_pool(ctx: Context, alloc: Allocation, captured: Captured, descriptor: Descriptor) -> None:
    """After a mode's two largest descriptors: the pool it will take in all, checked
    against free memory before the rest are captured (``graphflow.engine.memory``)."""
    seen = captured._pool_by_mode.setdefault(descriptor.mode, [])
    if len(seen) >= 2:
        return
    pool = alloc.pool_bytes(ctx)
    if pool is None:  # a backend with no pool to measure
        return
    seen.append(pool)
    captured.pool_bytes = pool
    left = sum(1 for d in ctx.descriptors if d.mode is descriptor.mode) - len(seen)
    if len(seen) < 2 or left <= 0:
        return
    estimate = pool_estimate(pool, seen[1] - seen[0], left)
    captured.pool_estimate[descriptor.mode.value] = estimate
    device = next(iter(alloc.pools), None)
    free = ctx.backend.free_memory(device) if device is not None else None
    if free is not None and estimate - pool > free:
        raise CaptureError(
            f"the capture pool would grow to about {format_bytes(estimate)} for the {left} {descriptor.mode.value} "
            f"descriptors left (it holds {format_bytes(pool)} after the two largest, the second adding "
            f"{format_bytes(seen[1] - seen[0])}), but {format_bytes(free)} is free on {device}",
            hint="capture fewer sizes (capture.sizes, {0}), or PIECEWISE only, or free memory for the pool",
            settings=(OptionFix("sizes"),))


def _pausing(runner, pause: Callable[[], None]):
    def run(segment: Segment, call: Call) -> None:
        pause()
        runner(segment, call)

    return run


def _capture_region(ctx: Context, alloc: Allocation, index: int, region: CaptureRegion,
                    segments: tuple[Segment, ...], views: dict[str, torch.Tensor], runner,
                    placed: Placed | None = None) -> Graph:
    with ctx.locus.at(region=region.name):
        ctx.emit(EventKind.REGION_BEGIN, index=index, total=len(ctx.descriptors))
        calls = [bind(s, alloc.fns[s.name], views, placed) for s in segments]
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
