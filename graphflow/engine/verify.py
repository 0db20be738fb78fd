"""The verify phase: graph replay against the eager step, on the same inputs and state.

The eager reference is the descriptor's warmup (``graphflow.engine.warmup.Warmed``): it
ran on verify's random inputs and kept the buffers it started from and the buffers it
wrote. Verify keeps the state buffers as it finds them, puts the start back, runs the
captured step program, compares every buffer the step writes and leaves behind (outputs,
state, written inputs; internal buffers are scratch, written before they are read) —
bit for bit unless the plan declares tolerances — and puts the state back. Two
exceptions, where warmup's outputs are not the reference, so verify runs the eager step
itself first, from the same inputs: when a channel the step uses does not communicate in warmup (``prepare``,
``placeholder``), and when the plan compiles segments (``torch.compile``: warmup ran the
compiled callables, which is what compiled them; the reference runs the model's
uncompiled ones, so verify compares the compiled capture with the model's own code,
within the plan's tolerance). Buffers are compared in the order of their last write,
so a mismatch names the first of them to differ and the segment that last wrote it;
then the step is replayed item by item from the eager values to name the first segment
whose writes differ, internal buffers included.
"""

from __future__ import annotations

import attrs
import torch

from graphflow.engine.allocate import Allocation, step_items
from graphflow.engine.capture import Captured
from graphflow.engine.context import Context
from graphflow.engine.execute import call_segment, run_eager
from graphflow.engine.model.reference import check_reference, explain
from graphflow.engine.warmup import DescriptorTime, Warmed, eager_step, fill_inputs
from graphflow.errors import CaptureError, OptionFix
from graphflow.events import Phase
from graphflow.plan import Descriptor, Plan, Segment

__all__ = ["VerifyResult", "compare", "verify"]

#: What to do when replay differs from eager (``graphflow.engine.model.reference.explain`` says more).
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


def verify(ctx: Context, alloc: Allocation, captured: Captured, descriptor: Descriptor, index: int,
           warmed: Warmed) -> tuple[VerifyResult, DescriptorTime]:
    """Replay one descriptor from its warmup's start and compare with what warmup wrote."""
    plan, needs = ctx.plan, ctx.verify_plan
    with ctx.descriptor(descriptor, index) as block:
        captured.settle()
        program = captured.programs[descriptor]
        views = alloc.buffers.views_of(descriptor)  # the outputs where the replay writes them
        kept = _kept_state(ctx, views, warmed)
        if not needs.reuses_warmup:
            warmed = _reference(ctx, alloc, descriptor, warmed)
        _restore(views, warmed.start)
        # The program holds bare callables; the step's items, listed again, say which
        # are eager breaks (a graph replay runs no Python to bracket).
        for item, call in zip(step_items(ctx, descriptor.mode), program, strict=True):
            if isinstance(item, Segment):
                call_segment(ctx, item, call)
            else:
                call()
        alloc.synchronize(ctx)
        try:
            result = compare(plan, descriptor, views, warmed.expected, needs.last_writer,
                             compiled=needs.compiled)
        except CaptureError as error:  # name the first segment that differs, and state outside the plan
            if needs.compiled:  # compiled against uncompiled code: the tolerance is what the hint is about
                raise
            raise explain(ctx, alloc, {descriptor: program}, descriptor, warmed.start, warmed.expected, error)
        against = check_reference(ctx, alloc, descriptor, warmed.start)  # the model's own step, when named
        if against is not None:
            result = attrs.evolve(result, against=(against, *result.against))
        _restore(views, _still_to_restore(kept, warmed.expected, result, against is not None))
    return result, DescriptorTime(Phase.VERIFY, descriptor, block.seconds)


def _kept_state(ctx: Context, views: dict[str, torch.Tensor], warmed: Warmed) -> dict[str, torch.Tensor]:
    """The state to put back after the replay: the state as verify finds it.

    A real capture runs nothing, so that is the state warmup left, which warmup's
    expected copies already hold; a backend whose capture runs the region (the CPU's)
    has moved it on, so it is copied here.
    """
    state = ctx.verify_plan.state
    if ctx.backend.captures_graphs and ctx.verify_plan.reuses_warmup:
        return {n: warmed.expected[n] if n in warmed.expected else views[n].clone() for n in state}
    return {n: views[n].clone() for n in state}


def _still_to_restore(kept: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], result: VerifyResult,
                      referenced: bool) -> dict[str, torch.Tensor]:
    """The kept state the replay did not leave as it was. Where what was kept is warmup's
    expected copy (a real capture: see ``_kept_state``), a bit-exact replay of that
    buffer left exactly it, and copying it back would be one more pass over the state.
    After a reference step (it ran since) everything goes back."""
    if referenced or not result.bit_exact:
        return kept
    return {n: t for n, t in kept.items() if not (n in result.buffers and t is expected.get(n))}


