"""Backends capture and replay one region; everything else belongs to the pipeline.

A backend knows how to record a region's calls into a replayable graph on a stream, into
a memory pool, and how to give those back. It never decides which descriptor, which
region or what to do on failure: the pipeline drives it, and the runtime replays what
it returned without ever asking which backend it has.

Lifecycle of a backend, as the pipeline drives it:

1. ``device(name)`` maps each device a plan names to a ``torch.device``
   (the CPU backend maps every ``cuda:N`` to ``cpu`` and records that it did; the CUDA
   backend keeps ``cpu`` for host buffers, such as sequence lengths an eager segment
   reads without a device sync).
2. ``memory_allocated(device)`` is read once per device: the baseline rollback returns to
   (0 for host memory, which no graph allocates).
3. ``new_stream(device)`` and ``new_pool(device)``, once per stream and once per device
   (the CUDA backend lends streams the process keeps, ``graphflow.engine.streams``;
   ``release_stream`` gives each back when the run is over),
   and ``new_event(device)`` as many times per device as the largest schedule needs
   (``graphflow.plan.schedule``), in the allocate phase.
4. ``on_stream(stream)`` wraps every eager run (warmup, prewarm, verify's eager step) on
   its origin stream: it orders the stream after the caller's current stream on entry,
   and the caller after it on exit.
5. Inside an eager run or a capture, the pipeline runs the schedule: ``fork(origin,
   streams, event)`` at the start (each other stream waits for the origin), ``use(stream)``
   around each segment on another stream (makes it current, orders nothing; the origin
   is current already), ``wait(stream, event)`` before
   and ``record(event, stream)`` after a segment for cross-stream edges, and
   ``join(origin, events)`` at the end (the origin waits for every other stream).
6. ``make_room(device)`` once per descriptor before its captures (when the device is
   short of free memory: the device waited for and the allocator's unused cache freed,
   so the pool can grow), then ``capture(calls, recording, stream, pool, side)``, once
   per region per descriptor, returns a ``Graph``; ``Graph.ready()`` waits until it can
   replay (the CUDA backend may instantiate it on a worker thread meanwhile), and then
   its ``replay`` is a bare callable the runtime calls in its hot loop. ``side`` are the
   region's other streams: if ``recording`` raises with one of them still joined into
   the capture, the backend joins it back and ends the capture, so no stream is left
   capturing. Inside ``recording``, ``cut(between)`` ends the
   graph being recorded and starts the next one: the call ``between()`` returns runs
   eagerly between them at replay (a submodule a segment ``breaks`` at,
   ``graphflow.engine.model.split``); a backend that records no graph does not cut.
7. ``Graph.destroy()`` on rollback or close; then ``release_pool(pool)`` per device.
8. ``synchronize(device)`` at phase boundaries (nothing to wait for on the host);
   ``is_capturing(stream)`` for checks.

The choice between backends lives in ``make_backend`` (one table, ``BACKENDS``).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import ctypes
import enum
import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import attrs
import torch

from graphflow.engine.host import host_available
from graphflow.engine.streams import cuda_streams
from graphflow.errors import OptionError, OptionFix

__all__ = ["Backend", "BackendKind", "CpuBackend", "CudaBackend", "Graph", "PoolProbe", "WorkspaceClearedWarning",
           "make_backend", "workspace_watch"]

Call = Callable[[], object]


class Graph(abc.ABC):
    """One captured region. ``replay`` is an attribute, so the hot loop calls it directly."""

    replay: Callable[[], None]

    def ready(self) -> None:
        """Return once the graph can replay; raises what making it replayable raised
        (the CUDA backend instantiates graphs on a worker thread, ``_instantiator``).
        Until then ``replay`` waits for it first; after, ``replay`` is the bare replay."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Free the graph; replay is invalid afterwards. Safe to call twice."""


