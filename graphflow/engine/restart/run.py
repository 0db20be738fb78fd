"""Save a committed run's graphs; bring a new process's run live from them.

``save`` reads every graph of a committed foreground run into plain data
(``graphflow.engine.restart.driver.read``, packed: ``graphflow.engine.restart.packed``)
with the regions its addresses point into and the multiplications each capture made,
and writes them beside the key of what must match (``graphflow.engine.restart.key``).

``restore`` is step 3 of a run that has saved graphs: after allocate (the model built,
the static buffers made), it checks the key, places every region (the model's tensors
and the buffers where this process has them, the pool's blocks and other memory
allocated afresh), captures one descriptor for real (its kernels, and every kernel of
the modules they are in, are then found by name, ``Functions``), loads the libraries
of kernels still missing by running the multiplications that launch them
(``_load_libraries``), captures the fewest descriptors that find the rest (``fewest_captures``),
and builds every other descriptor's graphs from the saved nodes, on several threads
(``_build``). A descriptor that cannot be built (not saved,
a kernel not found here, a node or a graph the driver refuses) is captured instead, and
``Restart.recaptured`` says why: the restore keeps the largest part that works, and one
run shows every node that cannot be rebuilt, not only the first. The usual sample is
then verified against a fresh eager step, and the rest are checked on their first batch,
as after a capture. All of it runs on a rollback stack of its own: a key that does not
match, a region that is not here or a verification that fails unwinds it, says why in
one line, and the run captures as it would have.
"""

from __future__ import annotations

import collections
import functools
import pathlib
import time
import warnings
from collections.abc import Iterator, Mapping

import attrs
import torch

from graphflow.engine.allocate import Allocation, step_items
from graphflow.engine.backend import Graph
from graphflow.engine.buffers import torch_dtype
from graphflow.engine.capture import Captured
from graphflow.engine.context import Context
from graphflow.engine.execute import bind
from graphflow.engine.phase import Tally, Waiting, run_descriptor, run_phase, run_verify
from graphflow.engine.restart import driver, store
from graphflow.engine.restart import matmuls as multiplications
from graphflow.engine.restart.key import differs, restart_key
from graphflow.engine.restart.packed import pack
from graphflow.engine.restart.regions import AddressBook, model_tensors
from graphflow.engine.restart.saved import Matmul, Output, Region, SavedDescriptor, SavedRun
from graphflow.engine.rollback import UndoStack
from graphflow.engine.warmup import DescriptorTime, warmup
from graphflow.events import Phase
from graphflow.plan import Descriptor, Segment

__all__ = ["RebuiltGraph", "Refused", "RegionsDiffer", "Restart", "SavedGraphsNotUsed", "check_key", "fewest_captures",
           "place_regions", "read_bytes", "refused_line", "restore", "save"]


class SavedGraphsNotUsed(UserWarning):
    """Saved graphs were refused, and the run captured instead (the message says why)."""


@attrs.frozen
class Restart:
    """What saving or restoring did, for the report: ``restored`` descriptors built from
    saved graphs, ``captured`` ones captured (the reference, and any that could not be
    built, each with why in ``recaptured``), ``refused`` the one line saying why saved
    graphs were not used at all."""

    directory: str
    saved: int = 0
    restored: int = 0
    captured: int = 0
    left_out: tuple[str, ...] = ()
    refused: str | None = None
    seconds: float = 0.0
    #: Restoring: nodes added, and the seconds adding them and instantiating the graphs took.
    built: dict = attrs.field(factory=dict)
    #: Saving: nodes read, and the seconds reading the graphs, the regions' bytes and writing took.
    saving: dict = attrs.field(factory=dict)
    #: Restoring: each descriptor captured because it could not be built, and why (the
    #: reference capture is not listed).
    recaptured: tuple[str, ...] = ()