def _reference(ctx: Context, alloc: Allocation, descriptor: Descriptor, warmed: Warmed) -> Warmed:
    """The eager step run here, from warmup's inputs, with every collective communicating
    and every segment uncompiled."""
    views = alloc.buffers.views(descriptor.size)
    needs = ctx.verify_plan
    fill_inputs(ctx.plan, views, descriptor.size, ctx.options.seed, strict=True)
    start = {n: views[n].clone() for n in needs.start}
    run_eager(ctx.backend, alloc.schedules[tuple(s.name for s in ctx.segments)],
              eager_step(ctx, alloc, descriptor.size, alloc.uncompiled),
              lambda segment, call: call_segment(ctx, segment, call))
    alloc.synchronize(ctx)
    return attrs.evolve(warmed, start=start, expected={n: views[n].clone() for n in needs.written})


#: What to do when the replay of compiled segments differs from the uncompiled step.
COMPILED_HINT = ("the compiled segments' replay differs from the model's uncompiled code beyond the plan's tolerance: "
                 "if the difference is rounding (fusion reorders floating-point work), raise capture.verify atol/rtol; "
                 "else set compile: false on the segment named (compare with a run of {0})")


def compare(plan: Plan, descriptor: Descriptor, views: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
            last_writer: dict[str, str], *, compiled: bool = False, against: str | None = None) -> VerifyResult:
    """Compare in order of each buffer's final write, so the first mismatch is the earliest seen.

    Every buffer's verdict is worked out on the device and read back in one transfer: a
    bit-exact step (the usual case) costs one synchronisation however many buffers it
    writes. Differences are measured only for the buffers that differ. ``compiled``: the
    expected values come from the uncompiled step of a plan that compiles segments;
    ``against`` names what they come from otherwise.
    """
    atol, rtol = plan.capture.atol, plan.capture.rtol
    exact = atol == 0 and rtol == 0
    said = "the uncompiled eager step" if compiled else against or "eager"
    against = "the uncompiled eager step" if compiled else against or "the eager step"
    names = list(expected)
    if not names:
        return VerifyResult(descriptor, (), 0.0, True, (against,))
    same = _verdicts(names, lambda n: _equal(views[n], expected[n]))
    close = same if exact else _verdicts(names, lambda n: _close(views[n], expected[n], atol, rtol))
    diffs = {n: _max_abs_diff(views[n], expected[n]) for n, s in zip(names, same, strict=True) if not s}
    for name, ok in zip(names, close, strict=True):
        if not ok:
            got, want = _comparable(views[name]), _comparable(expected[name])
            bad = int((got != want).sum())
            raise CaptureError(
                f"graph replay of {descriptor} differs from {said} "
                f"in buffer {name!r} (last written by "
                f"{last_writer[name]}; it or an earlier segment diverged): {bad} of {got.numel()} "
                f"elements, max |diff| {diffs[name]:.3g} (allowed atol={atol}, rtol={rtol})",
                segment=last_writer[name], hint=COMPILED_HINT if compiled else HINT,
                settings=(OptionFix("compile", False),) if compiled else ())
    return VerifyResult(descriptor, tuple(names), max(diffs.values(), default=0.0), all(same), (against,))


def _verdicts(names: list[str], check) -> list[bool]:
    """One boolean per buffer, computed where the buffers live and read back at once."""
    flags = [check(n) for n in names]
    return torch.stack([f.to(flags[0].device) for f in flags]).tolist()


def _comparable(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


#: The integer type of each width, to compare floating-point buffers by their bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bit-for-bit equality, as a 0-d tensor on the device.

    Floating-point buffers are compared as integers of their width: a NaN equals the
    same NaN, -0.0 differs from 0.0, and the comparison is one pass over both buffers
    (a state buffer can be gigabytes, and verify compares every one per descriptor).
    """
    bits = _BITS.get(a.element_size()) if a.is_floating_point() else None
    if bits is not None and a.dtype == b.dtype:
        a, b = a.view(bits), b.view(bits)
    return torch.eq(a, b).all()


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> torch.Tensor:
    a, b = _comparable(a), _comparable(b)
    if not a.is_floating_point():
        return (a == b).all()
    return torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True).all()


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if a.dtype == torch.bool:
        return float((a != b).any())
    return float((_comparable(a).double() - _comparable(b).double()).abs().nan_to_num(0.0).max())


def _restore(views: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        views[name].copy_(value)
