"""Declared outputs are really written: checked once, in warmup, segment by segment.

A segment that computes its result and returns it, or rebinds its argument
(``logits = self.head(x)``), leaves its output buffer as it was. Run eagerly and replayed
it does so alike, so a replay-against-eager verify passes while the runner hands back
zeros. ``checking`` wraps warmup's segment runner for one step (the first descriptor's
first iteration): around each call it marks every buffer the segment declares it writes,
and afterwards requires each to have changed.

A buffer the segment only writes is first filled with a sentinel (NaN, or the integer
type's lowest value); it counts as written when its version counter moved (any in-place
torch op, an ``out=`` argument, ``copy_``, ``index_copy_``...) or the sentinel was
overwritten (a kernel launched outside torch's dispatcher, Triton or CuTe DSL, moves no
counter). Sentinel left in a partly written buffer is reset to zero, so later segments
read no NaN. A buffer it also reads (an in-place update) may legitimately keep its
values, and a collective moves no counter, so it is flagged only when its counter did
not move and the segment returned tensors: the update went into a new tensor. State
buffers are not checked: a cache may be written only on some steps (a compressed cache
every k tokens).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from graphflow.engine.allocate import Allocation
from graphflow.engine.backend import Call
from graphflow.engine.context import Context
from graphflow.engine.execute import SegmentRunner
from graphflow.errors import CaptureError
from graphflow.plan import BufferRole, Segment

__all__ = ["checking"]


def checking(ctx: Context, alloc: Allocation, size: int, run: SegmentRunner) -> SegmentRunner:
    """``run``, plus the check that each segment writes every buffer it declares (see the
    module docstring), at batch ``size``."""
    views = alloc.buffers.views(size)

    def checked(segment: Segment, call: Call) -> None:
        marks = {name: _mark(segment, name, views[name]) for name in dict.fromkeys(segment.writes)
                 if ctx.plan.buffer(name).role is not BufferRole.STATE}
        returned: list[object] = []
        run(segment, lambda: returned.append(call()))
        alloc.synchronize(ctx)
        result = returned[0] if returned else None
        unwritten = [name for name, mark in marks.items() if not mark.written(views[name], result)]
        if unwritten:
            raise _unwritten(segment, unwritten, result)

    return checked


class _Mark:
    """How one buffer is watched over one call: its version, and the sentinel it was filled with."""

    __slots__ = ("version", "sentinel")

    def __init__(self, version: int, sentinel: object | None):
        self.version, self.sentinel = version, sentinel

    def written(self, tensor: torch.Tensor, result: object) -> bool:
        moved = tensor._version != self.version
        if self.sentinel is None:  # read too: unchanged is fine, unless the update was returned instead
            return moved or _describe(result) is None
        left = tensor.isnan() if self.sentinel != self.sentinel else tensor == self.sentinel
        if bool(left.any()):
            tensor.masked_fill_(left, 0)
        return moved or not bool(left.all())


def _mark(segment: Segment, name: str, tensor: torch.Tensor) -> _Mark:
    sentinel = _sentinel(tensor.dtype)
    if name in segment.reads or sentinel is None or tensor.numel() == 0:
        return _Mark(tensor._version, None)
    tensor.fill_(sentinel)
    return _Mark(tensor._version, sentinel)


def _sentinel(dtype: torch.dtype) -> object | None:
    if dtype.is_floating_point and dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return float("nan")
    if dtype != torch.bool and not dtype.is_complex:
        return torch.iinfo(dtype).min
    return None


def _unwritten(segment: Segment, names: list[str], result: object) -> CaptureError:
    quoted = ", ".join(repr(n) for n in names)
    message = (f"segment {segment.name} declares it writes {quoted} but left "
               f"{'it' if len(names) == 1 else 'them'} unwritten")
    returned = _describe(result)
    if returned is not None and not segment.returns:
        message += f"; it returned {returned} instead"
        hint = (f"declare returns: [{', '.join(names)}] to have graphflow copy what it returns into "
                f"{'the buffer' if len(names) == 1 else 'the buffers'}, or write into the buffer it is given "
                "(out=..., .copy_(), an in-place op)")
    else:
        hint = ("write into the buffer the engine passes (out=..., .copy_(), an in-place op), not a new tensor "
                "bound to the argument's name; if the segment does not write it, drop it from writes")
    return CaptureError(message, segment=segment.name, hint=hint)


def _describe(result: object) -> str | None:
    """What a call returned, in words, when it holds tensors."""
    if isinstance(result, torch.Tensor):
        return f"a tensor of shape {list(result.shape)}"
    if isinstance(result, Mapping):
        keys = [k for k, v in result.items() if isinstance(v, torch.Tensor)]
        return f"a {type(result).__name__} with {', '.join(map(str, keys))}" if keys else None
    if isinstance(result, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in result):
        return f"a {type(result).__name__} of {len(result)} values"
    return None