def save(ctx: Context, alloc: Allocation, captured: Captured, directory: pathlib.Path,
         matmuls: Mapping[Descriptor, tuple[Matmul, ...]] | None = None) -> Restart:
    """Write every committed descriptor's graphs, and its ``matmuls``, to ``directory``;
    a descriptor whose graphs hold what a new process cannot build is left out, with why."""
    began = time.perf_counter()
    device = next(iter(alloc.pools))
    book = _book(alloc, device)
    descriptors, left_out = [], []
    for descriptor in captured.programs:
        try:
            graphs = tuple(pack(driver.read(_handle(graph), book)) for graph in captured.graphs_of.get(descriptor, ()))
            outputs = _outputs(alloc, descriptor, book)
        except driver.Unsupported as exc:
            left_out.append((descriptor.size, descriptor.mode.value, f"its graph holds {exc}"))
            continue
        descriptors.append(SavedDescriptor(descriptor.size, descriptor.mode.value, graphs, outputs,
                                           (matmuls or {}).get(descriptor, ())))
    read = time.perf_counter()
    regions = book.pointed_into(functools.partial(read_bytes, device))
    contents = time.perf_counter()
    store.write(SavedRun(restart_key(ctx.plan, alloc.model, device), regions, tuple(descriptors), tuple(left_out)),
                directory)
    done = time.perf_counter()
    nodes = sum(g.node_count for d in descriptors for g in d.graphs)
    return Restart(str(directory), saved=len(descriptors),
                   left_out=tuple(f"{size} {mode}: {why}" for size, mode, why in left_out), seconds=done - began,
                   saving={"nodes": nodes, "read_s": read - began, "contents_s": contents - read,
                           "write_s": done - contents})


def _handle(graph: Graph) -> int:
    torch_graph = getattr(graph, "graph", None)
    if not isinstance(torch_graph, torch.cuda.CUDAGraph):
        raise driver.Unsupported("eager calls between its pieces (a region cut by a PIECEWISE break)")
    return torch_graph.raw_cuda_graph()


def _book(alloc: Allocation, device: torch.device) -> AddressBook:
    """The regions a run's graphs may point into, named; the static buffers first (a
    model tensor a buffer adopted is the buffer's), the graph pools' blocks last."""
    book = AddressBook(driver.allocation)
    book.add_tensors("buffer", alloc.buffers.tensors.items(), device)
    book.add_tensors("model", model_tensors(alloc.model), device)
    book.add_pool_blocks(alloc.pool_sets[device])
    return book


def _outputs(alloc: Allocation, descriptor: Descriptor, book: AddressBook) -> tuple[Output, ...]:
    views, placed = alloc.buffers.views(descriptor.size), alloc.buffers.views_of(descriptor)
    outputs = []
    for name, tensor in placed.items():
        if tensor is views[name]:
            continue
        where = book.where(tensor.data_ptr())
        if where is None:
            raise driver.Unsupported(f"output {name} where no region is")
        outputs.append(Output(name, where, tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype)
                              .removeprefix("torch.")))
    return tuple(outputs)


def read_bytes(device: torch.device, start: int, size: int) -> bytes:
    """``size`` bytes of device memory at ``start``, once the device is done writing them."""
    storage = torch._C._construct_storage_from_data_pointer(start, device, size)
    torch.cuda.synchronize(device)
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage).cpu().numpy().tobytes()


class Refused(Exception):
    """Saved graphs that cannot be used here: the message says why, in one line."""


class RegionsDiffer(Refused):
    """A model tensor or static buffer the saved graphs point into is not here as it was saved."""


def restore(ctx: Context, alloc: Allocation, tally: Tally, directory: pathlib.Path
            ) -> tuple[Captured | None, Restart]:
    """Every descriptor live from the graphs saved in ``directory`` (see the module
    docstring); ``(None, refused)`` when they cannot be used, everything this did undone."""
    began = time.perf_counter()
    own = attrs.evolve(ctx, stack=UndoStack())
    mine = Tally()
    try:
        spent: dict = {}
        captured, restored, recaptured = _restore(own, alloc, mine, directory, spent)
    except BaseException as exc:  # noqa: BLE001 - every failure falls back to a capture, said in one line
        failures = own.stack.unwind()
        if not isinstance(exc, Exception):  # Ctrl-C: the restore undone, and the run stops
            raise
        for pools in alloc.pool_sets.values():  # a pool the restore captured into is not captured into again
            pools.failed()
        line = refused_line(directory, exc, failures)
        warnings.warn(line, SavedGraphsNotUsed, stacklevel=2)
        return None, Restart(str(directory), refused=line, seconds=time.perf_counter() - began)
    ctx.stack.adopt(own.stack)
    tally.phases += mine.phases
    tally.times += mine.times
    tally.verified += mine.verified
    tally.prewarm, tally.pool_probe = mine.prewarm, mine.pool_probe
    return captured, Restart(str(directory), restored=restored, captured=1 + len(recaptured),
                             seconds=time.perf_counter() - began, built=spent, recaptured=recaptured)


