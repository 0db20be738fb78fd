"""Adopted buffers: state the model holds, made plan buffers (``Buffer.adopt``).

A KV cache inside a library object (a ``transformers`` ``StaticCache``, a paged pool) is
state the step reads and writes. Left outside the plan it is counted nowhere, never
snapshotted by verify and ordered by nothing; worse, a graph replays whatever address it
held at capture. Adopting it makes the model's tensor and the plan's buffer one tensor:

1. ``adopt`` (allocate, once the model exists): each ``adopt`` path is resolved to the
   slot that holds the tensor (``cache.layers.0`` and its ``keys``). A tensor already
   there with the buffer's allocated shape, dtype and device becomes the buffer's
   storage; an empty slot (``None``, or no attribute yet: a lazily allocated cache)
   gets the buffer the engine allocates; anything else is an error naming the buffer,
   the path and both shapes. The slot's old value comes back on rollback and close.
2. Each call of a segment that reads or writes an adopted buffer first points its slot
   at the view of the size being run (``graphflow.engine.execute.SegmentCall``): the
   model's own code then sees a tensor of that batch size, as the plan's segments do,
   and a graph captured at that size bakes in that view's address.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from graphflow.engine.context import Context
from graphflow.engine.execute import Slot
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.plan import Buffer

__all__ = ["Adopted", "adopt", "attach", "slot"]

_MISSING = object()


@attrs.frozen(eq=False)
class Adopted:
    """One adopted buffer: where the model holds it, and the tensor found there (or None)."""

    buffer: str
    path: str
    slot: Slot
    existing: torch.Tensor | None


def slot(model: object, path: str) -> Slot:
    """The slot ``path`` names on the model: its parent object and the last part
    (digits index a list or ModuleList)."""
    parent, _, last = path.rpartition(".")
    owner = model
    walked: list[str] = []
    for part in parent.split(".") if parent else ():
        try:
            owner = owner[int(part)] if part.isdigit() and hasattr(owner, "__getitem__") else getattr(owner, part)
        except (AttributeError, IndexError, KeyError, TypeError) as exc:
            at = ".".join(walked) or "the model"
            raise ValueError(f"{at} ({type(owner).__name__}) has no {'item' if part.isdigit() else 'attribute'} "
                             f"{part!r}") from exc
        walked.append(part)
    return Slot(owner, int(last) if last.isdigit() else last)


def adopt(ctx: Context, model: object, largest: int, device_of) -> dict[str, Adopted]:
    """Resolve every ``adopt`` path and check what is there; register putting it back.

    ``device_of`` maps a plan device name to the backend's device.
    """
    plan = ctx.plan
    adopted: dict[str, Adopted] = {}
    for buffer in plan.buffers:
        if buffer.adopt is None:
            continue
        try:
            where = slot(model, buffer.adopt)
            value = where.get(_MISSING)
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            raise _error(buffer, f"cannot reach it: {exc}",
                         "fix the path, or create the object before graphflow builds the plan's buffers") from exc
        existing = None
        if isinstance(value, torch.Tensor):
            existing = _checked(buffer, value, plan.allocated_shape(buffer, largest), device_of(buffer.device))
        elif value is not None and value is not _MISSING:
            raise _error(buffer, f"holds a {type(value).__name__}, not a tensor",
                         "adopt the tensor inside it, or leave the slot empty (None) for graphflow to fill")
        adopted[buffer.name] = Adopted(buffer.name, buffer.adopt, where, existing)
        ctx.stack.push(f"give {buffer.adopt} back its own value", _restore(where, value))
    return adopted


def attach(adopted: Mapping[str, Adopted], tensors: Mapping[str, torch.Tensor]) -> None:
    """Put the buffers graphflow allocated into the slots that had no tensor."""
    for item in adopted.values():
        if item.existing is None:
            item.slot.set(tensors[item.buffer])


def _checked(buffer: Buffer, tensor: torch.Tensor, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    wanted = f"{list(shape)} {buffer.dtype} on {device}"
    found = f"{list(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} on {tensor.device}"
    if tuple(tensor.shape) != shape or str(tensor.dtype).removeprefix("torch.") != buffer.dtype or \
            tensor.device != device:
        raise _error(buffer, f"holds a tensor of {found}, but the plan allocates the buffer as {wanted}",
                     "declare the buffer with the tensor's shape, dtype and device (the size symbol at the largest "
                     "descriptor), or leave the slot empty (None) for graphflow to allocate")
    return tensor


def _error(buffer: Buffer, problem: str, hint: str) -> CaptureError:
    return CaptureError(f"buffer {buffer.name!r} adopts {buffer.adopt}, which {problem}",
                        phase=Phase.ALLOCATE.value, hint=hint)


def _restore(where: Slot, value: object):
    def restore() -> None:
        if value is _MISSING and isinstance(where.key, str):
            if where.key in getattr(where.owner, "__dict__", {}):
                delattr(where.owner, where.key)
        else:
            where.set(value)

    return restore
