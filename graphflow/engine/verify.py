"""The verify phase: graph replay against the eager step, on the same inputs and state.

Per descriptor: keep the state buffers; fill the inputs randomly (floats standard
normal, ints uniformly from ``Buffer.values``); snapshot every buffer the step reads;
run the eager step; restore the snapshot; run the captured step program; compare every
buffer the step writes, bit for bit unless the plan declares tolerances; put the state
back. Buffers are compared in the order of their last write, so a mismatch names the
first buffer to differ and the segment that last wrote it.
"""

from __future__ import annotations

import attrs
import torch

from graphflow.engine.allocate import Allocation, step_items
from graphflow.engine.capture import Captured
from graphflow.engine.context import Context
from graphflow.engine.execute import call_segment, run_eager
from graphflow.engine.reference import check_reference, explain
from graphflow.engine.warmup import DescriptorTime, eager_step
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.plan import BufferRole, Descriptor, Plan, Segment

__all__ = ["VerifyResult", "verify"]

#: What to do when replay differs from eager (``graphflow.engine.reference.explain`` says more).
HINT = ("replay differs from eager: look for state outside the plan's buffers, data-dependent control flow or an "
        "undeclared buffer in the region; declare the state or the buffer, or mark such work eager")


@attrs.frozen
class VerifyResult:
    """Graph replay against the eager step on the same random inputs, for one descriptor."""

    descriptor: Descriptor
    buffers: tuple[str, ...]
    max_abs_diff: float
    bit_exact: bool
    #: What the replay was compared with: the plan's eager step, and the reference when the plan names one.
    against: tuple[str, ...] = ("the eager step",)


def verify(ctx: Context, alloc: Allocation, captured: Captured) -> tuple[tuple[VerifyResult, ...],
                                                                           tuple[DescriptorTime, ...]]:
    plan = ctx.plan
    last_writer = {w: s.name for s in ctx.segments for w in s.writes}
    position = {s.name: i for i, s in enumerate(ctx.segments)}
    written = tuple(sorted(last_writer, key=lambda b: position[last_writer[b]]))  # in order of final write
    read = tuple(dict.fromkeys(r for s in ctx.segments for r in s.reads))
    state = tuple(b.name for b in plan.buffers if b.role is BufferRole.STATE)
    schedule = alloc.schedules[tuple(s.name for s in ctx.segments)]
    results, times = [], []
    for index, descriptor in enumerate(ctx.descriptors, 1):
        with ctx.descriptor(descriptor, index) as block:
            views = alloc.buffers.views(descriptor.size)
            kept = {n: views[n].clone() for n in state}
            _fill_inputs(plan, views, descriptor.size, ctx.options.seed)
            start = {n: views[n].clone() for n in dict.fromkeys((*read, *state))}
            run_eager(ctx.backend, schedule, eager_step(ctx, alloc, descriptor.size),
                      lambda segment, call: call_segment(ctx, segment, call))
            alloc.synchronize(ctx)
            expected = {n: views[n].clone() for n in written}
            _restore(views, start)
            # The program holds bare callables; the step's items, listed again, say which
            # are eager breaks (a graph replay runs no Python to bracket).
            for item, call in zip(step_items(ctx, descriptor.mode), captured.programs[descriptor], strict=True):
                if isinstance(item, Segment):
                    call_segment(ctx, item, call)
                else:
                    call()
            alloc.synchronize(ctx)
            try:
                result = _compare(plan, descriptor, views, expected, last_writer)
            except CaptureError as error:  # name the first segment that differs, and state outside the plan
                raise explain(ctx, alloc, captured.programs, descriptor, start, expected, error)
            against = check_reference(ctx, alloc, descriptor, start)  # the model's own step, when named
            results.append(result if against is None else attrs.evolve(result, against=(against, *result.against)))
            _restore(views, kept)
            block.pool_bytes = captured.pool_bytes
        times.append(DescriptorTime(Phase.VERIFY, descriptor, block.seconds))
    return tuple(results), tuple(times)


def _fill_inputs(plan: Plan, views: dict[str, torch.Tensor], size: int, seed: int) -> None:
    for buffer in plan.buffers:
        if buffer.role is not BufferRole.INPUT:
            continue
        view = views[buffer.name]
        generator = torch.Generator(device=view.device).manual_seed(seed * 1_000_003 + size)
        if buffer.values is not None:
            low, high = buffer.values
            if _is_float(buffer.dtype):
                fresh = torch.rand(view.shape, generator=generator, device=view.device) * (high - low) + low
            else:
                fresh = torch.randint(int(low), int(high), view.shape, generator=generator, device=view.device)
        else:
            fresh = torch.randn(view.shape, generator=generator, device=view.device)
        view.copy_(fresh.to(view.dtype))


def _compare(plan: Plan, descriptor: Descriptor, views: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
             last_writer: dict[str, str]) -> VerifyResult:
    """Compare in order of each buffer's final write, so the first mismatch is the earliest seen."""
    atol, rtol = plan.capture.atol, plan.capture.rtol
    worst = 0.0
    bit_exact = True
    for name, want in expected.items():
        got = views[name]
        same = _equal(got, want)
        bit_exact = bit_exact and same
        diff = _max_abs_diff(got, want)
        worst = max(worst, diff)
        ok = same if atol == 0 and rtol == 0 else bool(
            torch.isclose(_comparable(got), _comparable(want), rtol=rtol, atol=atol, equal_nan=True).all())
        if not ok:
            bad = int((_comparable(got) != _comparable(want)).sum())
            raise CaptureError(
                f"graph replay of {descriptor} differs from eager in buffer {name!r} (last written by "
                f"{last_writer[name]}; it or an earlier segment diverged): {bad} of {got.numel()} "
                f"elements, max |diff| {diff:.3g} (allowed atol={atol}, rtol={rtol})",
                segment=last_writer[name], hint=HINT)
    return VerifyResult(descriptor, tuple(expected), worst, bit_exact)


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def _comparable(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, treating NaN as equal to NaN."""
    if a.is_floating_point():
        a, b = _comparable(a), _comparable(b)
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool:
        return float((a != b).any())
    return float((_comparable(a).double() - _comparable(b).double()).abs().nan_to_num(0.0).max())


def _restore(views: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        views[name].copy_(value)