class Backend(abc.ABC):
    """Captures and replays single regions (see the module docstring for the lifecycle)."""

    name: ClassVar[str]
    #: Whether ``capture`` records a real graph; reports say plainly when it does not.
    captures_graphs: ClassVar[bool]
    #: ``torch.cuda.graph``'s: "global" refuses unsafe CUDA calls from any thread during a
    #: capture; "thread_local" only from the capturing one (a lazy engine serves meanwhile).
    capture_error_mode: str = "global"
    #: Whether captured graphs become replayable later (``Graph.ready``): the pipeline then
    #: verifies each descriptor one behind, when memory allows (``Allocation.behind``).
    instantiates_later: bool = False

    def __init__(self) -> None:
        #: Plan device names this backend replaced (``cuda:0 -> cpu``), for the report.
        self.remapped: dict[str, str] = {}

    @abc.abstractmethod
    def device(self, name: str) -> torch.device: ...

    @abc.abstractmethod
    def new_stream(self, device: torch.device) -> object: ...

    def release_stream(self, stream: object) -> None:
        """Give back a stream ``new_stream`` returned, once the run that took it is over
        (rolled back or closed): nothing of the run will use it again."""

    @abc.abstractmethod
    def new_pool(self, device: torch.device) -> object: ...

    @abc.abstractmethod
    def new_event(self, device: torch.device) -> object: ...

    @abc.abstractmethod
    def on_stream(self, stream: object) -> contextlib.AbstractContextManager[None]: ...

    @abc.abstractmethod
    def use(self, stream: object, current: object) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` current for the work inside, without ordering it against
        anything, and ``current`` (the caller's current stream) again after."""

    @abc.abstractmethod
    def record(self, event: object, stream: object) -> None:
        """Mark ``event`` done once the work issued so far on ``stream`` is."""

    @abc.abstractmethod
    def wait(self, stream: object, event: object) -> None:
        """Make later work on ``stream`` wait for ``event``'s latest ``record``."""

    def fork(self, origin: object, streams: Sequence[object], event: object) -> None:
        """Start ``streams`` after the work issued so far on ``origin`` (during capture,
        this joins them into the origin's capture)."""
        self.record(event, origin)
        for stream in streams:
            self.wait(stream, event)

    def join(self, origin: object, events: Sequence[object]) -> None:
        """Make ``origin`` wait for ``events`` (each recorded last on another stream)."""
        for event in events:
            self.wait(origin, event)

    @abc.abstractmethod
    def capture(self, calls: Sequence[Call], recording: Call, stream: object, pool: object,
                side: Sequence[object] = ()) -> Graph:
        """Record ``recording`` (the region's ``calls``, wrapped by the detectors and
        scheduled over ``stream`` and the ``side`` streams it forks) as a graph.

        ``calls`` are the same calls bare, in step order: a backend that cannot record
        replays them.
        """

    def cut(self, between: Callable[[], tuple[Call, object]]) -> object | None:
        """Inside ``capture``'s recording: end the graph being recorded, call ``between()``
        outside any capture (it returns the eager call to run here at replay and a value
        for the recording to go on with), start the next graph on the same stream and
        pool, and return that value. None, without calling ``between``, when this
        backend records no graph or no capture is open: the caller then runs the work."""
        return None

    @abc.abstractmethod
    def release_pool(self, pool: object) -> None: ...

    def make_room(self, device: torch.device) -> None:
        """Before a descriptor's captures on ``device``: when the device is short of
        memory, free what the allocator caches and no tensor uses, so the graph pool can
        grow into it (nothing on the host)."""

    @abc.abstractmethod
    def synchronize(self, device: torch.device) -> None: ...

    @abc.abstractmethod
    def is_capturing(self, stream: object) -> bool: ...

    def memory_allocated(self, device: torch.device) -> int:
        return 0

    def probes_pools(self, device: torch.device) -> bool:
        """Whether ``pool_probe`` measures on ``device``: where it cannot, nothing is run
        for it."""
        return False

    @contextlib.contextmanager
    def pool_probe(self, device: torch.device) -> Iterator[PoolProbe]:
        """A pool of its own on ``device``, into which the allocations this thread makes
        inside ``PoolProbe.route()`` go; on leaving, the probe holds the bytes that pool
        reserved (None where the backend cannot tell) and the pool is given back."""
        yield PoolProbe()

    def free_memory(self, device: torch.device) -> int | None:
        """Bytes that can still be allocated on ``device``, when the backend can tell."""
        return host_available() if device.type == "cpu" else None

    def pool_bytes(self, pool: object) -> int | None:
        """Bytes the pool holds, when the backend can tell."""
        return None

    def time_runs(self, device: torch.device | None, calls: Sequence[Call], n: int) -> tuple[list[float], ...]:
        """``n`` runs of each call in turn (every run of the first, then of the next), one
        list of seconds per call; wall clock here. The CUDA backend times them with events
        and synchronizes the device once before the first run and once after the last."""
        timed = []
        for call in calls:
            times = []
            for _ in range(n):
                start = time.perf_counter()
                call()
                times.append(time.perf_counter() - start)
            timed.append(times)
        return tuple(timed)


@attrs.define
class PoolProbe:
    """What ``Backend.pool_probe`` measured: the bytes its pool reserved, once it is left.

    ``route()``: a context inside which this thread's allocations on the probe's device go
    to its pool; only what runs there is measured (what a capture would put in its pool).
    ``outside()``: inside ``route()``, a context whose allocations go where they would
    without the probe (work a capture runs eagerly between its graphs, outside its pool)."""

    bytes: int | None = None
    route: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    outside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class _EagerGraph(Graph):
    """The CPU backend's "graph": the region's bound calls, replayed eagerly."""

    __slots__ = ("calls", "replay")

    def __init__(self, calls: Sequence[Call]):
        self.calls = tuple(calls)
        self.replay = self._replay if len(self.calls) != 1 else self.calls[0]

    def _replay(self) -> None:
        for call in self.calls:
            call()

    def destroy(self) -> None:
        self.calls = ()
        self.replay = _destroyed


def _destroyed() -> None:
    raise RuntimeError("replay of a destroyed graph")


class CpuBackend(Backend):
    """Runs the same phases with no graphs: each region is replayed as its calls.

    Capture runs the region once, as CUDA capture runs its Python once, so faults and
    detectors fire in the same phase on both backends. It exists so the pipeline, its
    wiring and its rollback run in CI on machines without a GPU.
    """

    name = "cpu"
    captures_graphs = False

    def device(self, name: str) -> torch.device:
        device = torch.device(name)
        if device.type != "cpu":
            self.remapped[name] = "cpu"
        return torch.device("cpu")

    def new_stream(self, device: torch.device) -> object:
        return _CpuStream(device)

    def new_pool(self, device: torch.device) -> object:
        return _CpuPool(device)

    def new_event(self, device: torch.device) -> object:
        return _HostEvent()

    def on_stream(self, stream: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def use(self, stream: object, current: object) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def record(self, event: object, stream: object) -> None:
        """Nothing to record: the CPU runs the segments one by one in step order, and
        step order satisfies every dependency (it is a valid schedule)."""

    def wait(self, stream: object, event: object) -> None:
        """Nothing to wait for (see ``record``)."""

    def capture(self, calls: Sequence[Call], recording: Call, stream: object, pool: object,
                side: Sequence[object] = ()) -> Graph:
        recording()
        return _EagerGraph(calls)

    def release_pool(self, pool: object) -> None:
        pass

    def synchronize(self, device: torch.device) -> None:
        pass

    def is_capturing(self, stream: object) -> bool:
        return False


class _CpuStream:
    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = device


class _HostEvent:
    """An event on the host: host work is finished when its Python returns."""

    __slots__ = ()


class _CpuPool:
    __slots__ = ("device",)

    def __init__(self, device: torch.device):
        self.device = device


class _CudaGraph(Graph):
    __slots__ = ("_instantiating", "graph", "replay")

    def __init__(self, graph, instantiating: concurrent.futures.Future | None = None):
        self.graph = graph
        self._instantiating = instantiating
        self.replay = graph.replay if instantiating is None else self._replay_when_ready

    def ready(self) -> None:
        future = self._instantiating
        if future is not None:
            future.result()  # raises what instantiating raised, at every call
            self._instantiating = None
            self.replay = self.graph.replay

    def _replay_when_ready(self) -> None:
        self.ready()
        self.replay()

    def destroy(self) -> None:
        future, self._instantiating = self._instantiating, None
        if future is not None and not future.cancel():
            concurrent.futures.wait((future,))  # a reset beside the instantiation would free what it reads
        if self.graph is not None:
            self.graph.reset()
            self.graph = None
            self.replay = _destroyed


#: A graph whose recording took at least this long is instantiated on the worker thread;
#: a shorter one at once. Instantiation grows with the graph as recording does: a whole
#: step takes tens of milliseconds, worth overlapping; a PIECEWISE piece about one, less
#: than handing it to another thread and back costs the host. On the H200, 61-layer dsv4
#: (``bench/results/ready-ab.txt``): FULL went from 1.13x to 1.06x the hand-written loop,
#: and PIECEWISE, every piece on the worker, from 1.09x to 1.18x.
ASYNC_INSTANTIATE_S = 0.02


@functools.cache
def _instantiator() -> concurrent.futures.ThreadPoolExecutor:
    """The process's one thread that instantiates captured graphs.

    ``cudaGraphInstantiate`` turns a recorded graph into one the device can launch: host
    work that grows with the graph (tens of milliseconds for a whole 61-layer decode
    step). torch runs it without the GIL, so done here it overlaps the Python that
    records the next region or warms the next descriptor up, instead of adding to it.
    One thread: graphs are ready in the order they were captured."""
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphflow-instantiate")


# A forked child has none of the parent's threads: it makes its own worker, should it capture.
os.register_at_fork(after_in_child=_instantiator.cache_clear)


def _instantiate(graph: _Pieces, device: torch.device) -> None:
    with torch.cuda.device(device):  # the worker's current device is its own: set the graph's
        graph.instantiate()


class _Pieces:
    """What a region is captured into when it may be cut: one ``CUDAGraph`` per
    piece, with the eager calls between them.

    ``_capturing`` calls ``capture_begin`` on entry and ``capture_end`` on exit;
    ``cut`` ends the current piece and begins the next with the same pool and options,
    so the context manager ends whichever piece is open last. Replay runs the pieces
    and the calls between them in order; a region never cut is its one graph.
    """

    def __init__(self, keep_graph: bool):
        self.keep_graph = keep_graph
        self.graphs = [torch.cuda.CUDAGraph(keep_graph=keep_graph)]
        self.between: list[Call] = []
        self._begin: tuple[tuple, dict] = ((), {})
        self._steps: tuple[Call, ...] = ()
        self._capturing = False

    def capture_begin(self, *pool, **options) -> None:
        self._begin = (pool, options)
        self.graphs[-1].capture_begin(*pool, **options)
        self._capturing = True

    @property
    def open(self) -> bool:
        """Whether the last piece's capture began and never ended (an invalidated capture
        whose end failed)."""
        return self._capturing

    def capture_end(self) -> None:
        # After a cut that failed between two pieces nothing is capturing: the failure,
        # not a second capture_end, is what the caller must see.
        if self._capturing:
            self.graphs[-1].capture_end()  # when this raises, the capture may be open still: a retry ends it
            self._capturing = False

    def cut(self, between: Callable[[], tuple[Call, object]]) -> object:
        self.capture_end()
        call, value = between()
        self.between.append(call)
        graph = torch.cuda.CUDAGraph(keep_graph=self.keep_graph)
        self.graphs.append(graph)
        pool, options = self._begin
        graph.capture_begin(*pool, **options)
        self._capturing = True
        return value

    def instantiate(self) -> None:
        for graph in self.graphs:
            graph.instantiate()

    def reset(self) -> None:
        for graph in self.graphs:
            graph.reset()
        self.between.clear()  # the eager calls hold the kept arguments and outputs: let them go
        self._steps = ()

    def result(self):
        """The captured graph: the one ``CUDAGraph`` itself when never cut, else this."""
        if not self.between:
            return self.graphs[0]
        steps = [self.graphs[0].replay]
        for call, graph in zip(self.between, self.graphs[1:]):
            steps += [call, graph.replay]
        self._steps = tuple(steps)
        return self

    def replay(self) -> None:
        for step in self._steps:
            step()


@contextlib.contextmanager
def _capturing(graph: _Pieces, pool: object, stream: object, mode: str) -> Iterator[None]:
    """``torch.cuda.graph`` without what it does before each capture (a device sync and
    emptying the allocators' caches): ``Backend.make_room`` does the device's before a
    descriptor's captures, when it is short of memory.
    As there, a ``capture_end`` that raises leaves ``stream`` current (the caller restores it)."""
    context = torch.cuda.stream(stream)
    context.__enter__()
    graph.capture_begin(pool, capture_error_mode=mode)
    try:
        yield
    finally:
        graph.capture_end()
        context.__exit__(None, None, None)


class _Switch:
    """``torch.cuda.stream(to)`` for a caller that knows its current stream (``back``, on
    ``to``'s device): two switches and none of the lookups, which a step that switches
    streams hundreds of times pays for in every warmup and capture."""

    __slots__ = ("back", "to")

    def __init__(self, to: torch.cuda.Stream, back: torch.cuda.Stream) -> None:
        self.to, self.back = to, back

    def __enter__(self) -> None:
        torch.cuda.set_stream(self.to)

    def __exit__(self, *exc_info: object) -> None:
        torch.cuda.set_stream(self.back)


class CudaBackend(Backend):
    """``torch.cuda.CUDAGraph`` regions on explicit per-device streams and one pool per device.

    Capture on a non-default GPU needs a stream created on that device: with only
    ``set_device``, the capture runs on another device's stream, and the graph records
    nothing or replays stale data.

    Buffers may also live on ``cpu``: host memory the runner fills with a plain copy and
    only eager segments read (validation rule GF302 keeps graph segments off them), as
    serving engines keep sequence lengths on the host. The host has no stream to order,
    no pool and nothing to synchronize.
    """

    name = "cuda"
    captures_graphs = True

    def __init__(self, *, debug_graphs: bool = False, instantiate_async: bool = True) -> None:
        super().__init__()
        #: Keep each graph's definition after capture (``CUDAGraph(keep_graph=True)``), so
        #: ``graph.graph.debug_dump(path)`` writes it as Graphviz DOT to inspect what was captured.
        self.debug_graphs = debug_graphs
        #: Instantiate each large graph on a worker thread (``_instantiator``,
        #: ``ASYNC_INSTANTIATE_S``) while the pipeline goes on; ``Graph.ready()`` waits for
        #: it. Graph definitions are kept (host memory), and captures run in "thread_local"
        #: mode: in "global" mode the worker's CUDA calls during the next capture would be refused.
        self.instantiate_async = instantiate_async
        if instantiate_async:
            self.capture_error_mode = "thread_local"
        # device -> the most device memory one descriptor's captures have taken, and what
        # the current descriptor's have taken so far (``make_room`` starts a descriptor).
        self._taken: dict[torch.device, int] = {}
        self._taking: dict[torch.device, int] = {}
        # The region this thread records, which ``cut`` ends a piece of. Per thread: a lazy
        # engine's server runs the model eagerly (through the same cut points) meanwhile.
        self._recording = threading.local()

    @property
    def instantiates_later(self) -> bool:
        return self.instantiate_async

    def device(self, name: str) -> torch.device:
        device = torch.device(name)
        if device.type == "cpu":
            return device
        if device.type != "cuda":
            raise ValueError(f"device {name!r} is neither a CUDA device nor cpu — write it 'cuda:N' or 'cpu'")
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())

    def new_stream(self, device: torch.device) -> object:
        if device.type == "cpu":
            return _CpuStream(device)
        return cuda_streams.take(device)  # one the process used before, where one is free

    def release_stream(self, stream: object) -> None:
        if not isinstance(stream, _CpuStream):
            cuda_streams.give(stream)

    def new_pool(self, device: torch.device) -> object:
        if device.type == "cpu":
            raise ValueError("a graph segment on cpu cannot be captured by the cuda backend — put its buffers "
                             "and stream on a cuda device, or make it an eager segment")
        with torch.cuda.device(device):
            pool = torch.cuda.graph_pool_handle()
        workspace_watch.hold(pool)
        return pool

    def new_event(self, device: torch.device) -> object:
        if device.type == "cpu":
            return _HostEvent()
        return torch.cuda.Event()  # created on its device at the first record

    @contextlib.contextmanager
    def on_stream(self, stream: object) -> Iterator[None]:
        if isinstance(stream, _CpuStream):
            yield
            return
        caller = torch.cuda.current_stream(stream.device)
        stream.wait_stream(caller)
        with torch.cuda.stream(stream):
            yield
        caller.wait_stream(stream)

    def use(self, stream: object, current: object) -> contextlib.AbstractContextManager[None]:
        if isinstance(stream, _CpuStream):
            return contextlib.nullcontext()
        if isinstance(current, torch.cuda.Stream) and current.device_index == stream.device_index:
            return _Switch(stream, current)
        return torch.cuda.stream(stream)  # another device's stream: it restores both devices' streams

    def record(self, event: object, stream: object) -> None:
        # Host work is done when its Python returns: a host event needs no record.
        if not isinstance(event, _HostEvent):
            event.record(stream)

    def wait(self, stream: object, event: object) -> None:
        if isinstance(event, _HostEvent):
            return
        if isinstance(stream, _CpuStream):
            event.synchronize()  # the host itself waits: an eager segment reading device results
        else:
            stream.wait_event(event)

    def make_room(self, device: torch.device) -> None:
        # What torch.cuda.graph does before every capture, done once per descriptor and only
        # when the device is short of memory (vLLM skips it after its first graph): emptying
        # the cache waits for the device, and the next warmup allocates it all again.
        if device.type == "cpu":
            return
        last = self._taking.pop(device, None)
        if last is not None:
            self._taken[device] = max(self._taken.get(device, 0), last)
        free, _ = torch.cuda.mem_get_info(device)
        if short_of_room(free, self._taken.get(device)):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def capture(self, calls: Sequence[Call], recording: Call, stream: object, pool: object,
                side: Sequence[object] = ()) -> Graph:
        keep = self.debug_graphs or self.instantiate_async  # kept graphs instantiate when asked to
        graph = _Pieces(keep)
        before = torch.cuda.current_stream(stream.device)
        reserved = torch.cuda.memory_reserved(stream.device)
        began = time.perf_counter()
        try:
            with _capturing(graph, pool, stream, self.capture_error_mode):
                self._recording.open = graph
                try:
                    recording()
                except BaseException:
                    # A side stream still joined into the capture makes ending it fail
                    # as "unjoined": join it back first, so the capture ends cleanly.
                    self._rejoin(stream, side)
                    raise
                finally:
                    self._recording.open = None
        except BaseException:
            # torch.cuda.graph skips restoring the stream when capture_end raises; end a
            # capture still open so no stream is left capturing, then drop the graph.
            if self.is_capturing(stream):
                with contextlib.suppress(RuntimeError), torch.cuda.stream(stream):
                    graph.capture_end()
            if torch.cuda.current_stream(stream.device) != before:
                torch.cuda.set_stream(before)
            recover_from_failed_capture(stream.device, pool, unended=graph.open)
            graph.reset()
            raise
        device = stream.device
        self._taking[device] = self._taking.get(device, 0) + torch.cuda.memory_reserved(device) - reserved
        if self.instantiate_async and time.perf_counter() - began >= ASYNC_INSTANTIATE_S:
            return _CudaGraph(graph.result(), _instantiator().submit(_instantiate, graph, device))
        if keep:
            graph.instantiate()  # here, as capture_end would
        return _CudaGraph(graph.result())

    def cut(self, between: Callable[[], tuple[Call, object]]) -> object | None:
        graph = getattr(self._recording, "open", None)
        return None if graph is None else graph.cut(between)

    def _rejoin(self, origin: object, side: Sequence[object]) -> None:
        """Make ``origin`` wait for every side stream still capturing. An invalidated
        capture refuses the event calls: ending it on the origin then ends every stream
        joined into it, which is all that is left to do."""
        for stream in side:
            if self.is_capturing(stream):
                with contextlib.suppress(RuntimeError):
                    origin.wait_stream(stream)

    def release_pool(self, pool: object) -> None:
        # The pool has no handle to free: its blocks return once every graph using it is
        # reset; emptying the cache hands them back to the driver. cuBLAS's per-stream
        # workspaces stay: every graph that ran a matmul replays into the workspace it
        # captured, and clearing them (one call for all streams) would free the memory
        # under the process's other live graphs, another engine's, torch.compile's or the
        # user's own. They are cuBLAS's cache, bounded by torch's pool of streams.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        workspace_watch.release(pool)

    def synchronize(self, device: torch.device) -> None:
        if device.type != "cpu":
            torch.cuda.synchronize(device)

    def is_capturing(self, stream: object) -> bool:
        if isinstance(stream, _CpuStream):
            return False
        with torch.cuda.stream(stream):
            return torch.cuda.is_current_stream_capturing()

    def memory_allocated(self, device: torch.device) -> int:
        return 0 if device.type == "cpu" else torch.cuda.memory_allocated(device)

    def probes_pools(self, device: torch.device) -> bool:
        return device.type != "cpu"

    @contextlib.contextmanager
    def pool_probe(self, device: torch.device) -> Iterator[PoolProbe]:
        probe = PoolProbe()
        if device.type == "cpu":
            yield probe
            return
        pool = _ProbePool(device)
        probe.route, probe.outside = pool.route, pool.outside
        try:
            yield probe
            torch.cuda.synchronize(device)
            probe.bytes = self.pool_bytes(pool.id)
        finally:
            probe.route = probe.outside = contextlib.nullcontext  # the pool is this context's alone
            pool.release()
            # Its blocks back to the device now, unless a capture is underway somewhere
            # (torch refuses to empty then, and raises): then at the next emptying.
            with contextlib.suppress(RuntimeError):
                torch.cuda.empty_cache()

    def free_memory(self, device: torch.device) -> int | None:
        if device.type == "cpu":
            return host_available()
        # What the driver has free, plus what torch's cache holds but no tensor uses.
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def pool_bytes(self, pool: object) -> int | None:
        segments = torch.cuda.memory_snapshot()
        if segments and "segment_pool_id" not in segments[0]:
            return None
        return sum(s["total_size"] for s in segments if tuple(s["segment_pool_id"]) == tuple(pool))

    def time_runs(self, device: torch.device | None, calls: Sequence[Call], n: int) -> tuple[list[float], ...]:
        """Each run between two CUDA events, so that a replay counts what the device does,
        not how quickly Python returns. One synchronize before the first run (nothing
        queued earlier may hide the first call's launches) and one after the last, which
        reads every event: the calls are timed back to back, with none between them."""
        if device is None or device.type == "cpu":
            return super().time_runs(device, calls, n)
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
                  for _ in calls]
        torch.cuda.synchronize(device)
        for call, pairs in zip(calls, events):
            for start, stop in pairs:
                start.record()
                call()
                stop.record()
        torch.cuda.synchronize(device)
        return tuple([start.elapsed_time(stop) / 1000.0 for start, stop in pairs] for pairs in events)


class _ProbePool:
    """A private pool of the allocator for ``pool_probe``, with no ``MemPool`` object.

    Destroying a ``torch.cuda.MemPool`` empties it, and emptying asserts that no capture
    is underway in the process: with one underway (a lazy engine's thread, another
    engine's, torch.compile's), the assertion fires in the destructor and the process
    aborts ("captures_underway.empty() INTERNAL ASSERT FAILED" in ``~MemPool``: the CUDA
    test suite on the H200, at a probe's end). This pool is a
    graph pool id, used and given back as ``torch.cuda.graph`` does: the allocator makes
    it at the first ``route``, this object holds that first use, each later ``route``
    takes and gives back one of its own, and ``release`` gives back the first. Released,
    its blocks are freed by the next emptying of the cache."""

    def __init__(self, device: torch.device) -> None:
        self.id = torch.cuda.graph_pool_handle()
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._held = False

    @contextlib.contextmanager
    def route(self) -> Iterator[None]:
        torch._C._cuda_beginAllocateCurrentThreadToPool(self._index, self.id)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(self._index, self.id)
            if self._held:
                torch._C._cuda_releasePool(self._index, self.id)
            self._held = True

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        """Inside ``route``: this thread's allocations leave the pool until the end. Routing
        again takes a use of the pool (as each ``route`` does), given back at once: the
        route holds its own."""
        torch._C._cuda_endAllocateToPool(self._index, self.id)
        try:
            yield
        finally:
            torch._C._cuda_beginAllocateCurrentThreadToPool(self._index, self.id)
            torch._C._cuda_releasePool(self._index, self.id)

    def release(self) -> None:
        if self._held:
            torch._C._cuda_releasePool(self._index, self.id)
            self._held = False


class WorkspaceClearedWarning(UserWarning):
    """cuBLAS's workspaces were cleared while graphflow holds captured graphs."""


class _WorkspaceWatch:
    """Warns when cuBLAS's workspaces are cleared while graphflow holds graph pools.

    ``torch._C._cuda_clearCublasWorkspaces`` frees the workspace of every stream at once,
    and torch.compile's reduce-overhead mode calls it whenever it records its graphs
    (``torch._inductor.cudagraph_trees.clear_cublas_manager``). A graph that ran a matmul
    replays into the workspace it captured: after the clear, into freed memory, giving
    wrong results or an illegal memory access long after the cause. While any pool is
    held the call is wrapped to say so at the moment it happens; the wrapper goes with
    the last pool. The clear itself still runs: torch.compile's own graphs rely on it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[int, object] = {}
        self._original: Callable[[], None] | None = None

    def hold(self, pool: object) -> None:
        with self._lock:
            self._pools[id(pool)] = pool
            if self._original is None and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
                self._original = original = torch._C._cuda_clearCublasWorkspaces

                def clearing() -> None:  # a reference kept past the release still clears
                    self._warn()
                    original()

                torch._C._cuda_clearCublasWorkspaces = clearing

    def release(self, pool: object) -> None:
        with self._lock:
            self._pools.pop(id(pool), None)
            if not self._pools:
                self._unwrap()

    def reset(self) -> None:
        """Forget every pool and put torch's function back (tests)."""
        with self._lock:
            self._pools.clear()
            self._unwrap()

    def _unwrap(self) -> None:
        if self._original is not None:
            torch._C._cuda_clearCublasWorkspaces = self._original
            self._original = None

    def _warn(self) -> None:
        if self._pools:
            warnings.warn(WorkspaceClearedWarning(
                f"cuBLAS's workspaces are being cleared (torch.compile(mode='reduce-overhead') does it when it "
                f"records its CUDA graphs) while graphflow holds {len(self._pools)} graph pool(s): graphs captured "
                "before replay their matmuls into freed memory — warm torch.compile up before graphflow captures, "
                "or compile the segments inside the plan (compile: inductor); see docs/compile.md"), stacklevel=3)


#: The process's one watch over cuBLAS's workspaces (see ``_WorkspaceWatch``).
workspace_watch = _WorkspaceWatch()


#: Free device memory below which ``make_room`` empties the allocator's cache however
#: little the captures so far have taken: room for cuBLAS's workspaces, a kernel's
#: module, the pool's first block of a larger size.
ROOM_BYTES = 1 << 30


def short_of_room(free: int, taken: int | None) -> bool:
    """Whether a descriptor's captures need the allocator's cache given back first:
    before any capture on the device (the largest descriptor comes first, and takes the
    most), or when less is free than twice the most one descriptor's captures have taken
    (``taken``), or than ``ROOM_BYTES``. Otherwise what the cache holds stays for the next
    warmup, which would allocate it again."""
    return taken is None or free < max(ROOM_BYTES, 2 * taken)


def recover_from_failed_capture(device: torch.device | None, pool: object | None, graph: object | None = None,
                                stream: object | None = None, *, unended: bool = False) -> None:
    """Put the allocator and the device's random generator back outside capture after a
    capture that failed to end.

    A capture invalidated midway (a host sync in it) fails in ``capture_end`` at
    ``cudaStreamEndCapture``, before torch runs the rest of it: the caching allocators
    (device and pinned host) still route the stream's allocations to the graph's pool
    ("already recording to mempool_id" at the next capture into it: vLLM captures every
    size into one pool), and the default generator still counts itself inside a capture,
    so every later random op on the device fails with "Offset increment outside graph
    capture encountered unexpectedly". torch has no call that finishes such a capture.

    Given the ``graph`` (a ``CUDAGraph`` whose capture failed) and its capture
    ``stream``, an empty capture is begun on that stream (through the CUDA driver, not
    torch, so torch's bookkeeping is not touched) and the graph's own ``capture_end`` is
    run again: it now ends that empty capture and runs everything the failure skipped,
    both allocators' pools and the generator's epilogue, and the graph can be reset like
    any other. Without them, or where that cannot be done, the device allocator's
    recording to ``pool`` is ended directly and an empty capture of a throwaway graph
    sets the generator right; ``unended`` (a capture into ``pool`` began and never
    ended) also gives back the pool's use that capture took: torch's ``reset`` gives it
    back only for a capture that ended, so the pool's blocks were never freed (2 MiB of
    reserved memory lost at every invalidated capture, on the H200). ``device`` None: the current one. Without CUDA there is
    nothing to put back.

    The vLLM plugin's rollback passes the graph and stream (vLLM captures every size into
    one pool, so the next capture needs both allocators put back). graphflow's own
    backend does not yet: on the H200 the empty capture after a failure on a side
    stream, joined into a capture on another, left that stream current afterwards, and a
    graphflow engine captures into a pool of its own per run, so the direct path serves it.
    """
    if not torch.cuda.is_available():
        return
    if graph is not None and stream is not None and _finish_with_an_empty_capture(graph, stream):
        return
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if pool is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with contextlib.suppress(RuntimeError):  # ended already: the capture got that far
            torch._C._cuda_endAllocateToPool(index, pool)
        if unended:
            torch._C._cuda_releasePool(index, pool)
    throwaway = torch.cuda.CUDAGraph()
    with torch.cuda.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the CUDA graph is empty": it is meant to be
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side), contextlib.suppress(RuntimeError):
            throwaway.capture_begin()
            throwaway.capture_end()
        throwaway.reset()


#: ``CUstreamCaptureMode``: the empty capture may run beside other threads' CUDA calls.
_CAPTURE_MODE_RELAXED = 2


def _finish_with_an_empty_capture(graph: object, stream: object) -> bool:
    """Run the failed capture's ``capture_end`` again over an empty capture (see
    ``recover_from_failed_capture``); False where it did not apply or did not work."""
    try:
        graph.pool()
        return False  # its capture ended: nothing was skipped
    except RuntimeError:
        pass
    begin = _driver_begin_capture()
    if begin is None:
        return False
    with torch.cuda.stream(stream):
        if torch.cuda.is_current_stream_capturing():
            return False  # still open: the caller ends it first
        if begin(ctypes.c_void_p(stream.cuda_stream), _CAPTURE_MODE_RELAXED) != 0:
            return False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the CUDA graph is empty": it is meant to be
                graph.capture_end()
        except RuntimeError:
            return False  # the empty capture is ended by capture_end's first call either way
    return True


@functools.cache
def _driver_begin_capture():
    """The CUDA driver's ``cuStreamBeginCapture``, or None where it cannot be loaded."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        begin = driver.cuStreamBeginCapture_v2
    except (OSError, AttributeError):
        return None
    begin.argtypes, begin.restype = (ctypes.c_void_p, ctypes.c_int), ctypes.c_int
    return begin


class BackendKind(enum.Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


#: Which class serves each kind; AUTO picks CUDA when a GPU is present.
BACKENDS: dict[BackendKind, type[Backend]] = {BackendKind.CPU: CpuBackend, BackendKind.CUDA: CudaBackend}


def make_backend(kind: BackendKind | str = BackendKind.AUTO) -> Backend:
    kind = BackendKind(kind)
    if kind is BackendKind.AUTO:
        kind = BackendKind.CUDA if torch.cuda.is_available() else BackendKind.CPU
    if kind is BackendKind.CUDA and not torch.cuda.is_available():
        raise OptionError("the cuda backend needs a CUDA GPU, and torch sees none",
                          hint="use the cpu backend ({0}) or auto ({1})",
                          settings=(OptionFix("backend", "cpu"), OptionFix("backend", "auto")))
    return BACKENDS[kind]()
