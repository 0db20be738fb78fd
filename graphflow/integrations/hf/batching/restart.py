"""A server's FULL keys saved, and brought back in a new process without capturing them.

A restarted server captures its keys again. The FULL keys (the decode-only batches, one
whole graph each) are most of a serving plan and most of its capture, and they are
captured beside the first requests, slowing them. So a server that ran once keeps them:

* **Save** (``Serving.save_graphs(directory)``, after some traffic): each FULL key's
  graph captured so far read from the driver as plain data (``graphflow.engine.restart``), with the
  regions its addresses point into: the engine's static tensors and KV cache by their
  names in the plan, the model's tensors by attribute path, the graph pools' blocks and
  any other memory (a library's workspace) by the order it was met; beside the key of
  what must match (GPU, driver, torch, CUDA, the serving plan, the model's code and
  tensors).
* **Restore** (``serve(manager, graphs_from=directory)``): after the keys captured before
  serving (foreground: the PIECEWISE keys), the kernels their graphs launch, and every
  other kernel of the same libraries, are found by name; the saved keys whose kernels are
  still missing are captured, the fewest that find every library; every other saved key
  is built from its saved nodes on several threads and goes live unchecked. Its first
  batch checks it against the engine's eager step, as for a key captured beside serving:
  a wrong one is served eagerly and the log says why. A key whose graph the driver
  refuses is captured as if it had not been saved. A key of what must match that differs
  (another plan, another torch), or a tensor that is not here as it was saved, refuses
  the saved graphs in one line, and the keys are captured as without.

PIECEWISE keys are not saved: their attention calls run eagerly between pieces, made by
Python objects mapped at capture against the step's batch (``pieces``), and a foreground
capture takes about a second for all of them.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import time

import attrs
import torch

from graphflow.engine.restart import driver, store
from graphflow.engine.restart.key import restart_key
from graphflow.engine.restart.packed import pack
from graphflow.engine.restart.regions import AddressBook, model_tensors
from graphflow.engine.restart.run import (
    RebuiltGraph,
    Refused,
    check_key,
    fewest_captures,
    place_regions,
    read_bytes,
    refused_line,
)
from graphflow.engine.restart.saved import SavedDescriptor, SavedRun
from graphflow.engine.rollback import UndoStack
from graphflow.errors import PlanError
from graphflow.integrations.hf.batching.capture import KeyCapture, KeyGraph
from graphflow.plan import Mode

__all__ = ["KeysRestart", "engine_tensors", "restore_keys", "save_keys"]

log = logging.getLogger("graphflow.serving")


@attrs.frozen
class KeysRestart:
    """What saving or restoring a server's keys did: ``saved`` keys written, or
    ``restored`` built from saved graphs and ``captured`` captured to find their kernels
    (each with why in ``recaptured``); ``left_out``: keys not saved, or not restored
    (the driver refused their graph; they are captured as without saved graphs), with
    why; ``refused`` the one line saying why the saved graphs were not used at all.
    ``built``: nodes, seconds adding and instantiating, and the device memory the
    restored graphs hold (``memory_bytes``: their pool blocks and workspaces, allocated
    outside the graph pools)."""

    directory: str
    saved: int = 0
    restored: int = 0
    captured: int = 0
    refused: str | None = None
    seconds: float = 0.0
    recaptured: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    built: dict = attrs.field(factory=dict)


def engine_tensors(processor) -> list[tuple[str, torch.Tensor]]:
    """The engine's tensors a graph may point into, named alike in every process that
    builds the engine with the same settings: its IOs' and its cache's, by attribute path."""
    return ([(f"io.{name}", t) for name, t in model_tensors(processor.inputs_and_outputs)]
            + [(f"cache.{name}", t) for name, t in model_tensors(processor.cache)])


def _book(capture: KeyCapture, device: torch.device, pools: bool) -> AddressBook:
    """The regions a server's graphs may point into, named: the engine's tensors first,
    then the model's, then (``pools``) the graph pools' blocks; anything else is found as
    the allocation it is in."""
    book = AddressBook(driver.allocation)
    book.add_tensors("buffer", engine_tensors(capture.processor), device)
    book.add_tensors("model", model_tensors(capture.model), device)
    if pools:
        book.add_pool_blocks(capture.pools)
    return book


def _handles(graph) -> list[int]:
    """The ``cudaGraph_t`` of each piece of a captured key's graph (one for a FULL key)."""
    inner = getattr(graph, "graph", None)
    pieces = getattr(inner, "graphs", None)
    graphs = pieces if pieces is not None else [inner]
    if not all(isinstance(g, torch.cuda.CUDAGraph) for g in graphs):
        raise driver.Unsupported("a graph this backend did not record")
    return [g.raw_cuda_graph() for g in graphs]


