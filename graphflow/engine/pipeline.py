"""The capture pipeline: validate, then allocate → warmup → prewarm → capture → verify → commit.

``run_pipeline`` is the lifecycle, written once. Each phase is a plain function of the
run's fixed ``Context`` and the results of the phases before it, returning its own
result; each step that takes a resource registers its undo on the context's one
rollback stack the moment it succeeds. The steps:

1. **validate**: every rule of ``graphflow.plan.rules``; a plan with errors is refused
   (``InvalidPlanError``) before anything is built.
2. **allocate** (``graphflow.engine.allocate``): first, from the plan alone, check that
   the static buffers and verify's copies fit in the free memory of each device as the
   backend maps it (``graphflow.engine.memory``), so a plan too large is refused before
   the model is built; map the plan's devices (the CPU backend maps ``cuda:N`` to
   ``cpu``) and read each one's memory baseline; build the model
   (``factory(**model_args, **{k: v for k in (device, channels, rank, world_size, plan)
   if the factory accepts k})``) unless one is given, and bind it to the channels
   (``channels.bind(model)``) so a channel's prewarm hook resolves on it; adopt the
   model's tensors that buffers name, bind every segment's call; create the streams, one
   capture pool per device, the stream schedules of the eager step and of every region
   with their events; check the memory again, now that the model's weights are taken and
   the tensors it adopts are known, then allocate every buffer once, at its largest
   size; set up the detectors.
3. **per descriptor**, PIECEWISE then FULL, largest first, one descriptor at a time, so
   only its snapshots exist and a broken step fails on the first descriptor; one
   function runs a descriptor through a to d (``graphflow.engine.phase.run_descriptor``),
   here and in a lazy engine's capture thread:

   a. **warmup** (``graphflow.engine.warmup``): the whole step eagerly ``warmup_iters``
      times (1 unless the plan asks for more) on the streams capture uses, on verify's
      seeded random inputs, keeping the buffers the last run started from and the ones
      it wrote; the detectors watch graph segments on the first descriptor of each mode
      (``Watch.FIRST``, the default) or on all; the run's very first step checks that
      every segment writes what it declares (``graphflow.engine.model.written``).
   b. **prewarm**, after the first warmup only: each declared prewarm hook once per
      specialization, with no communication; then the garbage collector is frozen and
      the JIT tripwires go in for the captures to come.
   c. **capture** (``graphflow.engine.capture``): each region as one graph into its
      device's shared pool; after each mode's two largest descriptors the pool the mode
      will take is estimated and checked against free memory.
   d. **verify** (``graphflow.engine.verify``): put warmup's start back, replay, compare
      with what warmup wrote, bit for bit unless the plan declares tolerances, then with
      the model's own ``reference`` when the plan names one (skipped with
      ``RunOptions(verify=False)``). On one rank without channels, when a second pair of
      verify's snapshots fits in memory (``Allocation.behind``), a descriptor is verified
      after the next one's warmup and capture: its graphs are instantiated (on the
      backend's worker) beside that work instead of before its verify can replay them.
      A broken replay of the first descriptor then fails after the second one's capture.
4. **commit** (``graphflow.engine.engine``): every graph made ready to replay and the
   report written; then the step programs published in an ``Engine``, made whole at
   once with every phase's result, which keeps the rollback stack and unwinds it on
   ``close()``.

A lazy run (``RunOptions(lazy=True)``) commits after the first descriptor's warmup and
prewarm, through the same step 4, and the lazy-capture thread (``graphflow.engine.lazy``)
runs 3c for every descriptor while the engine serves, each checked against the eager
step on its first real batch instead of 3d (``graphflow.engine.background``,
``graphflow.engine.first_use``). Its engine is made with a ``LiveSwitch``
(``engine.live``), the one object the serving side and the thread share: the turns a
step and a recording take, the programs switched in so far, the report, and what
serving asks for.

Every phase runs under ``torch.no_grad()`` (capture is for inference; autograd would
record every op and refuse ``out=`` writes into buffers computed from weights) and
inside its locus block (``graphflow.engine.locus``), which every event and every error
reads its place from. Events: PIPELINE_BEGIN/END around everything, PHASE_BEGIN/END
around each phase, DESCRIPTOR_BEGIN/END (1-based ``index`` of ``total``) and
REGION_BEGIN/END inside, SEGMENT_BEGIN/END around every segment call of warmup, capture
and verify when anyone listens.

Any failure (an exception in a segment, a capture error, a detector finding, a verify
mismatch, a listener that raises, KeyboardInterrupt) unwinds the stack, last in first
out, running every undo even when one raises: graphs destroyed, pools released, no
stream left capturing, gc unfrozen, buffers and model dropped, device memory back to its
baseline, listener-deferred undos run. Listeners get a ROLLBACK event. Then
``CaptureError`` (phase, descriptor, segment, rank, hint) is raised from the cause;
failed undos are on it as ``undo_error`` (an ``ExceptionGroup``) and in a note.
KeyboardInterrupt is re-raised itself. Every error the caller gets keeps its message and
its traceback as text (a note) but no object of the run: no traceback frames, no
``AttributeError.obj``, arguments as text; so memory returns to the baseline while the
caller still holds the error.
"""

