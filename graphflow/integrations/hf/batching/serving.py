"""graphflow in place of the continuous-batching engine's own graph capture.

transformers' engine captures a graph the first time a batch asks for its key, inside
that serving step (the step waits for the whole capture), checks nothing and cannot roll
anything back. ``serve(manager)`` keeps the engine's scheduler, cache and batching, and
takes over only the step's forward (``ModelRunner.compute_batch``), split as SGLang splits
its runner from its capture:

* the plan (``graphflow.integrations.hf.batching.plan``): PIECEWISE keys by padded query
  tokens, which cover every batch, their attention eager between graph pieces
  (``graphflow.integrations.hf.batching.pieces``); FULL keys where a whole graph pays,
  the decode-only batches;
* the runner (``graphflow.integrations.hf.batching.runner``) dispatches each step to its
  key's graph or the engine's eager step, checks a new graph on its first batch, and
  counts every step (``Coverage``);
* the capture side (``graphflow.integrations.hf.batching.capture``) captures keys:
  **foreground** (``lazy=False``, the default), coverage first: the PIECEWISE keys before
  serving (they cover every batch: from the first step on, every step replays a graph),
  each a transaction (capture, verify, or undone, and served eagerly), and the FULL keys
  on the lazy-capture thread beside serving, the speed-ups after
  (``full_in_background=False``: every key before serving); **lazy**, serving starts at
  once and the engine's lazy-capture thread (``graphflow.engine.lazy``: the keys steps ask
  for first, most asked first, then the rest of the plan, largest first, for a plan of at
  most ``AHEAD_MOST`` keys; recordings that give way to the engine's steps; a failed
  capture tried again, whole, up to ``TRIES`` times) records every key beside the engine.
  With ``full_keys="asked"`` the thread records a FULL key only once a step asks for it.

Verification follows the engine's rule (``Verify``): before ``serve`` returns, a
sample (the largest key of each mode captured then) is verified against the engine's
eager step; every other key, and every key the thread captures, is checked on its first
batch (``verify="all"``: every key captured before serving is verified then). Sampled
tokens differ between any two runs, so with ``do_sample`` a key goes live unchecked and
the log says so. ``close()`` gives everything back, last in first out (graphs, pools,
stream, the engine's own forward and padding settings).
"""

from __future__ import annotations

import functools
import logging
import os
import pathlib

import attrs

from graphflow.engine.backend import BackendKind, make_backend
from graphflow.engine.first_use import Checks
from graphflow.engine.lazy import TRIES, KeyState, LazyCapture
from graphflow.engine.options import Verify
from graphflow.engine.rollback import UndoStack
from graphflow.engine.turns import Turns
from graphflow.errors import PlanError
from graphflow.integrations.hf.batching.capture import AHEAD_MOST, KeyCapture
from graphflow.integrations.hf.batching.coverage import Coverage
from graphflow.integrations.hf.batching.pieces import AttentionCut
from graphflow.integrations.hf.batching.plan import ServingPlan, batch_processor, serving_plan
from graphflow.integrations.hf.batching.runner import StepRunner
from graphflow.plan import Mode

__all__ = ["AHEAD_MOST", "FULL_KEYS", "LAZY_TRIES", "Serving", "serve"]

log = logging.getLogger("graphflow.serving")

#: Lazy capture tries a key this many times before serving it eagerly for good.
LAZY_TRIES = TRIES

#: Which FULL keys the capture thread records: every one, or those steps asked for.
FULL_KEYS = ("all", "asked")


