"""The capture side of graphflow's serving: how one key of transformers' continuous
batching is captured, foreground or lazily, into pools a failed capture replaces.

* **Foreground** (``capture_all``): keys of the plan before serving (``serve`` leaves the
  FULL ones to the lazy-capture thread unless asked for all), in the plan's order (the
  PIECEWISE keys, which cover every batch, then the FULL ones, each largest first), the
  graph pool forecast first; each key a transaction: a warm run where it needs one, the
  capture, and for a sample of the keys a verification on the engine's own warmup batch
  for it (eager step, replay, tokens compared: ``eager_then_replay``), or undone: a key
  that fails is rolled back alone, logged with why, and served eagerly. The keys not in
  the sample are checked on their first batch (``checked``, from the runner).
* **Lazy**: this is the ``Capturer`` that the lazy-capture thread
  (``graphflow.engine.lazy``, the engine's own) drives: it says how one key is warmed and
  recorded in its turn beside the engine's steps, and how a failed key is undone. The
  thread owns the order, the turns, the retries and the key states; the engine's steps
  check each new graph on its first batch (``graphflow.integrations.hf.batching.runner``).

A PIECEWISE key's step is captured in pieces cut at its attention calls
(``graphflow.integrations.hf.batching.pieces``), on views of the engine's static tensors
that read no KV: the pieces never read the KV sizes, and an attention that a piece held
by mistake (one not called through transformers' registry) would then differ from the
engine's step on a batch that reads KV, as a foreground key's verification batch does.

Graphs are captured into the newest pool of a ``PoolSet``: a failed capture may leave its
pool unusable, so the next captures go to a fresh one.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable, Iterator

import attrs
import torch

from graphflow.engine.context import first_of_each_mode
from graphflow.engine.lazy import KeyState
from graphflow.engine.options import Verify
from graphflow.engine.pools import PoolSet
from graphflow.engine.rollback import UndoStack
from graphflow.engine.turns import Turns
from graphflow.errors import CaptureError
from graphflow.integrations.hf.batching.coverage import Coverage
from graphflow.integrations.hf.batching.keys import DECODE, ServingKey
from graphflow.integrations.hf.batching.pieces import AttentionCut, Pieces
from graphflow.integrations.hf.batching.plan import ServingPlan
from graphflow.plan import Mode

__all__ = ["KeyCapture", "KeyGraph", "StepCall", "eager_then_replay"]

log = logging.getLogger("graphflow.serving")

#: A foreground capture of a plan this large takes minutes; it says so first.
AHEAD_MOST = 256


@attrs.define(eq=False)
class KeyGraph:
    """One key's graph; ``checked`` once its replay matched the engine's eager step. A
    PIECEWISE key's has its ``pieces``: its attention calls, made eagerly at replay on the
    step's batch."""

    key: ServingKey
    graph: object
    checked: bool
    pieces: Pieces | None = None

    def replay(self, batch: dict) -> None:
        """The graph on ``batch``, the step's batch arguments (which only a PIECEWISE key reads)."""
        if self.pieces is None:
            self.graph.replay()
        else:
            self.pieces.replay(self.graph, batch)

    def destroy(self) -> None:
        self.graph.destroy()
        if self.pieces is not None:
            self.pieces.release()


@attrs.frozen(eq=False)
class StepCall:
    """The engine's step for one key on one batch (``ModelRunner._forward_process_and_sample``):
    ``forward(model, batch, carry_over_ids, prev_output_ids, output_ids)``, with its batch
    kept: a PIECEWISE capture maps its attention's arguments against it."""

    forward: Callable
    model: object
    batch: dict
    outputs: tuple

    def __call__(self) -> None:
        self.forward(self.model, self.batch, *self.outputs)