from __future__ import annotations

import contextlib
import functools
import traceback
from collections.abc import Sequence

import attrs
import torch

from graphflow.engine.allocate import Allocation, allocate
from graphflow.engine.background import BackgroundCapture, LiveSwitch
from graphflow.engine.backend import Backend, make_backend
from graphflow.engine.capture import Captured, open_capture
from graphflow.engine.channels import ChannelRuntimeProtocol
from graphflow.engine.context import Context
from graphflow.engine.engine import Engine, commit, publish
from graphflow.engine.memory import check_plan_memory
from graphflow.engine.phase import Hooks, Tally, run_descriptor, run_phase, run_verify, summarize, warm
from graphflow.engine.locus import Where
from graphflow.engine.options import RunOptions
from graphflow.engine.restart.driver import DriverError, check_available
from graphflow.engine.restart.matmuls import Recorder
from graphflow.engine.restart.run import Restart, restore, save
from graphflow.engine.rollback import UndoError
from graphflow.engine.verify import HINT as VERIFY_HINT
from graphflow.errors import TRACEBACK_NOTE, CaptureError, GraphflowError, InvalidPlanError, record_user_frames
from graphflow.events import Event, EventKind, Listener, Phase
from graphflow.engine.jit import registry as jit_registry
from graphflow.plan import Descriptor, Plan
from graphflow.plan.rules import validate

__all__ = ["run_pipeline"]

#: What to do when a phase fails, by phase: the last part of every CaptureError.
HINTS = {
    Phase.ALLOCATE: "check the plan's model, call paths, buffer shapes and devices",
    Phase.WARMUP: "the step fails when run eagerly: fix the segment, or run it without graphflow to debug",
    Phase.PREWARM: "a prewarm hook failed: fix the hook or remove it from the plan's prewarm list",
    Phase.CAPTURE: "the segment is not capturable (a sync, .item(), an allocation or a host read): "
                   "fix it or make it an eager segment",
    Phase.VERIFY: VERIFY_HINT,
    Phase.COMMIT: "a listener failed while publishing the graphs; fix the listener",
}


