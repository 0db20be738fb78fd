"""graphflow in place of the continuous-batching engine's own graph capture.

transformers' engine captures a graph the first time a batch asks for its key, inside
that serving step (the step waits for the whole capture), checks nothing and cannot roll
anything back. ``serve(manager)`` keeps the engine's scheduler, cache and batching, and
takes over only the step's forward (``ModelRunner.compute_batch``):

* **foreground** (``lazy=False``): every key of the plan is captured before serving, each
  as a transaction (the engine's own warmup batch for that key: eager step, capture,
  verify, or undone): a key that fails is rolled back alone, logged with why, and served
  eagerly; the others serve from their graphs.
* **lazy**: serving starts at once. A step whose key has no graph yet runs the engine's
  eager step, and from the engine's first step on a thread captures keys beside it, the
  ones steps asked for first (most asked first), then the rest of the plan, largest first
  (a plan of more than ``AHEAD_MOST`` keys keeps to those asked for). A recording gives
  way to a waiting step at its next module call once it has run ``SLICE_OF_EAGER`` of an
  eager step (``Turns``): no step waits for a whole capture. The first step served on a
  new graph runs the engine's eager step too and compares the tokens: the graph goes live
  only if they are identical, and the step serves the eager tokens either way.

Verification is against the engine's own eager step (its ``compute_batch`` without graphs),
never against graphflow's. Sampled tokens differ between any two runs, so with
``do_sample`` a key goes live unchecked and the log says so.

Every step is counted (``Coverage``). ``close()`` gives everything back, last in first out
(graphs, pool, stream, the engine's own forward and padding settings).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import threading
import time

import attrs
import torch

from graphflow.engine.backend import BackendKind, make_backend
from graphflow.engine.rollback import Undo, UndoStack
from graphflow.errors import PlanError
from graphflow.integrations.hf.batching.coverage import Coverage, Fallback
from graphflow.integrations.hf.batching.keys import DECODE, ServingKey, key_of
from graphflow.integrations.hf.batching.plan import ServingPlan, batch_processor, serving_plan
from graphflow.integrations.hf.batching.turns import Turns

__all__ = ["Serving", "serve"]

log = logging.getLogger("graphflow.serving")

#: Lazy capture tries a key this many times before serving it eagerly for good.
LAZY_TRIES = 3
#: A lazy recording runs this share of an eager step (the engine's latest, averaged)
#: before it gives way to a waiting step (``Turns.slice_s``): a step waits that long at
#: most, so one served beside a capture stays under twice an eager step, and a key's warm
#: run and recording (about two eager steps of host time) take about three steps.
SLICE_OF_EAGER = 0.75
#: Lazy capture takes, after the keys steps asked for, the rest of the plan when it has at
#: most this many keys; a larger plan (loose padding, a huge cache) keeps to what is asked.
AHEAD_MOST = 256


@attrs.define(eq=False)
class _Graph:
    key: ServingKey
    graph: object
    checked: bool
    pool: object  # the pool it was captured into


class Serving:
    """graphflow serving one engine's steps (see the module docstring); made by ``serve``."""

    def __init__(self, model, processor, plan: ServingPlan, backend, stream, stack: UndoStack, *,
                 lazy: bool, verify: bool) -> None:
        self.model = model
        self.processor = processor
        self.plan = plan
        self.coverage = Coverage(plan.keys)
        self.lazy = lazy
        self.verify = verify
        self.memory: dict[str, int | None] = {}
        #: Foreground: device memory allocated before and after each key's transaction.
        self.key_memory: dict[ServingKey, tuple[int, int]] = {}
        self._backend, self._stream, self._stack = backend, stream, stack
        #: Each pool and the undo that releases it. Graphs are captured into the last one
        #: (a failed capture starts another, and the failed one is released at once if no
        #: graph uses it); the rest are released at close. Only the capturing thread
        #: (lazy: the capture thread, which close joins first) touches them.
        self._pools: dict[object, Undo] = {}
        self._new_pool()
        self._graphs: dict[ServingKey, _Graph] = {}
        #: Lazy on a GPU: IO tensors of the engine's sizes for warm runs (``_scratch_io``).
        self._scratch = _scratch_io(processor) if lazy and backend.captures_graphs else None
        self._planned = frozenset(plan.keys)
        self._demand: dict[ServingKey, int] = {}
        self._todo = list(plan.keys)
        #: Lazy: whether keys no step asked for are captured too, after those asked for.
        self._ahead = len(plan.keys) <= AHEAD_MOST
        self._tries: dict[ServingKey, int] = {}
        self._wake = threading.Condition()
        #: The engine's steps and lazy recordings take turns on the host.
        self.turns = Turns()
        self._eager_s: float | None = None  # the engine's eager steps' host seconds, averaged
        #: Whether a recording may pause for steps with its capture open: graphs recorded in
        #: thread-local mode (``serve`` sets it for lazy), and steps that draw no random number.
        self._pausing = (lazy and backend.captures_graphs and backend.capture_error_mode == "thread_local"
                         and not processor.model_runner.do_sample)
        self._closing = False
        self._stepped = threading.Event()  # the engine took a step: lazy capture may begin
        self._thread: threading.Thread | None = None
        self._original = processor.model_runner.compute_batch
        self._prepare, self._update = processor.prepare_next_batch, processor.update_batch
        self.started = time.perf_counter()
        #: Seconds from ``serve`` until every key was captured or failed (lazy: a captured
        #: key's first step then checks it).
        self.all_captured_s: float | None = None

    # -- the engine's step ----------------------------------------------------------------

    def prepare_next_batch(self) -> bool:
        """The engine's own (it fills the static tensors), never beside a capture's recording."""
        with self.turns.step():
            return self._prepare()

    def update_batch(self) -> None:
        """The engine's own (it reads the step's tokens), never beside a capture's recording."""
        with self.turns.step():
            self._update()

    def compute_batch(self, model, batch_data: dict) -> None:
        """The engine's ``ModelRunner.compute_batch``: replay the key's graph, or run the
        engine's eager step and say why."""
        io = self.processor.inputs_and_outputs
        key = key_of(io)
        tokens = io.total_seqlen_q
        self._stepped.set()
        with self.turns.step():
            held = self._graphs.get(key)
            if held is not None and held.checked:
                self._replay(held)
                self.coverage.served(key, tokens, None)
                return
            if held is not None:
                self.coverage.served(key, tokens, self._check(held, model, batch_data))
                return
            began = time.perf_counter()
            self._original(model, batch_data)
            took = time.perf_counter() - began
            self._eager_s = took if self._eager_s is None else 0.8 * self._eager_s + 0.2 * took
            self.turns.slice_s = SLICE_OF_EAGER * self._eager_s
        entry = self.coverage.entry(key)
        fallback = (Fallback.NOT_PLANNED if key not in self._planned else
                    Fallback.FAILED if entry.state == "failed" else Fallback.NO_GRAPH_YET)
        self.coverage.served(key, tokens, fallback)
        if self.lazy and fallback is Fallback.NO_GRAPH_YET:
            with self._wake:
                self._demand[key] = self._demand.get(key, 0) + 1
                self._wake.notify()

    def _replay(self, held: _Graph) -> None:
        with _compute_stream(self.processor):
            held.graph.replay()

    def _check(self, held: _Graph, model, batch_data: dict) -> Fallback | None:
        """A new graph's first step: the engine's eager step, then the replay from the same
        start (``eager_then_replay``); live if the tokens are identical. The step serves the
        eager tokens, and leaves the cache as the eager step did, either way."""
        io = self.processor.inputs_and_outputs
        rows = io.num_request_in_batch
        differ = eager_then_replay(self.processor, functools.partial(self._original, model, batch_data),
                                   functools.partial(self._replay, held), lambda: io.output_ids[:, :rows])
        if differ is None:
            held.checked = True
            self._live(held.key)
            return None
        got, expected = differ
        self._fail(held.key, f"its replay gave tokens {_short(got)} where the engine's eager step gave "
                             f"{_short(expected)}")
        return Fallback.FAILED

    # -- capture ---------------------------------------------------------------------------

    def capture_all(self, progress=None) -> None:
        """Foreground: every key, largest first, each a transaction on the engine's own
        warmup batch for it.

        The warmup requests read cache slots nobody wrote: the cache is filled with seeded
        random values first (before serving it holds nothing), so verify compares steps
        that attend to something. Left as allocated it may hold NaN, and an eager step and
        a wrong replay would then agree on every token."""
        generator = torch.Generator(device=self._device()).manual_seed(0)
        for tensor in (*self.processor.cache.key_cache, *self.processor.cache.value_cache):
            tensor.normal_(generator=generator)
        if len(self.plan.keys) > AHEAD_MOST:
            log.warning("graphflow: capturing all %d keys of %s before serving; lazy=True captures the keys steps "
                        "ask for first, and longest= or the padding intervals bound the plan", len(self.plan.keys),
                        self.plan.name)
        self._capture_each(self._device(), progress)
        self.processor.inputs_and_outputs.reset()
        self._measured()

    def _capture_each(self, device: torch.device, progress) -> None:
        _warm_stream(self._stream, device)
        for index, key in enumerate(self.plan.keys):
            began = time.perf_counter()
            before = self._backend.memory_allocated(device)
            self._capture_foreground(key, first=index == 0)
            self.key_memory[key] = (before, self._backend.memory_allocated(device))
            entry = self.coverage.entry(key)
            line = (f"[{index + 1}/{len(self.plan.keys)}] {key}: {entry.state} in {time.perf_counter() - began:.2f} s"
                    f", pool {_mib(self._pool_bytes())}")
            (progress or log.info)(line)

    def _capture_foreground(self, key: ServingKey, first: bool) -> None:
        processor = self.processor
        io, cache = processor.inputs_and_outputs, processor.cache
        states = _warmup_batch(processor, key)
        held = None
        try:
            if not states:
                raise RuntimeError("the cache has no room for a batch of this key")
            decode = key.path == DECODE
            io.prepare_batch_tensors(states, processor.logit_processor, decode, key.q, key.kv, use_padding=True)
            call = self._call(key)
            self._eager(call)
            if first:
                self._probe_pool(call)
            graph, pool = self._captured(call)
            held = _Graph(key, graph, checked=False, pool=pool)
            graph.ready()
            if self.verify and eager_then_replay(processor, functools.partial(self._eager, call),
                                                 functools.partial(self._replay, held), lambda: io.output_ids):
                raise RuntimeError("its replay's tokens differ from the engine's eager step on the same batch")
            held.checked = True
            self._graphs[key] = held
            self._live(key)
        except Exception as exc:  # noqa: BLE001 - any failure of one key is that key's: it serves eagerly
            if held is not None:
                held.graph.destroy()
            self._fail(key, _reason(exc))
        finally:
            for state in states:
                cache.free_blocks(state.state.request_id)

    def _capture_loop(self) -> None:
        """Lazy: keys in order of demand, then the rest of the plan, until all are done.

        It starts once the engine has taken its first step: what the engine does as it
        starts (resetting its batch processor, its first allocations on its stream, its
        kernels' first launches) is then done, and none of it runs beside a capture."""
        try:
            while not self._stepped.wait(0.05):
                if self._closing:
                    return
            _warm_stream(self._stream, self._device())
            while True:
                with self._wake:
                    key = self._next()
                    while key is None and not self._closing and (self._todo or not self._ahead):
                        self._wake.wait(0.05)
                        key = self._next()
                    if self._closing or key is None:
                        return
                self._capture_lazy(key)
        finally:
            self._measured()

    def _next(self) -> ServingKey | None:
        if self._demand:
            key = max(self._demand, key=self._demand.get)
            del self._demand[key]
            if key in self._todo:
                self._todo.remove(key)
                return key
        if self._todo and self._ahead:
            return self._todo.pop(0)
        return None

    def _probe_pool(self, call) -> None:
        """The pool's forecast before anything is captured: the first (largest) key's step
        once more, warm, every allocation in a pool of its own (``Backend.pool_probe``), whose
        reserved bytes a capture reserves the same way; the smaller keys' graphs reuse its
        blocks. The peak of allocated bytes said 113 MiB for a 130 MiB pool on the H200."""
        device = self._device()
        if not self._backend.probes_pools(device):
            return
        with self._backend.pool_probe(device) as probe, probe.route():
            self._eager(call)
        self.memory["estimated_pool_bytes"] = probe.bytes

    def _capture_lazy(self, key: ServingKey) -> None:
        call = self._call(key)
        tries = self._tries.get(key, 0)
        # A first try gives way to waiting steps after each slice (see Turns for when
        # that is safe); a key whose capture failed once records its next tries whole,
        # between two steps, in case a step's work beside the open capture broke it. The
        # CPU backend's capture runs the step, and leaves every tensor the step writes as
        # it found it: never beside a step.
        pausing = self._pausing and tries == 0
        try:
            self._warm(key)
            with self.turns.recording(pausing=pausing), contextlib.nullcontext() if self._backend.captures_graphs \
                    else _restored(self.processor):
                graph, pool = self._captured(call)
            graph.ready()  # instantiation: beside the steps
        except Exception as exc:  # noqa: BLE001 - the key serves eagerly, with why
            tries = self._tries[key] = tries + 1
            if tries < LAZY_TRIES:
                log.info("graphflow: capturing %s failed (%s); trying again later, recorded between two steps",
                         key, _reason(exc))
                with self._wake:
                    self._todo.append(key)
                    self._demand.setdefault(key, 0)
                return
            self._fail(key, _reason(exc))
            return
        held = _Graph(key, graph, checked=not self.verify, pool=pool)
        self._graphs[key] = held
        if held.checked:
            self._live(key)
        else:
            self.coverage.entry(key).state = "captured"
        log.debug("captured %s", key)

    def _warm(self, key: ServingKey) -> None:
        """Lazy: the key's step once, eagerly, on this thread and the capture stream, before
        its capture. Libraries keep per-thread state made at a first call: cuDNN's handle
        and its attention plans for each shape, made inside a capture, fail the capture
        (``CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED`` on the H200, for every
        lazy capture). The run is on the scratch IOs, beside the steps, giving way to them
        as a recording does. Decode keys (the flash-only fast path) index the cache
        through a block table, which has no scratch block: they are not warmed."""
        if self._scratch is None or key.path == DECODE:
            return
        with self.turns.recording(pausing=True), torch.no_grad(), torch.cuda.stream(self._stream):
            self._call(key, self._scratch)()

    def _call(self, key: ServingKey, io=None):
        """The engine's forward for ``key``, on views of its static tensors the key sizes
        (or of ``io``'s, another IO object of the engine's class).

        The views come from the engine's own ``get_model_kwargs`` on a shallow copy of its
        IOs set to the key, so the live IOs (which a step may be filling) are not touched.
        """
        processor = self.processor
        io = copy.copy(io if io is not None else processor.inputs_and_outputs)
        io.use_block_table = key.path == DECODE
        io.num_q_tokens = key.q
        io.max_kv_read = 0 if io.use_block_table else key.kv
        io.max_seqlen_k = dict(zip(io.max_seqlen_k, key.seqlens)) if key.seqlens else dict(io.max_seqlen_k)
        batch_data = io.get_model_kwargs(use_padding=True)
        runner = processor.model_runner
        model = self.model
        if runner.supports_logits_to_keep(model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        forward, _ = runner._get_forward_fn(use_block_table=io.use_block_table)
        return functools.partial(forward, model, batch_data, *io.get_cb_kwargs())

    def _eager(self, call) -> None:
        """``call`` on the engine's compute stream, without autograd (as the engine's steps run)."""
        with torch.no_grad(), _compute_stream(self.processor):
            call()

    # -- bookkeeping -----------------------------------------------------------------------

    def _live(self, key: ServingKey) -> None:
        self.coverage.entry(key).state = "live"

    def _fail(self, key: ServingKey, why: str) -> None:
        held = self._graphs.pop(key, None)
        if held is not None:
            held.graph.destroy()
        entry = self.coverage.entry(key)
        entry.state, entry.failure = "failed", why
        log.warning("graphflow: %s serves eagerly: %s", key, why)

    def _measured(self) -> None:
        self.all_captured_s = time.perf_counter() - self.started
        self.memory["pool_bytes"] = self._pool_bytes()

    def _captured(self, call) -> tuple[object, object]:
        """``call`` captured into the current pool, without autograd (as the engine's steps
        run: with autograd on, the KV cache written in place would keep every capture's
        activations alive); the graph and its pool. A capture that fails may leave its pool
        unusable for another capture (torch gives back the pool's use of an unended
        capture): the next ones go to a new pool, and the failed one, if no graph uses it,
        is released now. Kept to the end, every failure held its pool's memory: 6.6 GiB on
        the H200 once every lazy capture failed."""
        pool = next(reversed(self._pools))
        try:
            with torch.no_grad():
                return self._backend.capture([call], call, self._stream, pool), pool
        except BaseException:
            self._new_pool()
            self._release_if_unused(pool)
            raise

    def _new_pool(self) -> None:
        pool = self._backend.new_pool(self._device())
        self._pools[pool] = self._stack.push("release a graph pool", functools.partial(self._backend.release_pool, pool))

    def _release_if_unused(self, pool) -> None:
        """Release ``pool`` now if captures no longer go to it and no graph uses it. Only
        where no capture can be open: emptying the cache (``release_pool``) is refused
        while one is, and a lazy recording may be paused, open, beside the engine's steps."""
        # A copy: the engine's thread drops a graph whose check failed.
        if pool is next(reversed(self._pools)) or any(h.pool is pool for h in list(self._graphs.values())):
            return
        self._stack.run_now(self._pools.pop(pool))

    def _pool_bytes(self) -> int | None:
        sizes = [self._backend.pool_bytes(pool) for pool in self._pools]
        return None if None in sizes else sum(sizes)

    def _device(self) -> torch.device:
        return self.processor.inputs_and_outputs.device

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Lazy: wait until every key of the plan is captured or failed; whether it was."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def retried(self) -> int:
        """Lazy: how many keys' captures failed at least once (each then recorded whole
        between two steps, until it succeeded or ran out of tries)."""
        return len(self._tries)

    def report(self) -> str:
        """The coverage table, its warnings and the memory, for the end of a run."""
        lines = [self.coverage.table()]
        lines += [f"warning: {w}" for w in self.coverage.warnings()]
        if self.lazy:
            lines.append(f"lazy capture: recordings paused {self.turns.pauses} times for the engine's steps; "
                         f"{self.retried} keys failed a capture and were recorded again whole between two steps")
        estimated, pool = self.memory.get("estimated_pool_bytes"), self.memory.get("pool_bytes")
        lines.append(f"graph memory: pool {_mib(pool)}" + (f", estimated {_mib(estimated)} before capture"
                                                           if estimated is not None else ""))
        return "\n".join(lines)

    def close(self) -> None:
        """Stop capturing, give the engine its own forward back, free every graph."""
        with self._wake:
            self._closing = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        failure = self._stack.unwind()
        if failure is not None:
            raise failure


def serve(manager, *, lazy: bool = False, verify: bool = True, backend: BackendKind | str = BackendKind.AUTO,
          longest: int | None = None, keys=None, progress=None) -> Serving:
    """Put graphflow in place of ``manager``'s graph capture (a ``ContinuousBatchingManager``,
    before ``start()``, or after it with ``lazy``); see the module docstring. ``longest``:
    the most tokens a request holds on this server (prompt and new tokens), which bounds
    the keys (``serving_keys``; default: the model's ``max_position_embeddings``). ``keys`` limits the plan to
    some of its keys (the others are served eagerly as "key never captured"). Foreground
    capture reports each key to ``progress`` (a function of one line; default: the log).
    """
    if not lazy and manager.is_running():
        raise PlanError("a foreground capture runs before the engine serves: call serve(manager) before "
                        "manager.start(), or serve(manager, lazy=True) on a running one", element="lazy")
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
        if lazy:
            # The engine serves on its own thread while a capture is open (Turns): its
            # calls there (syncs of its own stream, allocations) are not this capture's to refuse.
            chosen.capture_error_mode = "thread_local"
        device = processor.inputs_and_outputs.device
        stream = chosen.new_stream(device)
        stack.push("give back the capture stream", functools.partial(chosen.release_stream, stream))
        verify = verify and not processor.model_runner.do_sample
        serving = Serving(manager.model, processor, plan, chosen, stream, stack, lazy=lazy, verify=verify)
        stack.push("destroy the graphs", functools.partial(_destroy_all, serving))
        runner = processor.model_runner
        runner.compute_batch = serving.compute_batch
        stack.push("give the engine its own forward back", functools.partial(vars(runner).pop, "compute_batch"))
        for name in ("prepare_next_batch", "update_batch"):
            setattr(processor, name, getattr(serving, name))
            stack.push(f"give the engine its own {name} back", functools.partial(vars(processor).pop, name))
        log.info("graphflow serves %s: %d keys, %s", plan.name, len(plan.keys),
                 "captured in the background" if lazy else "captured before serving")
        if not processor.model_runner.do_sample and not verify:
            log.info("graphflow: verify is off")
        elif processor.model_runner.do_sample:
            log.info("graphflow: sampling is on, so new graphs go live unchecked (sampled tokens differ by design)")
        if lazy:
            serving._thread = threading.Thread(target=serving._capture_loop, name="graphflow-serving-capture",
                                               daemon=True)
            serving._thread.start()
        else:
            serving.capture_all(progress)
        return serving
    except BaseException:
        stack.unwind()
        raise


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


def _warmup_batch(processor, key: ServingKey) -> list:
    """Fake requests for a batch of ``key`` (the engine's own warmup states), their blocks
    allocated in the cache. The batch is padded to the key whatever it holds, so its
    shapes are the key's: one request of as many query tokens, reading as much of the
    cache as one request may (a sliding window's worth at most) and the cache has room for."""
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.generation.continuous_batching.utils import create_warmup_future_states

    cache = processor.cache
    if key.path == DECODE:
        return create_warmup_future_states(key.q, RequestStatus.DECODING, 1, cache.block_size, cache)
    limit = getattr(processor.scheduler, "read_cache_limit", None)
    kv = min(key.kv, cache.num_pages - key.q, (limit - 1) if limit else key.kv)
    while True:
        states = create_warmup_future_states(1, RequestStatus.PREFILLING, key.q, max(kv, 0), cache)
        if states or kv <= 0:
            return states
        kv //= 2


def _scratch_io(processor):
    """The engine's IO tensors once more, of the same sizes, holding no batch: every
    index points at the cache's trash blocks (padding reads the zeroed one and writes the
    one nothing reads). A warm run on them writes these tensors and that write-only block,
    never what the engine's steps use, so it may run beside them. Token ids, positions and
    masks are zeros, not what the memory held: a token id out of range would fail on the
    device."""
    io = processor.inputs_and_outputs
    scratch = type(io)(cache=processor.cache, config=io.config, continuous_batching_config=processor.cb_config,
                       device=io.device, model_dtype=io.model_dtype, logit_processor=processor.logit_processor)
    scratch.input_ids.zero_()
    scratch.position_ids.zero_()
    for mask in (scratch.attention_mask or {}).values():
        mask.zero_()
    return scratch


def eager_then_replay(processor, eager, replay, outputs) -> tuple[list, list] | None:
    """The engine's eager step, then a graph's replay from the same start: None if
    ``outputs()`` held the same after both, else the first row of each (replayed, eager).
    Either way ``outputs()`` and the KV slots the step writes are left as the eager step
    left them: the slots are put back before the replay (``_Written``) and the eager
    step's after it.

    All of it on the engine's compute stream, where its steps write the outputs and the
    cache, and the comparison on the host waits for all of it. Run on the caller's
    stream, the copies could read the outputs before the step wrote them, and the slots'
    index, freed there while its last write still waited on the compute stream, was
    handed to the next allocation and overwritten: an out-of-bounds ``index_copy_`` on
    the H200, and every later CUDA call failed."""
    with _compute_stream(processor):
        written = _Written(processor)
        start = written.read()
        eager()
        expected = outputs().clone()
        after = written.read()
        written.write(start)
        replay()
        got = outputs().clone()
        written.write(after)
        if torch.equal(got, expected):
            return None
        outputs().copy_(expected)
        return got[0].tolist(), expected[0].tolist()


def _compute_stream(processor):
    """The engine's compute stream, where its steps run, as the current stream (no stream on the CPU)."""
    stream = processor.inputs_and_outputs.compute_stream
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


class _Written:
    """The KV cache slots the batch in the IOs writes, every layer: read before a step and
    written back, so that a second run of the step starts where the first did. Made and
    used on the stream the steps run on (``eager_then_replay``'s), so that its tensors are
    that stream's: freed there, no other stream's allocation takes them while a write
    waits.

    A step is not idempotent: a sliding-window layer reads the old KV before it writes the
    new (``PagedAttentionCache.update``), and a chunk longer than the window writes over
    slots that same chunk reads. Run twice, the second run reads what the first wrote and
    computes other KV, and other tokens (on a 40-token prompt with a window of 8: a good
    graph failed, or a live request's cache left with the second run's KV and later tokens
    wrong). The decode fast path writes through a block table, not these indices: flash's
    KV-cache kernel writes the new KV and then reads, so a second run reads what the first
    did; nothing is kept for it."""

    def __init__(self, processor) -> None:
        io, cache = processor.inputs_and_outputs, processor.cache
        self._tensors = (*cache.key_cache, *cache.value_cache)
        # Every group's indices index every layer tensor (the groups share them); padding
        # rows point at the write-only trash slot. A copy: the live indices change with the
        # next batch.
        self._index = None if io.use_block_table else \
            io.write_index_storage[:, :io.num_q_tokens].reshape(-1).to(torch.long, copy=True)

    def read(self) -> tuple[torch.Tensor, ...]:
        if self._index is None:
            return ()
        return tuple(t.index_select(0, self._index) for t in self._tensors)

    def write(self, rows: tuple[torch.Tensor, ...]) -> None:
        for tensor, saved in zip(self._tensors, rows):
            tensor.index_copy_(0, self._index, saved)


def _warm_stream(stream, device: torch.device) -> None:
    """One matmul on the capture stream before its first capture: cuBLAS makes the
    stream's workspace at its first call there, which must not be inside a capture. Made
    inside, the workspace (32 MiB on the H200) is allocated from the graph pool and kept
    by cuBLAS for good: foreground pools read 130 MiB for a forecast and a lazy pool of 98."""
    if device.type != "cuda":
        return
    with torch.cuda.stream(stream):
        a = torch.ones(8, 8, device=device, dtype=torch.bfloat16)
        (a @ a).sum()
    stream.synchronize()


class _restored:
    """The CPU backend's capture runs the step on whatever the engine's tensors hold: they
    are put back as they were after it (outputs, inputs and the KV cache)."""

    def __init__(self, processor) -> None:
        io, cache = processor.inputs_and_outputs, processor.cache
        self._io = io
        self._tensors = [io._bulk_input_tensor, io.output_ids, io.write_index_storage, io.read_index_storage,
                         *(io.attention_mask or {}).values(), *cache.key_cache, *cache.value_cache]

    def __enter__(self) -> None:
        self._saved = [t.clone() for t in self._tensors]
        # Indices and masks of no batch (every row padding), as after the engine's own reset,
        # so the step reads only within the cache; on a copy, the engine's sizes untouched.
        blank = copy.copy(self._io)
        blank.max_seqlen_k, blank.total_seqlen_k = dict(blank.max_seqlen_k), dict(blank.total_seqlen_k)
        blank._reset_static_tensors(full_reset=True)

    def __exit__(self, *exc_info) -> None:
        for tensor, saved in zip(self._tensors, self._saved):
            tensor.copy_(saved)


def _destroy_all(serving: Serving) -> None:
    for held in serving._graphs.values():
        held.graph.destroy()
    serving._graphs.clear()


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _short(tokens: list) -> str:
    return str(tokens[:8])[:-1] + (", ...]" if len(tokens) > 8 else "]")


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"