def check_key(saved: dict, here: dict) -> None:
    """``Refused``, saying which parts differ, unless the saved graphs' key is this process's."""
    why = differs(saved, here)
    if why is not None:
        raise Refused(f"{why} differ{'s' if ';' not in why else ''}")


def refused_line(directory: pathlib.Path, exc: Exception, failures: BaseException | None = None) -> str:
    """The one line saying why saved graphs were not used, ``exc`` being why (and
    ``failures`` what undoing the restore raised)."""
    first = (str(exc).splitlines() or [""])[0]
    why = first if isinstance(exc, (Refused, store.SavedGraphsError)) else f"{type(exc).__name__}: {first}"
    line = f"saved graphs in {directory} not used ({why}); capturing instead"
    return line if failures is None else f"{line} (undoing the restore: {failures})"


def _restore(ctx: Context, alloc: Allocation, tally: Tally, directory: pathlib.Path, spent: dict
             ) -> tuple[Captured, int, tuple[str, ...]]:
    run = store.load(directory)
    if not ctx.backend.captures_graphs:
        raise Refused(f"the {ctx.backend.name} backend replays no graphs")
    device = next(iter(alloc.pools))
    check_key(run.key, restart_key(ctx.plan, alloc.model, device))
    saved = {(d.size, d.mode): d for d in run.descriptors}
    places = place_regions(_book(alloc, device), run.regions, device, ctx.stack)
    # One real capture, the smallest descriptor's: this process's kernels are then found by name.
    order = list(enumerate(ctx.descriptors, 1))
    functions = driver.Functions()
    captured = _capture(ctx, alloc, None, *order[-1], tally, functions)
    entries = {index: (descriptor, saved.get((descriptor.size, descriptor.mode.value)))
               for index, descriptor in order[:-1]}
    unbuilt = [(index, descriptor, "not saved") for index, (descriptor, entry) in entries.items() if entry is None]
    pending = {index: found for index, found in entries.items() if found[1] is not None}
    _load_libraries(functions, [entry for _, entry in pending.values() if functions.missing(_kernels_of(entry))],
                    device, spent)
    recaptured = []
    for index, why in fewest_captures(functions, pending):
        descriptor = pending.pop(index)[0]
        captured = _capture(ctx, alloc, captured, index, descriptor, tally, functions)
        recaptured.append(f"{descriptor}: {why}")
    restored, refused = _build(ctx, alloc, captured, pending, places, functions, spent, tally)
    unbuilt += refused
    for index, descriptor, why in sorted(unbuilt, key=lambda item: item[0]):
        captured = _capture(ctx, alloc, captured, index, descriptor, tally, functions)
        recaptured.append(f"{descriptor}: {why}")
    for index, descriptor in restored:
        if ctx.verifies(descriptor):
            warmed = run_phase(ctx, tally.phases, Phase.WARMUP,
                               functools.partial(warmup, ctx, alloc, descriptor, index))
            tally.times.append(warmed.time)
            run_verify(ctx, alloc, captured, Waiting(descriptor, index, warmed), tally)
    alloc.owned.free_snapshots()
    captured.close()
    return captured, len(restored), tuple(recaptured)


