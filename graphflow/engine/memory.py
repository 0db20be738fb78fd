"""What a run will need in memory, checked against what the device has, before it is taken.

Two parts are known from the plan alone: the static buffers (exactly: the plan says
their shapes, ``Plan.static_memory``) and verify's working copies (the buffers the
largest descriptor reads, keeps as state and writes, cloned once each). They are
checked against each device's free memory twice, by one function (``check_memory``):

- first (``check_plan_memory``), before the model is built: building a large model
  takes minutes, and a plan that cannot fit must say so at once, with the shortfall and
  the largest buffers named, not after the build;
- again right before the buffers are allocated, once the model is built: its weights
  have taken memory since, and a buffer it adopts may already exist (counted then as
  taken, not as needed). Either way the run fails in allocate, not with the allocator's
  message in the middle of warmup (or, on a host, the process killed).

The third part, the capture pool, is known only by capturing: after the two largest
descriptors of a mode, the pool's growth on the second (each smaller descriptor reuses
the shared pool at least as well) times the descriptors left gives an estimate, checked
against free memory before the rest are captured (vLLM's ``profile_cudagraph_memory``
extrapolates the same way, from a separate profiling run).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

import attrs

from graphflow.engine.host import host_available
from graphflow.engine.snapshots import VerifyPlan
from graphflow.errors import CaptureError, OptionFix
from graphflow.plan import DTYPE_BYTES, Plan, eval_dim
from graphflow.units import format_bytes, heaviest

if TYPE_CHECKING:
    import torch

    from graphflow.engine.context import Context

__all__ = ["MemoryNeed", "check_fits", "check_memory", "check_plan_memory", "check_plan_on_the_host",
           "largest_size", "memory_need", "pool_estimate"]

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
        hint="capture smaller sizes ({0}): the buffers and verify's copies are allocated at the largest one; "
             "shrink the largest buffers (a lower capacity, a smaller cache); or use a device with more memory",
        settings=(OptionFix("sizes"),))


def check_plan_on_the_host(plan: Plan, *, sizes: Collection[int] | None = None, verify: bool = True) -> None:
    """The plan's static buffers and verify's copies against the host's free memory, for
    a run on the CPU backend (which maps every device to the host), before torch is even
    imported: ``graphflow run`` knows that backend without torch when it is asked for or
    no GPU driver is loaded, and importing torch alone takes 1.2-2.3 s on a 2-core
    machine. Everything here is the plan's; the pipeline checks again once it runs."""
    wanted = set(sizes) if sizes else None
    largest = max((d.size for d in plan.descriptors() if wanted is None or d.size in wanted),
                  default=max(plan.max_size, 1))
    copied = VerifyPlan.of(plan, tuple(s for s in plan.segments if s.runs_on(0))).copied(
        replays_graphs=False) if verify else ()
    needs = memory_need(plan, largest, copied).values()
    need = MemoryNeed("host", {b: n for need in needs for b, n in need.buffers.items()},
                      sum(need.verify for need in needs))
    try:
        check_fits(need, host_available(), "the host")
    except CaptureError as error:  # placed as the pipeline places its own refusal
        error.phase, error.rank = "allocate", 0
        raise


def largest_size(ctx: Context) -> int:
    """The size every buffer is allocated at: the largest descriptor the run captures."""
    return max((d.size for d in ctx.descriptors), default=max(ctx.plan.max_size, 1))


def check_memory(ctx: Context, devices: Mapping[str, torch.device], largest: int,
                 taken: Collection[str] = ()) -> None:
    """The static buffers and verify's copies against the free memory of each device the
    backend maps the plan's devices to (``devices``: plan name to device; two plan
    devices on one backend device share its memory); buffers in ``taken`` exist already."""
    copied = ctx.verify_plan.copied(replays_graphs=ctx.backend.captures_graphs) if ctx.options.verify else ()
    by_device: dict[torch.device, MemoryNeed] = {}
    for name, need in memory_need(ctx.plan, largest, copied).items():
        device = devices.get(name)
        if device is None:
            continue
        need = attrs.evolve(need, buffers={b: n for b, n in need.buffers.items() if b not in taken})
        known = by_device.get(device)
        by_device[device] = need if known is None else MemoryNeed(
            str(device), {**known.buffers, **need.buffers}, known.verify + need.verify)
    for device, need in by_device.items():
        check_fits(need, ctx.backend.free_memory(device), "the host" if device.type == "cpu" else str(device))


def check_plan_memory(ctx: Context, *, model_given: bool) -> None:
    """``check_memory`` from the plan alone, before anything is built: a plan too large
    for the device is refused in a second, not after minutes of building the model.

    A model the caller built may hold the buffers it adopts already, in memory no longer
    free: those are left to the check that runs once the model is bound.
    """
    names = dict.fromkeys(b.device for b in ctx.plan.buffers)
    devices = {name: ctx.backend.device(name) for name in names}
    adopted = {b.name for b in ctx.plan.buffers if b.adopt is not None} if model_given else ()
    check_memory(ctx, devices, largest_size(ctx), adopted)


def pool_estimate(pool_after: int, growth: int, left: int) -> int:
    """The pool once every descriptor of a mode is captured: what it holds after the two
    largest, plus the second one's growth for each descriptor left."""
    return pool_after + max(0, growth) * max(0, left)