def run_pipeline(plan: Plan, options: RunOptions = RunOptions(), *, backend: Backend | None = None,
                 model: object | None = None, rank: int = 0, world_size: int = 1,
                 listeners: Sequence[Listener] = (), channels: ChannelRuntimeProtocol | None = None) -> Engine:
    """Run every phase and return the committed ``Engine``, or roll back and raise.

    ``backend`` replaces the one ``options.backend`` names (tests record what it does);
    ``model`` skips the plan's factory (tests, integrations that already hold one).
    ``channels`` (the channel runtime) is offered to the factory as ``channels.handles``,
    is bound to the model (``channels.bind(model)``) and listens to
    every event. Raises ``InvalidPlanError`` for a plan the validator rejects,
    ``ValueError`` for sizes the plan does not have, ``CaptureError`` from the cause of
    any failure after that; ``KeyboardInterrupt`` is re-raised as is, after rollback.
    """
    if backend is not None and not isinstance(backend, Backend):
        raise TypeError(f"backend= takes a Backend instance (got {backend!r}): name a kind with "
                        "RunOptions(backend='cpu'|'cuda'|'auto') instead")
    report = validate(plan, disable=options.skip_rules)
    if not report.ok:
        raise InvalidPlanError(report)
    if options.lazy and (plan.channels or world_size > 1):
        raise ValueError("lazy (background) capture serves one rank of a plan without channels: ranks would capture "
                         "in orders their own traffic decides — capture this plan in the foreground")
    if options.lazy and (options.save_graphs or options.graphs_from):
        raise ValueError("saved graphs are written from, and brought back into, a run captured in the foreground: "
                         "a lazy engine captures while it serves — leave lazy off to save or restore graphs")
    backend = backend if backend is not None else make_backend(options.backend)
    if options.save_graphs is not None:
        if not backend.captures_graphs:
            raise ValueError(f"the {backend.name} backend records no graphs to save in {options.save_graphs}: save "
                             "them from a run on the CUDA backend")
        try:
            check_available()
        except DriverError as exc:
            raise ValueError(str(exc)) from exc
    ctx = Context(plan, backend, options, rank,
                  world_size, _select(plan, options.sizes),
                  (*listeners, *(() if channels is None else (channels,))),
                  tuple(s for s in plan.segments if s.runs_on(rank)))
    if options.lazy:  # a serving thread runs beside the capture; the caller's backend is given back as it was
        ctx.stack.push("give the backend its capture error mode back",
                       functools.partial(setattr, backend, "capture_error_mode", backend.capture_error_mode))
        backend.capture_error_mode = "thread_local"
    try:
        return _run_phases(ctx, model, channels)
    except BaseException as exc:  # noqa: BLE001 - every failure rolls back; raised below
        error = _rollback(ctx, exc)
    # The raised error's traceback keeps this frame: nothing of the run may stay in it.
    del model, ctx
    raise error


def _run_phases(ctx: Context, model: object | None, channels: ChannelRuntimeProtocol | None) -> Engine:
    """The phases in order (see the module docstring); the caller rolls back on failure.

    A function of its own so that, once it has raised, its finished frame (which holds
    every phase's result) is cleared with the rest of the traceback.
    """
    tally = Tally()
    # The process's JIT registry follows this run's locus: it records which segment
    # launched which kernel specialization, and names the segment of a cold one.
    jit_registry.attach(ctx.locus)
    ctx.stack.push("detach the JIT registry", functools.partial(jit_registry.detach, ctx.locus))
    ctx.emit(EventKind.PIPELINE_BEGIN, total=len(ctx.descriptors))
    with torch.no_grad():
        alloc = run_phase(ctx, tally.phases, Phase.ALLOCATE, lambda: _allocate(ctx, model, channels))
        captured = restart = None
        if ctx.options.graphs_from is not None:
            captured, restart = restore(ctx, alloc, tally, ctx.options.graphs_from)
        if captured is None:
            captured = _warm_first(ctx, alloc, tally) if ctx.options.lazy else _capture_all(ctx, alloc, tally)
        return _finish(ctx, alloc, captured, tally, restart)


def _allocate(ctx: Context, model: object | None, channels: ChannelRuntimeProtocol | None) -> Allocation:
    """The allocate phase, memory first: a plan too large for the device is refused from
    its own numbers in a second, not after the minutes a large model takes to build."""
    check_plan_memory(ctx, model_given=model is not None)
    return allocate(ctx, model, channels)