class KeyCapture:
    """Captures keys of one engine (see the module docstring); made by ``serve``."""

    def __init__(self, model, processor, plan: ServingPlan, backend, stream, stack: UndoStack,
                 graphs: dict[ServingKey, KeyGraph], coverage: Coverage, cut: AttentionCut | None, *, lazy: bool,
                 verify: Verify) -> None:
        self.model, self.processor, self.plan = model, processor, plan
        #: The attention calls of the PIECEWISE keys (None when the plan has none).
        self.cut = cut
        self.coverage = coverage
        self.verify = verify
        self.memory: dict[str, int | None] = {}
        #: Foreground: device memory allocated before and after each key's transaction.
        self.key_memory: dict[ServingKey, tuple[int, int]] = {}
        self._backend, self._stream, self._stack = backend, stream, stack
        self.pools = PoolSet(backend, self._device(), stack)
        #: The graphs steps may replay, by key: added here, and taken out by the step whose
        #: first batch rejects one.
        self.graphs = graphs
        self._mine: dict[ServingKey, KeyGraph] = {}  # every graph captured and not yet destroyed
        #: Lazy on a GPU: IO tensors of the engine's sizes for warm runs (``_scratch_io``).
        self._scratch = _scratch_io(processor) if lazy and backend.captures_graphs else None
        self.core = None  # the lazy-capture thread, once ``serve`` made it
        self.started = time.perf_counter()
        #: Seconds from ``serve`` until every key was captured or failed (lazy: a captured
        #: key's first step then checks it).
        self.all_captured_s: float | None = None
        self._foreground_ready = False  # the cache filled, the capture stream warmed, the pool forecast

    # -- foreground ----------------------------------------------------------------------------

    def capture_all(self, progress=None, keys=None) -> None:
        """Foreground: every key in the plan's order (or ``keys``, in theirs) before
        serving, the pool forecast first (``_forecast``). The sample (``_sample``) is
        verified against the engine's eager step on its own warmup batch before ``serve``
        returns; every other key goes in unchecked and its first real batch checks it
        (``StepRunner``), as the engine's first-use checks do (``graphflow.engine.first_use``):
        a capture broken in the code is broken at the largest key too, and one wrong at a
        single size never serves. A key is warmed only when it needs it (``_warms``): a
        PIECEWISE key after the first is captured cold, without a batch of its own.

        The warmup requests read cache slots nobody wrote: the blocks requests use are
        filled with seeded random values first (before serving they hold nothing), so
        verify compares steps that attend to something. Left as allocated they may hold
        NaN, and an eager step and a wrong replay would then agree on every token. The
        engine's two blocks past them are left as it keeps them: the read-trash block,
        which every padded KV read of every step reads, stays zero. The cache, the capture
        stream and the forecast are made ready once, however many calls capture keys."""
        if not self._foreground_ready:
            generator = torch.Generator(device=self._device()).manual_seed(0)
            cache = self.processor.cache
            for tensor in (*cache.key_cache, *cache.value_cache):
                tensor[: cache.num_pages].normal_(generator=generator)
            _warm_stream(self._stream, self._device())
            self._forecast()
            self._foreground_ready = True
        keys = self.plan.keys if keys is None else tuple(keys)
        if len(keys) > AHEAD_MOST:
            log.warning("graphflow: capturing all %d keys of %s before serving; lazy=True captures the keys steps "
                        "ask for first, and longest= or the padding intervals bound the plan", len(keys),
                        self.plan.name)
        device = self._device()
        sample = self._sample(keys)
        for index, key in enumerate(keys):
            began = time.perf_counter()
            before = self._backend.memory_allocated(device)
            self._capture_foreground(key, check=key in sample)
            self.key_memory[key] = (before, self._backend.memory_allocated(device))
            line = (f"[{index + 1}/{len(keys)}] {key}: {self.coverage.state(key)} in "
                    f"{time.perf_counter() - began:.2f} s, pool {_mib(self.pools.nbytes())}")
            (progress or log.info)(line)
        self._instantiated(keys)
        self.processor.inputs_and_outputs.reset()
        self._measured()

    def _sample(self, keys: tuple[ServingKey, ...]) -> frozenset[ServingKey]:
        """The keys verified before ``serve`` returns: all with ``Verify.ALL``, none with
        ``OFF``; with ``SAMPLE`` the first of each mode in capture order, the largest, which
        runs every kernel of its mode at its widest. The others are checked on their first
        batch, which costs a step one eager step and one replay, once: verifying one before
        serving costs its warmup batch, an eager step and a replay, and makes ``serve`` wait."""
        if self.verify is Verify.ALL:
            return frozenset(keys)
        if not self.verify:
            return frozenset()
        return frozenset(first_of_each_mode(keys))

    def _capture_foreground(self, key: ServingKey, check: bool) -> None:
        """One key, a transaction: its warm run when it needs one (``_warms``), its
        capture, and with ``check`` its verification on the engine's own warmup batch for
        it (eager step, replay from the same start, tokens compared). A key that fails
        anywhere is undone alone (its graph destroyed, its pool's memory back), logged
        with why, and served eagerly. A key neither warmed nor checked needs no batch of
        its own (``_no_batch``)."""
        held = None
        try:
            warm = self._warms(key)
            with self._batch(key) if check or warm else self._no_batch() as step:
                if warm:
                    with self._warming(key):
                        self._eager(step)
                held = self._captured(key, self._call(key, capture=True))
                if check:
                    held.graph.ready()
                    io = self.processor.inputs_and_outputs
                    differ = eager_then_replay(self.processor, functools.partial(self._eager, step),
                                               functools.partial(self.replay, held, step.batch),
                                               lambda: io.output_ids)
                    self.coverage.checked(key, before_ready=True, passed=differ is None)
                    if differ is not None:
                        raise RuntimeError("its replay's tokens differ from the engine's eager step on the same batch")
            held.checked = check or not self.verify
            self._mine[key] = self.graphs[key] = held
            self.coverage.mark(key, KeyState.LIVE if held.checked else KeyState.CAPTURED)
        except Exception as exc:  # noqa: BLE001 - any failure of one key is that key's: it serves eagerly
            if held is not None:
                held.destroy()
                self.pools.drop(key)
            self.coverage.mark(key, KeyState.FAILED, _reason(exc))
            log.warning("graphflow: %s serves eagerly: %s", key, _reason(exc))

    def capture_one(self, key: ServingKey) -> None:
        """Foreground: one more key before serving, a transaction as in ``capture_all``
        (unchecked: its first batch checks it); failed, it is served eagerly."""
        self._capture_foreground(key, check=False)
        self._instantiated((key,))
        self.processor.inputs_and_outputs.reset()

    def held(self) -> dict[ServingKey, KeyGraph]:
        """Every key's graph captured or adopted, and not destroyed."""
        return dict(self._mine)

    def adopt(self, held: KeyGraph) -> None:
        """A key's graph made elsewhere (built from saved nodes) served as if captured here,
        before serving: unchecked, its first batch checks it against the engine's eager step."""
        held.checked = not self.verify
        self._mine[held.key] = self.graphs[held.key] = held
        self.coverage.mark(held.key, KeyState.LIVE if held.checked else KeyState.CAPTURED)

    def _instantiated(self, keys: tuple[ServingKey, ...]) -> None:
        """Wait for the graphs of ``keys`` to be instantiated (the CUDA backend instantiates a
        long capture on a worker thread, beside the next captures: ``Graph.ready``); one
        whose instantiation failed is undone and served eagerly."""
        for key in keys:
            held = self._mine.get(key)
            if held is None:
                continue
            try:
                held.graph.ready()
            except Exception as exc:  # noqa: BLE001 - that key's failure: it serves eagerly
                self.coverage.mark(key, KeyState.FAILED)
                self.undo(key, exc, final=True)

    @contextlib.contextmanager
    def _batch(self, key: ServingKey) -> Iterator[StepCall]:
        """The engine's own warmup batch for ``key`` in its IOs (``_warmup_batch``), and the
        engine's step on it; the batch's blocks freed after."""
        processor = self.processor
        states, kv = _warmup_batch(processor, key)
        try:
            if not states:
                raise RuntimeError("the cache has no room for a batch of this key")
            processor.inputs_and_outputs.prepare_batch_tensors(states, processor.logit_processor, key.path == DECODE,
                                                               key.q, kv, use_padding=True)
            yield self._call(key)
        finally:
            for state in states:
                processor.cache.free_blocks(state.state.request_id)

    @contextlib.contextmanager
    def _no_batch(self) -> Iterator[None]:
        """The IOs holding no batch (every row padding, as the engine's reset leaves them)
        for a key's capture: a capture runs nothing and fixes only the tensors' addresses,
        and the CPU backend's, which runs the step, then reads nothing out of range (the
        last batch's indices, say, past a smaller key's tokens)."""
        self.processor.inputs_and_outputs.reset()
        yield None

    def _forecast(self) -> None:
        """The graph pool of the whole plan, forecast before anything is captured: the
        first (largest) key of each mode, in capture order, run once more warm, every
        allocation in one pool of its own (``Backend.pool_probe``), whose reserved bytes a
        capture reserves the same way (fresh segments, the allocator's rounding, blocks
        reused as the step frees them). Every key's graphs go to one pool, each capture
        reusing the blocks the ones before it freed: the largest key of each mode sets
        what it holds. (The peak of allocated bytes said 113 MiB for a 130 MiB pool on the
        H200.)

        A PIECEWISE key's attention runs outside the probe's pool (``PoolProbe.outside``), as
        it runs outside its graphs; a FULL key's inside, as in its graph. The PIECEWISE key
        alone forecast 2 MiB for a 22 MiB pool on the H100: the other 20 were a segment the
        FULL keys' attention took (the paged SDPA's KV read, repeated per head, is a block
        over 1 MiB, and the allocator cuts those from 20 MiB segments, in a graph's pool as
        anywhere). Each key runs warm first (``_warms``), outside the probe, so that what
        libraries keep from a first call is not counted. A forecast that fails says why
        and leaves none: the key's capture fails the same way and says so."""
        device = self._device()
        if not self._backend.probes_pools(device):
            return
        try:
            with self._backend.pool_probe(device) as probe:
                for key in first_of_each_mode(self.plan.keys):
                    with self._batch(key) as step:
                        if self._warms(key):
                            with self._warming(key):
                                self._eager(step)
                        with probe.route(), self.cut.apart(probe.outside) if key.mode is Mode.PIECEWISE \
                                else contextlib.nullcontext():
                            self._eager(step)
        except Exception as exc:  # noqa: BLE001 - the forecast is a figure: serving goes on without it
            log.warning("graphflow: no forecast of the graph pool: %s", _reason(exc))
            return
        self.memory["estimated_pool_bytes"] = probe.bytes

    def checked(self, key: ServingKey, error: CaptureError | None) -> None:
        """A captured key's first batch compared its replay with the engine's eager step
        (``StepRunner``): live, or failed for good and undone. With a capture thread, in its
        table, the undo queued for it (it may have a capture open, which a pool's release
        may not meet); without one nothing captures any more, and the undo runs here."""
        self.coverage.checked(key, before_ready=False, passed=error is None)
        if self.core is not None:
            self.core.checked(key, error)
        elif error is None:
            self.coverage.mark(key, KeyState.LIVE)
        else:
            self.coverage.mark(key, KeyState.FAILED)
            self.undo(key, error, final=True)

    # -- lazy: the lazy-capture thread's Capturer --------------------------------------------

    def prepare(self) -> None:
        """The capture stream's cuBLAS workspace, made before any capture (``_warm_stream``),
        in a turn of its own: no step allocates meanwhile."""
        with self.core.turns.recording(pausing=False):
            _warm_stream(self._stream, self._device())

    def capture(self, key: ServingKey, turns: Turns, pausing: bool) -> None:
        """One key: warmed on the scratch IOs (``_warm``), recorded in its turn, giving way
        to waiting steps at module calls when ``pausing`` (a first try; see
        ``graphflow.engine.lazy`` for when that is safe), then instantiated beside the
        steps. The CPU backend's capture runs the step, and leaves every tensor the step
        writes as it found it: never beside a step."""
        call = self._call(key, capture=True)
        self._warm(key, turns)
        with turns.recording(pausing=pausing), contextlib.nullcontext() if self._backend.captures_graphs \
                else _restored(self.processor):
            held = self._captured(key, call)
        held.graph.ready()  # instantiation: beside the steps
        held.checked = not self.verify
        self._mine[key] = self.graphs[key] = held
        self.core.captured(key, checked=held.checked)
        log.debug("captured %s", key)

    def undo(self, key: ServingKey, error: BaseException, final: bool) -> CaptureError:
        """A capture that failed (its pool replaced), or a graph its first batch rejected
        (destroyed); either way the key's steps run eagerly until it is captured again, or
        for good once ``final``."""
        why = error.message if isinstance(error, CaptureError) else _reason(error)
        held = self._mine.pop(key, None)
        if held is not None:
            self.graphs.pop(key, None)
            held.destroy()
            self.pools.drop(key)
        if not final:
            log.info("graphflow: capturing %s failed (%s); trying again later, recorded between two steps", key, why)
        else:
            self.coverage.entry(key).failure = why
            log.warning("graphflow: %s serves eagerly: %s", key, why)
        return error if isinstance(error, CaptureError) else CaptureError(why, hint="the key is served eagerly")

    def finish(self) -> None:
        self._measured()

    def _warm(self, key: ServingKey, turns: Turns) -> None:
        """Lazy: the key's step once, eagerly, on this thread and the capture stream, before
        its capture, when it needs one (``_warms``). Libraries keep per-thread state made
        at a first call: cuDNN's handle and its attention plans for each shape, made inside
        a capture, fail the capture (``CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED``
        on the H200, for every lazy capture). The run is on the scratch IOs, giving way to
        the steps as a recording does. Decode keys (the flash-only fast path) index the
        cache through a block table, which has no scratch block: they are not warmed. A
        PIECEWISE key's warm run also sizes the static attention buffers
        (``AttentionCut.warming``)."""
        if self._scratch is None or key.path == DECODE or not self._warms(key):
            return
        with turns.recording(pausing=True), torch.no_grad(), torch.cuda.stream(self._stream), self._warming(key):
            self._call(key, self._scratch)()

    # -- both --------------------------------------------------------------------------------

    def _call(self, key: ServingKey, io=None, *, capture: bool = False) -> StepCall:
        """The engine's forward for ``key``, on views of its static tensors the key sizes
        (or of ``io``'s, another IO object of the engine's class): a FULL key's sizes all,
        a PIECEWISE key's query tokens, its KV sizes those of the batch the IOs hold, or
        none read (``capture``: see the module docstring).

        The views come from the engine's own ``get_model_kwargs`` on a shallow copy of its
        IOs set to the key, so the live IOs (which a step may be filling) are not touched.
        """
        processor = self.processor
        io = copy.copy(io if io is not None else processor.inputs_and_outputs)
        io.use_block_table = key.path == DECODE
        io.num_q_tokens = key.q
        if key.mode is Mode.FULL:
            io.max_kv_read = 0 if io.use_block_table else key.kv
            io.max_seqlen_k = dict(zip(io.max_seqlen_k, key.seqlens)) if key.seqlens else dict(io.max_seqlen_k)
        else:
            io.max_kv_read = 0 if capture else io.max_kv_read
            io.max_seqlen_k = dict(io.max_seqlen_k)
        batch_data = io.get_model_kwargs(use_padding=True)
        runner = processor.model_runner
        model = self.model
        if runner.supports_logits_to_keep(model):
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        forward, _ = runner._get_forward_fn(use_block_table=io.use_block_table)
        return StepCall(forward, model, batch_data, io.get_cb_kwargs())

    def _warms(self, key: ServingKey) -> bool:
        """Whether ``key`` runs once eagerly before its capture: a FULL key always (its
        attention is in its graph, and cuDNN makes a plan at each new shape of it); a
        PIECEWISE key while this thread needs one (``AttentionCut.needs_warming``: the
        first on each thread, and those until the warm runs size any key's views)."""
        return key.mode is not Mode.PIECEWISE or self.cut.needs_warming()

    def _warming(self, key: ServingKey) -> contextlib.AbstractContextManager[None]:
        """Around a PIECEWISE key's eager run before its capture: the static attention
        buffers sized from its calls."""
        return self.cut.warming(key.q) if key.mode is Mode.PIECEWISE else contextlib.nullcontext()

    def _eager(self, call) -> None:
        """``call`` on the engine's compute stream, without autograd (as the engine's steps run)."""
        with torch.no_grad(), compute_stream(self.processor):
            call()

    def replay(self, held: KeyGraph, batch: dict) -> None:
        """``held``'s graph on the engine's compute stream, without autograd (a PIECEWISE
        key's attention runs eagerly); ``batch``: the step's batch arguments."""
        with torch.no_grad(), compute_stream(self.processor):
            held.replay(batch)

    def _captured(self, key: ServingKey, call: StepCall) -> KeyGraph:
        """``call`` captured into the current pool, without autograd (as the engine's steps
        run: with autograd on, the KV cache written in place would keep every capture's
        activations alive); a PIECEWISE key's cut at its attention calls. A capture that
        fails may leave its pool unusable for another capture: the next ones go to a new
        pool (``PoolSet.failed``)."""
        pieces = Pieces() if key.mode is Mode.PIECEWISE else None
        recording = call if pieces is None else functools.partial(self.cut.record, pieces, call, call.batch, key.q)
        try:
            with torch.no_grad():
                graph = self._backend.capture([call], recording, self._stream, self.pools.current)
        except BaseException:
            self.pools.failed()
            raise
        self.pools.holds(key)
        return KeyGraph(key, graph, checked=False, pieces=pieces)

    def _measured(self) -> None:
        self.all_captured_s = time.perf_counter() - self.started
        self.memory.update(self.memory_now())

    def memory_now(self) -> dict[str, int | None]:
        """The graph pools' bytes and the static attention buffers' as they are now."""
        return {"pool_bytes": self.pools.nbytes(),
                "attention_buffer_bytes": 0 if self.cut is None else self.cut.buffers.nbytes}

    def _device(self) -> torch.device:
        return self.processor.inputs_and_outputs.device

    def destroy_all(self) -> None:
        for held in self._mine.values():
            held.destroy()
        self._mine.clear()
        self.graphs.clear()