def _learn(functions: driver.Functions, held: KeyGraph) -> None:
    """The kernels ``held``'s graph launches, and their libraries', known to ``functions``."""
    held.graph.ready()
    for handle in _handles(held.graph):
        functions.add_graph(handle)


def save_keys(capture: KeyCapture, directory: pathlib.Path) -> KeysRestart:
    """Every FULL key ``capture`` holds, its graph written to ``directory`` (see the module
    docstring); a key whose graph holds what a new process cannot build is left out, with why."""
    driver.check_available()
    began = time.perf_counter()
    device = capture.processor.inputs_and_outputs.device
    if device.type != "cuda":
        raise PlanError(f"saving graphs needs graphs recorded on a GPU; this engine runs on {device}",
                        element="save_graphs")
    book = _book(capture, device, pools=True)
    saved, left_out = [], []
    for key, held in capture.held().items():
        if key.mode is not Mode.FULL:
            continue
        held.graph.ready()
        try:
            graphs = tuple(pack(driver.read(handle, book)) for handle in _handles(held.graph))
        except driver.Unsupported as exc:
            left_out.append(f"{key}: its graph holds {exc}")
            continue
        saved.append(SavedDescriptor(key.q, key.mode.value, graphs, key=str(key)))
    regions = book.pointed_into(functools.partial(read_bytes, device))
    run = SavedRun(restart_key(capture.plan, capture.model, device), regions, tuple(saved))
    store.write(run, directory)
    return KeysRestart(str(directory), saved=len(saved), left_out=tuple(left_out),
                       seconds=time.perf_counter() - began)


def restore_keys(capture: KeyCapture, directory: pathlib.Path, stack: UndoStack) -> KeysRestart:
    """The saved FULL keys of ``directory`` live in ``capture`` without capturing them (see
    the module docstring); the restore's memory and graphs are given back when ``stack``
    unwinds. ``refused`` when the saved graphs cannot be used, everything this did undone."""
    began = time.perf_counter()
    own = UndoStack()
    built: dict = {}
    try:
        restored, recaptured, left = _restore(capture, directory, own, built)
    except Exception as exc:  # noqa: BLE001 - every failure falls back to a capture, said in one line
        failures = own.unwind()
        line = refused_line(directory, exc, failures)
        log.warning("graphflow: %s", line)
        return KeysRestart(str(directory), refused=line, seconds=time.perf_counter() - began)
    except BaseException:  # Ctrl-C: the restore undone, and serving stops
        own.unwind()
        raise
    stack.adopt(own)
    return KeysRestart(str(directory), restored=restored, captured=len(recaptured), recaptured=recaptured,
                       left_out=left, seconds=time.perf_counter() - began, built=built)


def _restore(capture: KeyCapture, directory: pathlib.Path, stack: UndoStack, built: dict
             ) -> tuple[int, tuple[str, ...], tuple[str, ...]]:
    """The restore itself (``restore_keys``): how many keys were built, those captured to
    find kernels and why, those the driver refused and why (left to be captured)."""
    run = store.load(directory)
    device = capture.processor.inputs_and_outputs.device
    if device.type != "cuda":
        raise Refused(f"this engine runs on {device}, which replays no graphs")
    check_key(run.key, restart_key(capture.plan, capture.model, device))
    planned = {str(key): key for key in capture.plan.keys if key.mode is Mode.FULL}
    held = capture.held()
    pending = {index: (planned[entry.key], entry) for index, entry in enumerate(run.descriptors)
               if entry.key in planned and planned[entry.key] not in held}
    places = place_regions(_book(capture, device, pools=False), run.regions, device, stack)
    built["memory_bytes"] = sum(r.size for r in run.regions.values() if r.kind not in ("model", "buffer"))
    functions = driver.Functions()
    for graph in held.values():
        _learn(functions, graph)
    recaptured = []
    for index, why in fewest_captures(functions, pending):
        key = pending.pop(index)[0]
        capture.capture_one(key)
        taught = capture.held().get(key)
        if taught is None:
            raise Refused(f"{key} could not be captured to find its kernels")
        _learn(functions, taught)
        recaptured.append(f"{key}: {why}")
    keys = [key for key, _ in pending.values()]
    results = driver.build_all([entry.graphs[0] for _, entry in pending.values()], places, functions, built)
    restored, left = [], []
    for key, result in zip(keys, results):
        if isinstance(result, driver.DriverError):  # captured as if not saved
            left.append(f"{key}: {result}")
            continue
        graph = RebuiltGraph(result)
        stack.push(f"destroy the restored graph of {key}", graph.destroy)
        restored.append(KeyGraph(key, graph, checked=False))
    for graph in restored:  # nothing fails from here on
        capture.adopt(graph)
    return len(restored), tuple(recaptured), tuple(left)
