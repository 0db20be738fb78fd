"""What a run will need in memory, checked against what the device has, before it is taken.

Two parts are known before anything is allocated: the static buffers (exactly: the plan
says their shapes, ``Plan.static_memory``) and verify's working copies (the buffers the
largest descriptor reads, keeps as state and writes, cloned once each). They are checked
against each device's free memory right before the buffers are allocated, so a plan
that cannot fit fails with the shortfall and the largest buffers named, not with the
allocator's message in the middle of warmup (or, on a host, the process killed).

The third part, the capture pool, is known only by capturing: after the two largest
descriptors of a mode, the pool's growth on the second (each smaller descriptor reuses
the shared pool at least as well) times the descriptors left gives an estimate, checked
against free memory before the rest are captured (vLLM's ``profile_cudagraph_memory``
extrapolates the same way, from a separate profiling run).
"""

from __future__ import annotations

import math

import attrs

from graphflow.errors import CaptureError
from graphflow.plan import DTYPE_BYTES, Plan, eval_dim
from graphflow.render import format_bytes, heaviest

__all__ = ["MemoryNeed", "check_fits", "memory_need", "pool_estimate"]

@attrs.frozen
class MemoryNeed:
    """Bytes a run allocates on one device before capture: buffers and verify's copies."""

    device: str
    buffers: dict[str, int]  # buffer -> bytes
    verify: int

    @property
    def total(self) -> int:
        return sum(self.buffers.values()) + self.verify


def memory_need(plan: Plan, largest: int, copied: tuple[str, ...] = ()) -> dict[str, MemoryNeed]:
    """Per plan device: the static buffers allocated for descriptors up to ``largest``,
    and ``copied`` (buffer names verify copies, once each) at that size."""
    need: dict[str, MemoryNeed] = {}
    for device, buffers in plan.static_memory(largest).items():
        need[device] = MemoryNeed(device, dict(buffers), 0)
    for name in copied:
        buffer = plan.buffer(name)
        # A copy is of the view at the largest size: the size symbol there, not at a capacity.
        values = {**plan.allocation_values(buffer, largest), plan.capture.size_symbol: largest}
        size = math.prod(eval_dim(d, values) for d in buffer.shape) * DTYPE_BYTES[buffer.dtype]
        entry = need.setdefault(buffer.device, MemoryNeed(buffer.device, {}, 0))
        need[buffer.device] = attrs.evolve(entry, verify=entry.verify + size)
    return need


def check_fits(need: MemoryNeed, free: int | None, where: str) -> None:
    """Raise a CaptureError naming the shortfall and the largest buffers when ``need``
    exceeds ``free`` (``where``: the device as the user sees it)."""
    if free is None or need.total <= free:
        return
    copies = f" + {format_bytes(need.verify)} for verify's copies" if need.verify else ""
    raise CaptureError(
        f"the plan needs {format_bytes(need.total)} on {where} ({format_bytes(sum(need.buffers.values()))} of static "
        f"buffers{copies}) but {format_bytes(free)} is free: {format_bytes(need.total - free)} short. The largest "
        f"buffers: {heaviest(need.buffers)}",
        hint="capture fewer or smaller sizes (--sizes), lower a capacity, run with --no-verify to skip the "
             "copies, or use a device with more memory")


def pool_estimate(pool_after: int, growth: int, left: int) -> int:
    """The pool once every descriptor of a mode is captured: what it holds after the two
    largest, plus the second one's growth for each descriptor left."""
    return pool_after + max(0, growth) * max(0, left)

