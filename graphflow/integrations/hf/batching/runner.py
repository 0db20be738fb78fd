"""The engine's step under graphflow: each step dispatched to a graph of its batch, a new
graph checked on its first batch, every step counted.

transformers' ``ModelRunner.compute_batch`` is replaced by ``StepRunner.compute_batch``,
which replays the first of the batch's keys (``batch_keys``: its FULL key when the batch
is decode-only, then its PIECEWISE key) that has a graph, handing the replay the step's
batch arguments (a PIECEWISE key's attention reads them), and otherwise runs the engine's
own eager step and says why (``Fallback``), counted on the key that covers the batch (its
PIECEWISE key, or the decode fast path's). The first step served on a graph not checked
yet (one a lazy or background capture made, or a foreground capture left out of its
sample) runs the engine's eager step too and compares the tokens (``eager_then_replay``):
the graph goes live only if they are identical, and the step serves the eager tokens
either way; a graph that differs is taken out at once and destroyed
(``KeyCapture.checked``), its batches served by their PIECEWISE key or eagerly. While the
capture thread records, a decode-only batch whose FULL graph waits for its check replays
its PIECEWISE key's graph if that one is checked (as a lazy engine's runner does), and
the FULL graph is checked on its first batch once the thread is done.

Lazy capture is asked for the covering key until it is captured, then for the batch's
FULL key: coverage first, then the speed-up.

Verification is against the engine's own eager step (its ``compute_batch`` without
graphs), never against graphflow's. The engine's other two calls of a step
(``prepare_next_batch``, ``update_batch``) take their turn too: no recording of the lazy
capture thread runs beside any of them (``graphflow.engine.turns``). Each eager step's
time sizes the recordings' slices.
"""

from __future__ import annotations

import functools
import time

from graphflow.engine.lazy import KeyState
from graphflow.engine.turns import Turns
from graphflow.errors import CaptureError
from graphflow.integrations.hf.batching.capture import KeyCapture, KeyGraph, eager_then_replay
from graphflow.integrations.hf.batching.coverage import Coverage, Fallback
from graphflow.integrations.hf.batching.keys import ServingKey, batch_keys

__all__ = ["StepRunner"]

class StepRunner:
    """The engine's three calls of a step, in place of its own (see the module docstring)."""

    def __init__(self, processor, capture: KeyCapture, graphs: dict[ServingKey, KeyGraph], coverage: Coverage,
                 turns: Turns) -> None:
        self.processor = processor
        self.coverage = coverage
        self.turns = turns
        self._capture, self._graphs = capture, graphs
        self._planned = frozenset(capture.plan.keys)
        self._original = processor.model_runner.compute_batch
        self._prepare, self._update = processor.prepare_next_batch, processor.update_batch

    def prepare_next_batch(self) -> bool:
        """The engine's own (it fills the static tensors), never beside a capture's recording."""
        with self.turns.step():
            return self._prepare()

    def update_batch(self) -> None:
        """The engine's own (it reads the step's tokens), never beside a capture's recording."""
        with self.turns.step():
            self._update()

    def compute_batch(self, model, batch_data: dict) -> None:
        """The engine's ``ModelRunner.compute_batch``: replay a graph of the batch's keys, or
        run the engine's eager step and say why."""
        io = self.processor.inputs_and_outputs
        keys = batch_keys(io)
        covering = keys[-1]
        tokens = io.total_seqlen_q
        core = self._capture.core
        if core is not None:
            core.ask(covering if self.coverage.state(covering) is KeyState.PLANNED else keys[0])
        runner = self.processor.model_runner
        if runner.supports_logits_to_keep(model):  # the batch as the engine's forward gets it
            batch_data["logits_to_keep"] = batch_data["logits_indices"]
        with self.turns.step():
            held = self._held(keys, core)
            if held is not None and held.checked:
                self._capture.replay(held, batch_data)
                self.coverage.served(held.key, tokens, None)
                return
            if held is not None:
                self.coverage.served(held.key, tokens, self._check(held, model, batch_data))
                return
            began = time.perf_counter()
            self._original(model, batch_data)
            self.turns.eager_took(time.perf_counter() - began)
        state = self.coverage.state(covering)
        fallback = (Fallback.NOT_PLANNED if covering not in self._planned else
                    Fallback.FAILED if state is KeyState.FAILED else Fallback.NO_GRAPH_YET)
        self.coverage.served(covering, tokens, fallback)

    def _held(self, keys: tuple[ServingKey, ...], core) -> KeyGraph | None:
        """The graph a step replays: its first key's that has one. While the capture thread
        records, a checked graph of a later key (the batch's PIECEWISE key) goes before an
        unchecked one: a check's eager step is host work the recordings would wait for; the
        unchecked graph is checked once the thread is done."""
        graphs = [graph for graph in map(self._graphs.get, keys) if graph is not None]
        if not graphs:
            return None
        if not graphs[0].checked and core is not None and core.busy:
            return next((graph for graph in graphs if graph.checked), graphs[0])
        return graphs[0]

    def _check(self, held: KeyGraph, model, batch_data: dict) -> Fallback | None:
        """A new graph's first step: the engine's eager step, then the replay from the same
        start (``eager_then_replay``); live if the tokens are identical. The step serves the
        eager tokens, and leaves the cache as the eager step did, either way (a replay that
        raises fails the graph the same way)."""
        io = self.processor.inputs_and_outputs
        rows = io.num_request_in_batch
        try:
            differ = eager_then_replay(self.processor, functools.partial(self._original, model, batch_data),
                                       functools.partial(self._capture.replay, held, batch_data),
                                       lambda: io.output_ids[:, :rows])
        except Exception as exc:  # noqa: BLE001 - the graph's failure: the step serves the eager tokens
            error = exc if isinstance(exc, CaptureError) else CaptureError(
                f"its replay failed: {type(exc).__name__}: {exc}", hint="the key is served eagerly")
        else:
            if differ is None:
                held.checked = True
                self._capture.checked(held.key, None)
                return None
            got, expected = differ
            error = CaptureError(f"its replay gave tokens {_short(got)} where the engine's eager step gave "
                                 f"{_short(expected)}", hint="the key is served eagerly")
        self._graphs.pop(held.key, None)  # no step replays it again; the capture side destroys it
        self._capture.checked(held.key, error)
        return Fallback.FAILED


def _short(tokens: list) -> str:
    return str(tokens[:8])[:-1] + (", ...]" if len(tokens) > 8 else "]")