def _capture_all(ctx: Context, alloc: Allocation, tally: Tally) -> Captured:
    """Step 3 for every descriptor in turn; then verify's snapshots freed and the capture
    closed (gc unfrozen, tripwires removed)."""
    # A run that saves its graphs records each capture's multiplications: a restart runs
    # them to load the libraries of their kernels.
    recorder = Recorder() if ctx.options.save_graphs is not None else None
    hooks = Hooks(behind=alloc.behind, record=recorder and recorder.recording)
    captured = waiting = None
    for index, descriptor in enumerate(ctx.descriptors, 1):
        captured, waiting = run_descriptor(ctx, alloc, captured, descriptor, index, tally, hooks, waiting)
        if recorder is not None:
            tally.matmuls[descriptor] = recorder.taken()
    if waiting is not None:
        run_verify(ctx, alloc, captured, waiting, tally, hooks)
    alloc.owned.free_snapshots()
    if captured is None:
        captured = open_capture(ctx)
    captured.close()
    return captured


def _warm_first(ctx: Context, alloc: Allocation, tally: Tally) -> Captured:
    """A lazy run's step 3: the first descriptor's warmup and prewarm, the capture opened
    for the thread that runs every descriptor through step 3 once the engine serves."""
    if not ctx.descriptors:
        return open_capture(ctx)
    return warm(ctx, alloc, None, ctx.descriptors[0], 1, tally)[1]


def _finish(ctx: Context, alloc: Allocation, captured: Captured, tally: Tally, restart: Restart | None) -> Engine:
    """Step 4, for a foreground run and a lazy one alike: commit, publish the engine whole
    (its report holds every phase, commit's included), end the pipeline. A lazy engine's
    capture thread starts last, so that listeners see its work as a pipeline of its own,
    after this one."""
    report = run_phase(ctx, tally.phases, Phase.COMMIT,
                       lambda: commit(ctx, alloc, captured, tuple(tally.verified), tuple(tally.times)),
                       pool=lambda _: captured.pool_bytes)
    if ctx.options.save_graphs is not None:
        restart = save(ctx, alloc, captured, ctx.options.save_graphs, tally.matmuls)
    report = attrs.evolve(report, phases=summarize(tally.phases), prewarm=tally.prewarm,
                          pool_probe=dict(tally.pool_probe), restart=restart)
    live = background = None
    if ctx.options.lazy:
        live = LiveSwitch(report)
        background = BackgroundCapture(ctx, alloc, captured, live)
    engine = publish(ctx, alloc, captured, report, live, background)
    jit_registry.detach(ctx.locus)
    ctx.emit(EventKind.PIPELINE_END, total=len(ctx.descriptors), pool_bytes=captured.pool_bytes)
    if background is not None:
        background.start()
    return engine


def _select(plan: Plan, sizes: Sequence[int] | None) -> tuple[Descriptor, ...]:
    descriptors = plan.descriptors()
    if sizes is None:
        return descriptors
    wanted = set(sizes)
    unknown = wanted - set(plan.capture.all_sizes)
    if unknown:
        raise ValueError(f"sizes {sorted(unknown)} are not among the plan's sizes {list(plan.capture.all_sizes)}")
    return tuple(d for d in descriptors if d.size in wanted)


def _rollback(ctx: Context, exc: BaseException) -> BaseException:
    """Unwind everything, then return the exception to raise (see the module docstring)."""
    where = ctx.locus.failure(exc)
    ctx.locus.forget()
    failures: list[BaseException] = []
    event = Event(EventKind.ROLLBACK, rank=ctx.rank, phase=where.phase, descriptor=where.descriptor,
                  region=where.region, segment=where.segment, error=f"{type(exc).__name__}: {exc}")
    for listener in ctx.listeners:
        try:
            listener.on_event(event)
        except Exception as failure:  # noqa: BLE001 - rollback must finish; reported below
            failure.add_note(f"while notifying {type(listener).__name__} of the rollback")
            failures.append(failure)
    group = ctx.stack.unwind()
    if group is not None:
        failures.extend(group.exceptions)
    undo_error = UndoError(f"{len(failures)} rollback step(s) failed", failures) if failures else None
    if not isinstance(exc, Exception):
        error = exc
        if undo_error is not None:
            exc.add_note(f"rollback: {undo_error}")
    else:
        error = _capture_error(ctx, exc, where)
        if undo_error is not None:
            error.add_note(f"rollback: {undo_error}: " + "; ".join(f"{type(f).__name__}: {f}" for f in failures))
        error.undo_error = undo_error
        if error is not exc:
            error.__cause__ = exc
    # Last: the messages above are made from the errors as they were raised.
    _detach(error)
    if undo_error is not None:
        _detach(undo_error)
    return error