class Serving:
    """graphflow serving one engine's steps (see the module docstring); made by ``serve``:
    the runner, the capture side and, when lazy, the lazy-capture thread, composed."""

    def __init__(self, plan: ServingPlan, runner: StepRunner, capture: KeyCapture, stack: UndoStack,
                 core: LazyCapture | None, *, lazy: bool) -> None:
        self.plan = plan
        #: The lazy-capture thread, when keys are captured beside serving (``lazy``, or a
        #: foreground capture's FULL keys, unless ``full_in_background=False``).
        self.runner, self.capture, self.core = runner, capture, core
        self.coverage = runner.coverage
        self.turns = runner.turns
        self.processor, self.model = capture.processor, capture.model
        self.lazy = lazy
        self.verify = capture.verify
        self._stack = stack
        #: What restoring saved keys did (``serve(..., graphs_from=...)``), else None.
        self.restart = None

    @property
    def checks(self) -> Checks:
        """How many keys were compared with the engine's eager step before ``serve``
        returned, how many on their first batch since, how many wait for theirs, and how
        many their first batch found wrong (``Coverage.checks``)."""
        return self.coverage.checks

    @property
    def memory(self) -> dict[str, int | None]:
        """The forecast and the graph memory: once the capture thread is done, as it was
        then; while it may still capture the keys steps ask for, as it is now."""
        if self.core is not None and not self.core.done:
            return {**self.capture.memory, **self.capture.memory_now()}
        return self.capture.memory

    @property
    def key_memory(self) -> dict:
        return self.capture.key_memory

    @property
    def all_captured_s(self) -> float | None:
        """Seconds from ``serve`` to every key captured (with ``full_keys="asked"``, but the
        FULL keys no step asked for)."""
        if self.capture.all_captured_s is None and self.core is not None and self.core.caught_up_at is not None:
            return self.core.caught_up_at - self.capture.started
        return self.capture.all_captured_s

    @property
    def capturing(self) -> bool:
        """Whether the capture thread (lazy, or the FULL keys in the background) records a
        key now or has one to record."""
        return self.core is not None and self.core.busy

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Wait until every key of the plan is captured or failed (with
        ``full_keys="asked"``, but the FULL keys no step has asked for); whether it was."""
        return self.core is None or self.core.wait(timeout)

    @property
    def retried(self) -> int:
        """How many keys' background captures failed at least once (each then recorded
        whole between two steps, until it succeeded or ran out of tries)."""
        return 0 if self.core is None else len(self.core.tries)

    def save_graphs(self, directory: str | os.PathLike):
        """Write the graph of every FULL key captured so far to ``directory``, for a new
        process to serve from (``serve(manager, graphs_from=directory)``): after the
        traffic a server sees, those are the keys it uses (``wait_captured()`` first saves
        them all). What was saved and left out, with why
        (``graphflow.integrations.hf.batching.restart``)."""
        from graphflow.integrations.hf.batching.restart import save_keys

        with self.turns.recording(pausing=False):  # no step and no capture while graphs are read
            return save_keys(self.capture, pathlib.Path(directory))

    def report(self) -> str:
        """The coverage table, its warnings and the memory, for the end of a run."""
        lines = [self.coverage.table()]
        lines += [f"warning: {w}" for w in self.coverage.warnings()]
        if self.verify:
            checks = self.checks
            lines.append(f"checks against the engine's eager step: {checks.before_ready} keys before serving, "
                         f"{checks.on_first_use} on their first batch"
                         + (f" ({checks.failed} found wrong there, served eagerly)" if checks.failed else "")
                         + (f"; {checks.waiting} captured keys not checked yet (their first batch checks them)"
                            if checks.waiting else ""))
        if self.core is not None:
            lines.append(f"lazy capture: recordings paused {self.turns.pauses} times for the engine's steps; "
                         f"{self.retried} keys failed a capture and were recorded again whole between two steps")
        restart = self.restart
        if restart is not None:
            lines.append(f"restart: {restart.refused}" if restart.refused is not None else
                         f"restart: {restart.restored} keys built from {restart.directory}, {restart.captured} "
                         f"captured to find their kernels; their graphs hold "
                         f"{_mib(restart.built.get('memory_bytes'))} outside the pool")
        estimated, pool = self.memory.get("estimated_pool_bytes"), self.memory.get("pool_bytes")
        lines.append(f"graph memory: pool {_mib(pool)}" + (f", estimated {_mib(estimated)} before capture"
                                                           if estimated is not None else "")
                     + (f"; static attention buffers {_mib(self.memory['attention_buffer_bytes'])}"
                        if self.memory.get("attention_buffer_bytes") else ""))
        return "\n".join(lines)

    def close(self) -> None:
        """Stop capturing, give the engine its own forward back, free every graph."""
        if self.core is not None:
            self.core.stop()
        failure = self._stack.unwind()
        if failure is not None:
            raise failure


def serve(manager, *, lazy: bool = False, verify: bool | str | Verify = True,
          backend: BackendKind | str = BackendKind.AUTO, longest: int | None = None, keys=None, progress=None,
          full_in_background: bool = True, graphs_from: str | os.PathLike | None = None,
          full_keys: str = "all") -> Serving:
    """Put graphflow in place of ``manager``'s graph capture (a ``ContinuousBatchingManager``,
    before ``start()``, or after it with ``lazy``); see the module docstring. ``longest``:
    the most tokens a request holds on this server (prompt and new tokens), which bounds
    the keys (``serving_keys``; default: the model's ``max_position_embeddings``). ``keys`` limits the plan to
    some of its keys (the others are served eagerly as "key never captured"). Foreground
    capture reports each key to ``progress`` (a function of one line; default: the log);
    it captures the PIECEWISE keys, and the FULL keys are captured beside serving, as a
    lazy capture captures them (``full_in_background=False``: all before serving).
    ``full_keys``: ``"all"`` (the thread records every FULL key, those steps ask for
    first) or ``"asked"`` (a FULL key only once a step asks for it: see docs/serving.md
    for what each costs).
    ``verify``: ``True`` or ``"sample"`` (each mode's largest key captured before serving
    verified then, the others on their first batch), ``"all"`` (every key captured before
    serving verified then), ``False`` or ``"off"`` (graphs go live unchecked). ``graphs_from``:
    a directory a server of the same model, settings and versions wrote
    (``Serving.save_graphs``): its FULL keys are built from it instead of captured, each
    checked on its first batch (foreground only; ``Serving.restart`` says what was
    restored, and a directory that cannot be used is refused in one line and the keys
    captured).
    """
    if not lazy and manager.is_running():
        raise PlanError("a foreground capture runs before the engine serves: call serve(manager) before "
                        "manager.start(), or serve(manager, lazy=True) on a running one", element="lazy")
    if lazy and graphs_from is not None:
        raise PlanError("graphs_from builds the saved keys before serving: use it with a foreground serve "
                        "(lazy=False), whose FULL keys not saved are captured beside serving", element="graphs_from")
    if full_keys not in FULL_KEYS:
        raise PlanError(f"full_keys={full_keys!r}: expected one of {', '.join(map(repr, FULL_KEYS))}",
                        element="full_keys")
    if full_keys == "asked" and not lazy and not full_in_background:
        raise PlanError("full_keys='asked' records a FULL key beside serving once a step asks for it; "
                        "full_in_background=False captures every key before serving: ask for one",
                        element="full_keys")
    if lazy and not full_in_background:
        raise PlanError("full_in_background=False captures every key before serving; lazy=True captures every key "
                        "beside serving: ask for one", element="full_in_background")
    try:
        scope = Verify.of(verify)
    except ValueError:
        raise PlanError(f"verify={verify!r}: expected True, False, or one of "
                        f"{', '.join(repr(v.value) for v in Verify)}", element="verify") from None
    processor = batch_processor(manager)
    _refuse_unsupported(processor)
    if longest is None:
        # No request holds more tokens than the model has positions.
        longest = getattr(processor.config, "max_position_embeddings", None)
    elif longest < 1:
        raise PlanError(f"longest={longest}: the most tokens one request holds, at least 1", element="longest")
    stack = UndoStack()
    try:
        _pad_as_graphs(processor, stack)
        plan = serving_plan(processor, longest=longest)
        if keys is not None:
            wanted = set(keys)
            plan = attrs.evolve(plan, keys=tuple(k for k in plan.keys if k in wanted))
        chosen = make_backend(backend)
        background = not lazy and full_in_background and plan.count(Mode.FULL) > 0
        beside = lazy or background  # keys captured on a thread beside serving
        if beside:
            # The engine serves on its own thread while a capture is open (Turns): its
            # calls there (syncs of its own stream, allocations) are not this capture's to refuse.
            chosen.capture_error_mode = "thread_local"
        device = processor.inputs_and_outputs.device
        stream = chosen.new_stream(device)
        stack.push("give back the capture stream", functools.partial(chosen.release_stream, stream))
        sampling = processor.model_runner.do_sample
        verify = Verify.OFF if sampling else scope
        cut = None
        if plan.count(Mode.PIECEWISE):
            cut = AttentionCut(plan.attention, chosen, processor.cache.max_batch_tokens)
            cut.attach(stack)
        graphs: dict = {}
        coverage = Coverage(plan.keys)
        capture = KeyCapture(manager.model, processor, plan, chosen, stream, stack, graphs, coverage, cut, lazy=beside,
                             verify=verify)
        stack.push("destroy the graphs", capture.destroy_all)
        turns = Turns()
        # Recordings may pause for steps with their capture open where that is safe
        # (graphflow.engine.lazy): thread-local capture, and steps that draw no random number.
        pausing = chosen.captures_graphs and chosen.capture_error_mode == "thread_local" and not sampling
        runner = StepRunner(processor, capture, graphs, coverage, turns)
        model_runner = processor.model_runner
        model_runner.compute_batch = runner.compute_batch
        stack.push("give the engine its own forward back", functools.partial(vars(model_runner).pop, "compute_batch"))
        for name in ("prepare_next_batch", "update_batch"):
            setattr(processor, name, getattr(runner, name))
            stack.push(f"give the engine its own {name} back", functools.partial(vars(processor).pop, name))
        log.info("graphflow serves %s: %d keys, %s", plan.name, len(plan.keys),
                 "captured in the background" if lazy else
                 "the PIECEWISE ones captured before serving, the FULL ones beside it" if background else
                 "captured before serving")
        if not sampling and not verify:
            log.info("graphflow: verify is off")
        elif sampling:
            log.info("graphflow: sampling is on, so new graphs go live unchecked (sampled tokens differ by design)")
        restart = None
        if not lazy:
            first = background or graphs_from is not None  # the PIECEWISE keys first
            capture.capture_all(progress, [k for k in plan.keys if not first or k.mode is Mode.PIECEWISE])
            if graphs_from is not None:
                restart = _restore(capture, pathlib.Path(graphs_from), stack, progress)
                if not background:
                    held = capture.held()
                    capture.capture_all(progress, [k for k in plan.keys if k.mode is Mode.FULL and k not in held
                                                   and coverage.state(k) is KeyState.PLANNED])
        core = _capture_thread(capture, turns, pausing, asked=full_keys == "asked") if beside else None
        serving = Serving(plan, runner, capture, stack, core, lazy=lazy)
        serving.restart = restart
        if core is not None:
            core.start()
        return serving
    except BaseException:
        stack.unwind()
        raise


def _restore(capture: KeyCapture, directory: pathlib.Path, stack: UndoStack, progress):
    """The saved FULL keys built (``restart.restore_keys``), said in one line."""
    from graphflow.integrations.hf.batching.restart import restore_keys

    restart = restore_keys(capture, directory, stack)
    if restart.refused is None:
        built = restart.built
        (progress or log.info)(
            f"restored {restart.restored} keys from {directory} in {restart.seconds:.2f} s "
            f"({built.get('nodes', 0)} nodes), {restart.captured} captured to find their kernels"
            + (f", {len(restart.left_out)} refused by the driver (captured instead)" if restart.left_out else ""))
    return restart


def _capture_thread(capture: KeyCapture, turns: Turns, pausing: bool, *, asked: bool) -> LazyCapture:
    """The lazy-capture thread for the plan's keys a foreground capture did not settle
    (all of them when lazy); with ``asked``, the FULL ones once a step asks for them (a
    FULL key is a speed-up for decode-only batches of one KV size, many of which a
    workload may never reach, and recording one runs its step eagerly on the GPU the
    steps wait for). Coverage reads the thread's table from then on."""
    plan, coverage = capture.plan, capture.coverage
    settled = {key: state for key, state in coverage.states.items() if state is not KeyState.PLANNED}
    full = [key for key in plan.keys if key.mode is Mode.FULL] if asked else []
    core = LazyCapture(capture, plan.keys, turns=turns, ahead=len(plan.keys) - len(settled) <= AHEAD_MOST,
                       on_demand=full,
                       pausing=pausing, settled=settled, name="graphflow-serving-capture")
    coverage.states = core.states
    capture.core = core
    return core


def _refuse_unsupported(processor) -> None:
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs

    if isinstance(processor.inputs_and_outputs, ContinuousBatchingAsyncIOs):
        raise PlanError("graphflow serves the engine's synchronous batching; this manager uses asynchronous "
                        "batching (two IO pairs, each with graphs of its own) — create it with "
                        "ContinuousBatchingConfig(use_async_batching=False)", element="use_async_batching")


def _pad_as_graphs(processor, stack: UndoStack) -> None:
    """Batches padded to their keys, as the engine pads them for its own graphs, and the
    engine's own capture off: graphflow replays in its place."""
    runner, io = processor.model_runner, processor.inputs_and_outputs
    saved = (runner.pad_inputs, runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode, io.use_cuda_graph_varlen)

    def restore() -> None:
        runner.pad_inputs, runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode, io.use_cuda_graph_varlen = saved

    runner.pad_inputs, io.use_cuda_graph_varlen = True, True
    runner.use_cuda_graph_varlen, runner.use_cuda_graph_decode = False, False
    stack.push("restore the engine's padding and graph settings", restore)


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"