def _build(ctx: Context, alloc: Allocation, captured: Captured,
           pending: dict[int, tuple[Descriptor, SavedDescriptor]], places: dict[str, int],
           functions: driver.Functions, spent: dict, tally: Tally
           ) -> tuple[list[tuple[int, Descriptor]], list[tuple[int, Descriptor, str]]]:
    """Every pending descriptor's graphs built at once (``driver.build_all``); each
    descriptor published whole, or, where the driver refused one of its graphs, its
    other graphs destroyed at once and the descriptor given back with why."""
    buildable = list(pending.items())
    built = iter(driver.build_all([graph for _, (_, entry) in buildable for graph in entry.graphs], places,
                                  functions, spent))
    # Every graph built is on the stack before any is published: a publish that fails
    # leaves none of the later descriptors' graphs behind.
    each = []
    for _, (descriptor, entry) in buildable:
        results = [next(built) for _ in entry.graphs]
        graphs = [RebuiltGraph(result) for result in results if isinstance(result, int)]
        each.append((results, graphs, [ctx.stack.push(f"destroy a restored graph of {descriptor}", graph.destroy)
                                       for graph in graphs]))
    restored, refused = [], []
    for (index, (descriptor, entry)), (results, graphs, undos) in zip(buildable, each):
        error = next((result for result in results if isinstance(result, driver.DriverError)), None)
        if error is None:
            tally.times.append(run_phase(ctx, tally.phases, Phase.CAPTURE, functools.partial(
                _publish, ctx, alloc, captured, descriptor, index, entry, graphs, places)))
            restored.append((index, descriptor))
            continue
        for undo in undos:
            ctx.stack.run_now(undo)
        refused.append((index, descriptor, f"graph {results.index(error)}: {error}"))
    return restored, refused


def _load_libraries(functions: driver.Functions, entries: list[SavedDescriptor], device: torch.device,
                    spent: dict) -> None:
    """The libraries of kernels ``entries`` launch that no graph of this process shows
    yet, loaded and their kernels found: each distinct multiplication of theirs run once
    eagerly and once in a throwaway graph, whose kernels ``functions`` then knows
    (``graphflow.engine.restart.matmuls``). What this cannot find, capturing finds
    (``fewest_captures``); a failure here only leaves more to capture, and says why in
    ``spent["matmuls_failed"]``."""
    wanted = list(dict.fromkeys(m for entry in entries for m in entry.matmuls))
    if not wanted or device.type != "cuda":
        return
    began = time.perf_counter()
    try:
        stream = torch.cuda.Stream(device)
        multiplications.run(wanted, device, stream)  # loads the libraries
        stream.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        multiplications.run(wanted, device, stream, graph)
        try:
            functions.add_graph(graph.raw_cuda_graph())
        finally:
            graph.reset()
    except Exception as exc:  # noqa: BLE001 - the descriptors are captured instead
        spent["matmuls_failed"] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    spent["matmuls"] = len(wanted)
    spent["matmuls_s"] = time.perf_counter() - began


def fewest_captures(functions: driver.Functions, pending: Mapping[int, tuple[object, SavedDescriptor]]
                    ) -> Iterator[tuple[int, str]]:
    """The descriptors to capture because kernels their graphs launch are not found here,
    and why, the next chosen once the last is captured (``Functions`` has then learnt its
    kernels' libraries): a library the process has loaded lists all its kernels, but
    one it has not used yet (a kernel a matrix library picks for larger batches only)
    is found only through a graph that launches one of its kernels. Each next is the
    descriptor whose missing kernels' libraries the most descriptors lack, the smallest
    of equals: the fewest captures find every library."""
    while True:
        missing = {index: functions.missing(_kernels_of(entry)) for index, (_, entry) in pending.items()}
        missing = {index: found for index, found in missing.items() if found}
        if not missing:
            return
        lacked = collections.Counter(library for found in missing.values() for library in {lib for lib, _ in found})
        index = max(missing, key=lambda i: (sum(lacked[lib] for lib in {lib for lib, _ in missing[i]}),
                                            -pending[i][1].size))
        yield index, _said(missing[index])


def _kernels_of(entry: SavedDescriptor) -> set[tuple[str, str]]:
    """The (library, name) of every kernel ``entry``'s graphs launch."""
    return set().union(*(graph.kernel_names for graph in entry.graphs))


