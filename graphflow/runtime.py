"""The runtime: run a batch through the captured descriptor that holds it.

The runner picks the descriptor, fills the static inputs and hands back the outputs;
replay itself is whatever the engine's step program holds (graph replays and bound
eager breaks, in order). It never asks which backend made them (SGLang's runner and
backend split), so the same runner drives CUDA graphs and the CPU backend's eager
regions.

* A batch of ``b`` rows runs on the smallest captured size ``>= b``: FULL when that
  size was captured FULL, else PIECEWISE. Inputs are copied into the leading ``b`` rows
  of the static input buffers and the padded rows are zeroed, so a padded step is
  deterministic.
* A batch larger than every descriptor runs eagerly (on the static buffers where they
  are large enough, on fresh tensors otherwise) and is counted in ``fallbacks`` under
  its ``FallbackReason``.

Output aliasing: the tensors ``run`` returns are views of static buffers, valid until
the next ``run``, which overwrites them. Clone what you keep.

Everything the hot path needs is precomputed at construction (the commit): per batch
size, one ``_Program`` with the input views, the pad views, the step's callables and
the output views. ``run`` is a list index and three tight loops: no dict lookups by
string, no validation, no events.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable

import attrs
import torch

from graphflow.engine import Engine
from graphflow.plan import BufferRole, Descriptor, Mode, dim_symbols

__all__ = ["FallbackReason", "Runner"]


class FallbackReason(enum.Enum):
    BATCH_TOO_LARGE = "batch larger than every captured descriptor"
    NOTHING_CAPTURED = "the engine committed no descriptor"
    NOT_CAPTURED_YET = "no descriptor that holds the batch is captured yet (lazy capture under way)"


@attrs.frozen
class _Program:
    descriptor: Descriptor
    inputs: tuple[torch.Tensor, ...]  # static input views at the batch size, in Runner.inputs order
    pads: tuple[torch.Tensor, ...]  # the rows between the batch size and the descriptor's, zeroed
    calls: tuple[Callable[[], object], ...]
    outputs: tuple[torch.Tensor, ...]  # static output views at the batch size


class Runner:
    """Runs batches on a committed ``Engine``; see the module docstring."""

    def __init__(self, engine: Engine):
        plan = engine.plan
        self.engine = engine
        self.inputs = tuple(b.name for b in plan.buffers if b.role is BufferRole.INPUT)
        self.outputs = tuple(b.name for b in plan.buffers if b.role is BufferRole.OUTPUT)
        symbol = plan.capture.size_symbol
        self._dims = {name: _batch_dim(plan.buffer(name).shape, symbol, name) for name in (*self.inputs, *self.outputs)}
        batched = [n for n in self.inputs if self._dims[n] is not None]
        if not batched:
            raise ValueError(f"no input buffer has a plain {symbol!r} dimension, so the runner cannot tell a "
                             f"batch's size — give one input a dimension equal to {symbol!r}")
        self._size_of = self.inputs.index(batched[0]), self._dims[batched[0]]
        self.fallbacks: collections.Counter[FallbackReason] = collections.Counter()
        self._build()

    def _build(self) -> None:
        """The program of every batch size, from the engine's captured descriptors."""
        engine = self.engine
        best: dict[int, Descriptor] = {}
        for descriptor in engine.programs:
            if descriptor.size not in best or descriptor.mode is Mode.FULL:
                best[descriptor.size] = descriptor
        sizes = sorted(best)
        self._programs: list[_Program | None] = [None] * (sizes[-1] + 1 if sizes else 1)
        for batch in range(1, len(self._programs)):
            size = next(s for s in sizes if s >= batch)
            self._programs[batch] = self._program(best[size], batch)
        self._version = engine.version

    @property
    def max_size(self) -> int:
        return len(self._programs) - 1

    def descriptor_for(self, batch: int) -> Descriptor | None:
        """The descriptor a batch of this size replays, or None when it falls back to eager."""
        return self._programs[batch].descriptor if 0 < batch < len(self._programs) else None

    @torch.no_grad()
    def run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One step. Inputs in ``self.inputs`` order; outputs in ``self.outputs`` order.

        The outputs are views of static buffers, valid until the next ``run``. Runs
        without autograd, like the pipeline that captured it.
        """
        if self.engine.lock is not None:
            return self._run_live(inputs)
        return self._step(inputs)

    def _step(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        position, dim = self._size_of
        batch = inputs[position].shape[dim]
        if batch >= len(self._programs):
            return self._fallback(inputs, batch)
        program = self._programs[batch]
        if program is None:
            raise ValueError("a batch needs at least one row")
        for static, value in zip(program.inputs, inputs):
            static.copy_(value)
        for pad in program.pads:
            pad.zero_()
        for call in program.calls:
            call()
        return program.outputs

    def _run_live(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """A lazy engine's step: under its lock (the capture thread runs the model too),
        with the programs switched in since the last step, asking for this batch's."""
        engine = self.engine
        position, dim = self._size_of
        engine.background.asked(inputs[position].shape[dim])
        with engine.lock:
            if engine.version != self._version:
                self._build()
            return self._step(inputs)

    def _program(self, descriptor: Descriptor, batch: int) -> _Program:
        views = self.engine.buffers.views(descriptor.size)
        pad = descriptor.size - batch
        inputs, pads = [], []
        for name in self.inputs:
            dim = self._dims[name]
            view = views[name]
            if dim is None:
                inputs.append(view)
                continue
            inputs.append(view.narrow(dim, 0, batch))
            if pad:
                pads.append(view.narrow(dim, batch, pad))
        outputs = tuple(views[n] if self._dims[n] is None else views[n].narrow(self._dims[n], 0, batch)
                        for n in self.outputs)
        return _Program(descriptor, tuple(inputs), tuple(pads), self.engine.programs[descriptor], outputs)

    def _fallback(self, inputs: tuple[torch.Tensor, ...], batch: int) -> tuple[torch.Tensor, ...]:
        """An eager step for a batch no descriptor holds (slow path, counted)."""
        if self.engine.background is not None and not self.engine.background.done:
            reason = FallbackReason.NOT_CAPTURED_YET
        else:
            reason = FallbackReason.NOTHING_CAPTURED if self.max_size == 0 else FallbackReason.BATCH_TOO_LARGE
        self.fallbacks[reason] += 1
        buffers = self.engine.buffers
        views: dict[str, torch.Tensor] = {}
        for name in buffers:
            if not buffers.uses_size(name) or buffers.capacity(name) >= batch:
                views[name] = buffers.view(name, batch)
            elif self.engine.plan.buffer(name).role is BufferRole.STATE:
                raise ValueError(f"batch of {batch} exceeds state buffer {name!r}, allocated for "
                                 f"{buffers.capacity(name)} — raise its capacity or split the batch")
            else:
                views[name] = buffers.fresh(name, batch)
        for name, value in zip(self.inputs, inputs):
            views[name].copy_(value)
        for call in self.engine.eager_calls(batch, views):
            call()
        return tuple(views[n] for n in self.outputs)


def _batch_dim(shape, symbol: str, name: str) -> int | None:
    uses = [i for i, dim in enumerate(shape) if symbol in dim_symbols(dim)]
    if not uses:
        return None
    plain = [i for i in uses if isinstance(shape[i], str) and shape[i].strip() == symbol]
    if len(uses) != 1 or not plain:
        raise ValueError(f"buffer {name!r} has shape {list(shape)}: the runner pads inputs and slices outputs "
                         f"along one dimension equal to {symbol!r}, and this buffer has {len(uses)} using it")
    return plain[0]