def _warmup_batch(processor, key: ServingKey) -> tuple[list, int]:
    """Fake requests for a batch of ``key`` (the engine's own warmup states), their blocks
    allocated in the cache, and the padded KV tokens the batch reads. A FULL batch is
    padded to its key whatever it holds, so its shapes are the key's: as many decoding
    requests as it has query tokens (up to the batch's most), each reading its share of
    the key's KV, as much as one may (a sliding window's worth at most) and the cache has
    room for. A PIECEWISE key's: one request of as many query tokens, reading one block of
    past, so the attention its replay runs eagerly reads the cache."""
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.generation.continuous_batching.utils import (
        create_warmup_future_states,
        pad_to_interval,
    )

    cache = processor.cache
    config = processor.model_runner.cb_config
    if key.path == DECODE:
        return create_warmup_future_states(key.q, RequestStatus.DECODING, 1, cache.block_size, cache), 0
    limit = getattr(processor.scheduler, "read_cache_limit", None)
    if key.mode is Mode.PIECEWISE:
        requests, query, past = 1, key.q, min(cache.block_size, cache.num_pages - key.q)
        status = RequestStatus.PREFILLING
    else:
        requests = min(key.q, config.max_requests_per_batch)
        query, past = 1, min(key.kv // requests, min(key.seqlens) - 1)
        status = RequestStatus.DECODING
    past = min(past, (limit - 1) if limit else past)
    while True:
        states = create_warmup_future_states(requests, status, query, max(past, 0), cache)
        if states or past <= 0:
            break
        past //= 2
    if key.mode is Mode.FULL:
        return states, key.kv
    return states, pad_to_interval(max(past, 0), config.kv_padding_interval_size, cache.num_pages)


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
    Either way, a replay that raises included, ``outputs()`` and the KV slots the step
    writes are left as the eager step left them: the slots are put back before the replay
    (``_Written``) and the eager step's after it.

    All of it on the engine's compute stream, where its steps write the outputs and the
    cache, and the comparison on the host waits for all of it. Run on the caller's
    stream, the copies could read the outputs before the step wrote them, and the slots'
    index, freed there while its last write still waited on the compute stream, was
    handed to the next allocation and overwritten: an out-of-bounds ``index_copy_`` on
    the H200, and every later CUDA call failed."""
    with compute_stream(processor):
        written = _Written(processor)
        start = written.read()
        eager()
        expected = outputs().clone()
        after = written.read()
        written.write(start)
        try:
            replay()
            got = outputs().clone()
        except BaseException:
            outputs().copy_(expected)
            raise
        finally:
            written.write(after)
        if torch.equal(got, expected):
            return None
        outputs().copy_(expected)
        return got[0].tolist(), expected[0].tolist()


def compute_stream(processor):
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


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.1f} MiB"
