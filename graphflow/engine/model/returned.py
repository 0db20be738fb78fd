"""Outputs kept where the graph put them: a segment's returned tensor as its buffer.

A segment that returns its result (``returns``) has it copied into its buffer. Inside a
graph that copy is one more kernel per step, and the only one a hand-written graph of
the same step lacks: it keeps the tensor the capture returned. So for an output that
nothing else in the step reads, capture keeps that tensor instead, and the runner's
outputs and verify read it where the graph writes it (``StaticBuffers.views_of``).
Warmup, the eager reference and every eager step still copy into the buffer.

Once a descriptor's graphs are captured, its tensor is held as an alias that does not
own its memory, as vLLM holds its graphs' outputs, so that a later capture may reuse
that memory: one output per descriptor kept alive would grow the pool by the sum of
them (logits at 67 batch sizes: gigabytes). The later graph's replay then overwrites it,
which the contract allows: outputs are valid until the next step, as a static buffer's
are, and one graph replays at a time. The pool keeps every block a graph writes until
the graph is destroyed, so the alias never points at freed memory while the engine
lives.

Not in lazy capture: there the thread's verify replays a graph while the outputs of the
last step served must stay as they are.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from graphflow.plan import BufferRole, Plan, Segment

__all__ = ["Placed", "placeable", "unowned"]


def placeable(plan: Plan, segments: Iterable[Segment]) -> frozenset[str]:
    """The buffers whose returned tensor capture may keep: outputs a graph segment
    returns, that no segment reads or also writes, that alias nothing and that nothing
    aliases."""
    segments = tuple(segments)
    read = {name for s in segments for name in s.reads}
    writers = Counter(name for s in segments for name in s.writes)
    aliased = {b.alias_of for b in plan.buffers if b.alias_of is not None}
    return frozenset(
        name for s in segments if s.is_graph for name in s.returns
        if plan.buffer(name).role is BufferRole.OUTPUT and plan.buffer(name).alias_of is None
        and name not in aliased and name not in read and writers[name] == 1)


class Placed:
    """One descriptor's capture: the tensors its segments returned for ``names``, kept
    (as ``execute.Placer``) instead of copied. A tensor of another dtype or device than
    its buffer is copied as before: the copy is what converts it."""

    def __init__(self, names: frozenset[str], views: dict[str, torch.Tensor], detectors=None):
        self.names, self._views, self._detectors = names, views, detectors
        self.tensors: dict[str, torch.Tensor] = {}

    def __call__(self, buffer: str, value: torch.Tensor) -> bool:
        view = self._views[buffer]
        if buffer not in self.names or value.dtype != view.dtype or value.device != view.device:
            return False
        self.tensors[buffer] = value
        if self._detectors is not None:  # kept on purpose: not an intermediate that escapes
            self._detectors.add_known([value])
        return True

    def unowned(self) -> dict[str, torch.Tensor]:
        """The kept tensors as aliases that do not own their memory; the tensors dropped."""
        aliases = {name: unowned(t) for name, t in self.tensors.items()}
        self.tensors.clear()
        return aliases


def unowned(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over ``tensor``'s memory that keeps none of it alive."""
    storage = tensor.untyped_storage()
    alias = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        alias, tensor.storage_offset(), tensor.shape, tensor.stride())
