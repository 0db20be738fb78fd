"""Capture as a transaction: remember what capture changes, give all of it back on failure.

vLLM's V1 ``capture_model`` turns the capturing flag on and off with no ``try/finally``;
a failure at any descriptor leaves the flag on, half-filled graph entries in every
``CUDAGraphWrapper``, the dispatcher's keys (so decode batches are routed to FULL graphs
that were never captured, and the wrapper captures them while serving), and the
compilation counters. vLLM's own ``profile_cudagraph_memory`` shows the cure in its
``finally``; this class is that cure made general: each step registers, before capture
starts, how to undo what capture may change, and ``rollback`` runs every undo, newest
first, even when one raises (graphflow's ``UndoStack``).

It takes the objects and callables to restore, not vLLM itself, so the same code runs
on vLLM's objects in the plugin and on plain ``torch.cuda.graph`` objects in a CUDA test.

The failure's traceback holds the frames that were capturing, and they hold the
half-captured ``CUDAGraph`` objects, whose pool memory is not returned while they live;
``rollback(error)`` clears those frames' locals first, so the memory really comes back
although the error (and its traceback, for the report) is still alive.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable
from typing import Any

from graphflow.engine.rollback import UndoError, UndoStack

__all__ = ["CaptureTransaction"]


class CaptureTransaction:
    """What one capture may change, and how to give it back.

    Register steps before capture begins (each records the state it restores now);
    then ``commit()`` on success or ``rollback(error)`` on failure. A transaction is
    finished by either; registering after that raises.
    """

    def __init__(self, name: str = "capture"):
        self.name = name
        self._undo = UndoStack()
        self._finished = False
        self.steps: list[str] = []

    def _push(self, name: str, fn: Callable[[], None]) -> None:
        if self._finished:
            raise RuntimeError(f"transaction {self.name!r} is finished: register steps before capture begins")
        self._undo.push(name, fn)
        self.steps.append(name)

    # -- steps --------------------------------------------------------------------------
    def on_rollback(self, name: str, undo: Callable[[], None]) -> None:
        """Run ``undo`` on rollback (clear the graphs captured so far)."""
        self._push(name, undo)

    def keep(self, name: str, save: Callable[[], Any], restore: Callable[[Any], None]) -> None:
        """Save a value now; restore it on rollback (a counter, a pool handle)."""
        value = save()
        self._push(name, lambda: restore(value))

    def keep_attrs(self, name: str, obj: Any, fields: Iterable[str]) -> None:
        """Save ``obj``'s ``fields`` now; set them back on rollback."""
        saved = {f: getattr(obj, f) for f in fields}

        def restore() -> None:
            for field, value in saved.items():
                setattr(obj, field, value)

        self._push(name, restore)

    def keep_each(self, name: str, holders: Iterable[Any], field: str) -> None:
        """Save ``field`` of every holder (each wrapper's ``graph_pool``); set it back on rollback."""
        saved = [(h, getattr(h, field)) for h in holders]

        def restore() -> None:
            for holder, value in saved:
                setattr(holder, field, value)

        self._push(name, restore)

    def clear_keys(self, name: str, dispatcher: Any) -> None:
        """On rollback, *clear* a V1 dispatcher's keys (never restore them): a key without a
        graph makes the wrapper capture while serving. With no keys the dispatcher runs
        every batch eagerly, as it does before capture."""

        def clear() -> None:
            for keys in dispatcher.cudagraph_keys.values():
                keys.clear()
            dispatcher.keys_initialized = False

        self._push(name, clear)

    def keep_gc(self) -> None:
        """On rollback, the collector is enabled again if it was, and unfrozen if capture froze it."""
        enabled, frozen = gc.isenabled(), gc.get_freeze_count()

        def restore() -> None:
            # Unfreezing thaws what was frozen before capture too; leaving capture's objects
            # frozen would keep them (and their tensors) out of every collection.
            if gc.get_freeze_count() > frozen:
                gc.unfreeze()
            if enabled:
                gc.enable()
            else:
                gc.disable()

        self._push("garbage collector", restore)

    # -- ending -------------------------------------------------------------------------
    def commit(self) -> None:
        """Capture succeeded: keep everything, forget the undos."""
        self._finished = True
        self._undo = UndoStack()

    def rollback(self, error: BaseException | None = None) -> UndoError | None:
        """Undo every step, newest first; returns the undos that raised (the rest still ran).

        ``error``'s traceback frames are cleared first, so half-captured graphs they hold
        are freed before the steps that release memory run.
        """
        self._finished = True
        if error is not None:
            _release_frames(error)
        return self._undo.unwind()



def _release_frames(error: BaseException) -> None:
    """Drop the locals of the frames ``error`` (and its causes) unwound through, ending
    first any capture a graph in them left open.

    A capture that raised (``torch.cuda.graph`` whose ``capture_end`` failed) leaves its
    ``CUDAGraph`` half made: the stream may still be capturing, the allocator still records
    the stream's allocations to the graph's pool, and torch's CUDA generator still counts
    itself inside a capture, so every later random op fails ("Offset increment outside
    graph capture"). vLLM's wrapper keeps that graph only in its frames, so here, before the
    frames go: end the capture if it is still open, reset the graph and put the allocator
    and the generator right (``recover_from_failed_capture``), as graphflow's own backend
    does. The pool comes from the ``torch.cuda.graph`` context that captured, found in the
    frame of its ``__exit__``: a graph whose capture failed cannot say its pool itself.
    """
    frames, graphs = [], {}
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        tb = error.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            for value in tb.tb_frame.f_locals.values():
                _note_graph(value, graphs)
            tb = tb.tb_next
        error = error.__cause__ or error.__context__
    for graph, stream, pool in graphs.values():
        _end_graph(graph, stream, pool)
    for frame in frames:
        snapshot = frame.f_locals  # before 3.13 a dict the frame caches: it holds them too
        with contextlib.suppress(AttributeError, TypeError, ValueError):  # 3.13's proxy cannot drop locals
            snapshot.clear()
        del snapshot
        with contextlib.suppress(RuntimeError):  # a frame still running (ours) cannot be cleared
            frame.clear()


def _note_graph(value, graphs: dict) -> None:
    """Record in ``graphs`` (by id) a ``CUDAGraph`` ``value`` is or captures with its
    stream and pool; what a capturing context knows is kept over a bare graph's nothing."""
    import torch

    graph = value if isinstance(value, torch.cuda.CUDAGraph) else getattr(value, "cuda_graph", None)
    if not isinstance(graph, torch.cuda.CUDAGraph):
        return
    pools = getattr(value, "pool", ())
    pool = pools[0] if isinstance(pools, tuple) and pools else None
    stream = getattr(value, "capture_stream", None)
    known = graphs.get(id(graph), (graph, None, None))
    graphs[id(graph)] = (graph, stream or known[1], pool if pool is not None else known[2])


def _end_graph(graph, stream, pool) -> None:
    import torch

    from graphflow.engine.backend import recover_from_failed_capture

    if stream is not None:
        with torch.cuda.stream(stream):
            if torch.cuda.is_current_stream_capturing():
                with contextlib.suppress(RuntimeError):
                    graph.capture_end()
    recover_from_failed_capture(None, pool, graph, stream)
    with contextlib.suppress(RuntimeError):
        graph.reset()
