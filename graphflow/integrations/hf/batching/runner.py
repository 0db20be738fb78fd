"""The engine's step under graphflow: each step dispatched to its key's graph, a new graph
checked on its first batch, every step counted.

transformers' ``ModelRunner.compute_batch`` is replaced by ``StepRunner.compute_batch``,
which replays the batch's key when its graph is live, and otherwise runs the engine's own
eager step and says why (``Fallback``). The first step served on a new graph runs the
engine's eager step too and compares the tokens (``eager_then_replay``): the graph goes
live only if they are identical, and the step serves the eager tokens either way; a graph
that differs is taken out at once and destroyed by the capture thread.

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
from graphflow.integrations.hf.batching.capture import KeyGraph, KeyCapture, eager_then_replay
from graphflow.integrations.hf.batching.coverage import Coverage, Fallback
from graphflow.integrations.hf.batching.keys import ServingKey, key_of

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
        """The engine's ``ModelRunner.compute_batch``: replay the key's graph, or run the
        engine's eager step and say why."""
        io = self.processor.inputs_and_outputs
        key = key_of(io)
        tokens = io.total_seqlen_q
        core = self._capture.core
        if core is not None:
            core.ask(key)
        with self.turns.step():
            held = self._graphs.get(key)
            if held is not None and held.checked:
                self._capture.replay(held)
                self.coverage.served(key, tokens, None)
                return
            if held is not None:
                self.coverage.served(key, tokens, self._check(held, model, batch_data))
                return
            began = time.perf_counter()
            self._original(model, batch_data)
            self.turns.eager_took(time.perf_counter() - began)
        state = self.coverage.state(key)
        fallback = (Fallback.NOT_PLANNED if key not in self._planned else
                    Fallback.FAILED if state is KeyState.FAILED else Fallback.NO_GRAPH_YET)
        self.coverage.served(key, tokens, fallback)

    def _check(self, held: KeyGraph, model, batch_data: dict) -> Fallback | None:
        """A new graph's first step: the engine's eager step, then the replay from the same
        start (``eager_then_replay``); live if the tokens are identical. The step serves the
        eager tokens, and leaves the cache as the eager step did, either way."""
        io = self.processor.inputs_and_outputs
        rows = io.num_request_in_batch
        differ = eager_then_replay(self.processor, functools.partial(self._original, model, batch_data),
                                   functools.partial(self._capture.replay, held), lambda: io.output_ids[:, :rows])
        core = self._capture.core
        if differ is None:
            held.checked = True
            core.checked(held.key, None)
            return None
        got, expected = differ
        self._graphs.pop(held.key, None)  # no step replays it again; the capture thread destroys it
        core.checked(held.key, CaptureError(f"its replay gave tokens {_short(got)} where the engine's eager step "
                                            f"gave {_short(expected)}", hint="the key is served eagerly"))
        return Fallback.FAILED


def _short(tokens: list) -> str:
    return str(tokens[:8])[:-1] + (", ...]" if len(tokens) > 8 else "]")