def _capture_error(ctx: Context, exc: Exception, where: Where) -> CaptureError:
    """The error to raise: ``exc`` itself when it is a CaptureError (its missing places
    filled in from where it was raised), else a CaptureError naming the place."""
    phase = where.phase.value if where.phase is not None else None
    if isinstance(exc, CaptureError):
        exc.phase = exc.phase if exc.phase is not None else phase
        exc.descriptor = exc.descriptor if exc.descriptor is not None else where.descriptor
        exc.segment = exc.segment if exc.segment is not None else where.segment
        exc.rank = exc.rank if exc.rank is not None else ctx.rank
        return exc
    if where.listener is not None:
        message = f"listener {where.listener} raised {type(exc).__name__}: {exc}"
        hint = "fix the listener; a listener that raises fails the pipeline"
    else:
        region = f" in region {where.region}" if where.region else ""
        message = f"{type(exc).__name__}{region}: {exc}"
        hint = HINTS.get(where.phase, "see the cause above")
    if isinstance(exc, TimeoutError):
        hint = "a rank or barrier did not answer in time: look for a rank that diverged (graphflow trace diff)"
    return CaptureError(message, phase=phase, descriptor=where.descriptor, segment=where.segment, rank=ctx.rank,
                        hint=hint)


#: Values an error may keep as they are: they hold nothing else.
_PLAIN = (str, bytes, int, float, bool, type(None))


def _detach(exc: BaseException) -> None:
    """Keep what each error in the chain says, drop every object it holds.

    The caller may hold the error for as long as it likes, and device memory must still
    return to the baseline. Errors hold objects in three ways: a traceback keeps every
    frame, and their locals (the model, views of the static buffers, graph inputs); an
    ``AttributeError`` keeps the object it was raised on (``obj``: the model, for a bad
    call path); arguments and attributes may be anything (a model's own exception
    keeping a tensor). So each error of the chain (causes, contexts, the members of a
    group) gets its traceback as text, in a note, and loses the traceback; arguments and
    the attributes of errors that are not graphflow's own become their ``repr``. The
    frames of the user's own code stay as data (``graphflow.errors.user_frames``), so the
    command line can say where that code failed without parsing the note.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        # An exception class may refuse a new value; rollback must still end with the
        # original error, so such a value stays.
        with contextlib.suppress(AttributeError, TypeError):
            if isinstance(error, AttributeError):
                error.obj = None
            if not isinstance(error, BaseExceptionGroup):  # a group's arguments are its members
                error.args = tuple(a if isinstance(a, _PLAIN) else repr(a) for a in error.args)
        if not isinstance(error, GraphflowError):  # graphflow's own keep only plain places
            for name, value in list(vars(error).items()):
                if not name.startswith("__") and not isinstance(value, (*_PLAIN, BaseException)):
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(error, name, repr(value))
        if error.__traceback__ is not None:  # after the attributes, which would turn the user frames to text
            record_user_frames(error)
            text = "".join(traceback.format_tb(error.__traceback__)).rstrip()
            error.add_note(f"{TRACEBACK_NOTE}\n{text}")
            traceback.clear_frames(error.__traceback__)
            error.__traceback__ = None
        pending += [error.__cause__, error.__context__, *getattr(error, "exceptions", ())]