def _said(missing: list[tuple[str, str]]) -> str:
    names = ", ".join(name[:60] for _, name in missing[:3]) + (", ..." if len(missing) > 3 else "")
    return f"{len(missing)} kernel{'s' if len(missing) > 1 else ''} not found here ({names})"


def _capture(ctx: Context, alloc: Allocation, captured: Captured | None, index: int, descriptor: Descriptor,
             tally: Tally, functions: driver.Functions) -> Captured:
    """One descriptor captured for real, as without saved graphs; its kernels, and the
    others of their libraries, are then this process's to build graphs with."""
    captured, _ = run_descriptor(ctx, alloc, captured, descriptor, index, tally)
    captured.settle()
    for graph in captured.graphs_of.get(descriptor, ()):
        functions.add_graph(_handle(graph))
    return captured


def place_regions(here: AddressBook, regions: dict[str, Region], device: torch.device, stack: UndoStack
                  ) -> dict[str, int]:
    """Where each saved region lives in this process: the model's tensors and the static
    buffers where ``here`` has them (the same size, or the saved graphs are refused:
    ``RegionsDiffer``); the pool's blocks and other memory allocated here, held until
    ``stack`` unwinds."""
    places, held = {}, []
    for name, region in regions.items():
        if region.kind in ("model", "buffer"):
            if name not in here.regions or here.regions[name].size != region.size:
                raise RegionsDiffer(f"{region.kind} tensor {name.split(':', 1)[1]} is not here as it was saved")
            places[name] = here.starts[name]
            continue
        memory = torch.empty(region.size, dtype=torch.uint8, device=device)
        if region.content is not None:
            memory.copy_(torch.frombuffer(bytearray(region.content), dtype=torch.uint8))
        held.append(memory)
        places[name] = memory.data_ptr()
    stack.push("free the memory restored graphs use", held.clear)
    return places


class RebuiltGraph(Graph):
    """A graph built from saved nodes; replays on the current stream, as torch's do."""

    __slots__ = ("_executable", "replay")

    def __init__(self, executable: int) -> None:
        self._executable = executable
        self.replay = driver.launcher(executable)

    def destroy(self) -> None:
        executable, self._executable = self._executable, None
        if executable is not None:
            driver.destroy(executable)
            self.replay = _destroyed


def _destroyed() -> None:
    raise RuntimeError("this graph was destroyed (its engine closed or rolled back); it cannot replay")


def _publish(ctx: Context, alloc: Allocation, captured: Captured, descriptor: Descriptor, index: int,
             entry: SavedDescriptor, graphs: list[RebuiltGraph], places: dict[str, int]) -> DescriptorTime:
    """``descriptor``'s program, its graphs built from ``entry``, published in ``captured``."""
    with ctx.descriptor(descriptor, index) as block:
        replays = iter(graph.replay for graph in graphs)
        views = alloc.buffers.views(descriptor.size)
        program = [bind(item, alloc.fns[item.name], views) if isinstance(item, Segment) else next(replays)
                   for item in step_items(ctx, descriptor.mode)]
        captured.graphs.extend(graphs)
        captured.graphs_of.setdefault(descriptor, []).extend(graphs)
        if entry.outputs:
            alloc.buffers.place(descriptor, {o.buffer: _tensor(o, places, views[o.buffer].device)
                                             for o in entry.outputs})
            ctx.stack.push(f"forget the outputs {descriptor}'s graphs return",
                           functools.partial(alloc.buffers.unplace, descriptor))
        captured.programs[descriptor] = tuple(program)
    return DescriptorTime(Phase.CAPTURE, descriptor, block.seconds)


def _tensor(output: Output, places: dict[str, int], device: torch.device) -> torch.Tensor:
    dtype = torch_dtype(output.dtype)
    extent = 1 + sum((n - 1) * s for n, s in zip(output.shape, output.stride)) if all(output.shape) else 0
    nbytes = extent * torch.empty(0, dtype=dtype).element_size()
    storage = torch._C._construct_storage_from_data_pointer(places[output.where.region] + output.where.offset, device,
                                                             nbytes)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, output.shape, output.stride)
