"""Verify against the model's own step, and say why a replay differs.

Comparing a replay with graphflow's eager run of the same plan passes a plan that is
wrong in the same way twice. Two functions close that gap for verify:

* ``check_reference``: when the plan names a ``reference`` (the model's own ``forward``),
  after the replay, the reference runs from the same inputs and state; the ``returns``
  buffers and the state the step writes must match it, bit for bit or within the plan's
  tolerances. A mismatch is a ``CaptureError`` that says the plan computes something
  other than the model, and names the model's tensors the step changed outside the
  plan's buffers.
* ``explain``: when replay differs from the plan's eager step, finds the first
  segment that differs by running the step one item at a time from the same start
  (each graph region and eager break replayed from the eager step's own values before
  it, each of its segments compared at its end), and names the model's tensors the
  eager step mutated that are no plan buffer: state the plan does not declare (a cache
  counter that moves on every call), which is the first thing to fix. Tolerance advice
  comes last, only when no such state moved and the differences are of the size of float
  rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from graphflow.engine.allocate import Allocation, step_items
from graphflow.engine.context import Context
from graphflow.engine.execute import bind, returned
from graphflow.errors import CaptureError
from graphflow.plan import BufferRole, Descriptor, Segment

__all__ = ["check_reference", "explain", "mutated"]

#: Differences at most this fraction of the values' magnitude are float rounding.
_NOISE = 1e-3


def check_reference(ctx: Context, alloc: Allocation, descriptor: Descriptor, start: Mapping[str, torch.Tensor]
                    ) -> str | None:
    """Compare what the replay left in the buffers with the reference run from ``start``
    (the inputs and state the replay started from); the reference's name, or None
    without one. Leaves the buffers as the reference left them."""
    reference = alloc.reference
    if reference is None:
        return None
    plan = ctx.plan
    views = alloc.buffers.views_of(descriptor)
    written = {w for s in ctx.segments for w in s.writes}
    state = [b.name for b in plan.buffers if b.role is BufferRole.STATE and b.name in written]
    names = [*dict.fromkeys(plan.reference.returns), *(n for n in state if n not in plan.reference.returns)]
    replayed = {n: views[n].clone() for n in names}
    _restore(views, start)
    result = reference.bind(views)()
    alloc.synchronize(ctx)
    expected = dict(zip(plan.reference.returns, returned(reference.name, result, plan.reference.returns)))
    expected.update({n: views[n] for n in state if n not in expected})
    for name in names:
        bad = _differs(plan, replayed[name], expected[name])
        if bad is None:
            continue
        count, diff, scale = bad
        _restore(views, start)
        changed = mutated(alloc, lambda: reference.bind(views)())
        message = (f"graph replay of {descriptor} differs from the reference {plan.reference.call} in "
                   f"{name!r}: {count} of {expected[name].numel()} elements, max |diff| {diff:.3g}; the plan's "
                   "own eager step gave what the replay gave, so the plan computes something other than the model")
        hints = []
        if changed:
            message += f"; the reference changed the model's {_listed(changed)}, which no plan buffer holds"
            hints.append(_declare_hint(changed))
        hints.append("check the plan's inputs and returns against the reference's, and that every segment writes "
                     "what the model computes")
        hints.extend(_tolerance_hint(plan, diff, scale, replayed[name]))
        raise CaptureError(message, hint="; ".join(hints))
    return f"the reference {plan.reference.call}"


def explain(ctx: Context, alloc: Allocation, programs: Mapping[Descriptor, tuple], descriptor: Descriptor,
            start: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
            error: CaptureError) -> CaptureError:
    """``error`` (replay differs from the eager step) with the first segment that
    differs, the undeclared state the step mutates, and tolerance advice only for float
    noise. Leaves the buffers unspecified (verify restores the state after). Should the
    diagnosis itself fail, ``error`` comes back as it was, with a note saying why."""
    try:
        return _explain(ctx, alloc, programs, descriptor, start, expected, error)
    except Exception as failure:  # noqa: BLE001 - the mismatch is the error to report; its diagnosis is extra
        error.add_note(f"graphflow could not find the first segment that differs: {type(failure).__name__}: "
                       f"{failure}")
        return error


def _explain(ctx: Context, alloc: Allocation, programs: Mapping[Descriptor, tuple], descriptor: Descriptor,
             start: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
             error: CaptureError) -> CaptureError:
    views = alloc.buffers.views_of(descriptor)
    diff, scale, like = _largest(ctx.plan, expected, views)  # the buffers hold the replay's results now
    first = _bisect(ctx, alloc, programs[descriptor], descriptor, views, start)
    _restore(views, start)
    changed = mutated(alloc, lambda: [bind(s, alloc.fns[s.name], views)() for s in ctx.segments])
    hints = []
    if changed:
        error.message += f"; the step changed the model's {_listed(changed)}, which no plan buffer holds"
        hints.append(_declare_hint(changed))
    if first is not None:
        segment, buffer, where = first
        error.segment = segment
        error.message += (f"; replayed from the eager step's own values, {where} first differs in segment "
                          f"{segment} ({buffer!r})")
        hints.append(f"look in {segment} for work whose result a graph does not replay (data-dependent control "
                     "flow, a value read on the host, state kept outside the buffers): make it eager or declare "
                     "the buffer")
    elif not changed:
        error.message += ("; each region replayed from the eager step's values matches it, so the difference is "
                          "carried between regions outside the plan's buffers")
        hints.append("declare as buffers the tensors the segments share outside the plan")
    if not changed:  # state outside the plan explains any difference, however small
        hints.extend(_tolerance_hint(ctx.plan, diff, scale, like))
    error.hint = "; ".join(hints)
    return error


def mutated(alloc: Allocation, run: Callable[[], object]) -> list[str]:
    """The model's tensors that are no plan buffer and whose contents ``run`` changed in
    place (their version counters moved), by attribute path."""
    owned = {t.untyped_storage().data_ptr() for t in alloc.buffers.tensors.values()}
    before = {path: (tensor, version) for path, tensor in _tensors(alloc.model)
              if tensor.untyped_storage().data_ptr() not in owned and (version := _version(tensor)) is not None}
    run()
    changed = [path for path, (tensor, version) in before.items() if _version(tensor) != version]
    return sorted(changed, key=lambda path: [(0, int(p)) if p.isdigit() else (1, p) for p in path.split(".")])


def _bisect(ctx: Context, alloc: Allocation, program: tuple, descriptor: Descriptor,
            views: dict[str, torch.Tensor], start: Mapping[str, torch.Tensor]) -> tuple[str, str, str] | None:
    """The first (segment, buffer, item) whose writes differ when its item (a region or
    an eager break) is replayed from the eager step's own values before it."""
    _restore(views, start)
    for item, call in zip(step_items(ctx, descriptor.mode), program, strict=True):
        segments = (item,) if isinstance(item, Segment) else item[1]
        touched = list(dict.fromkeys(n for s in segments for n in (*s.reads, *s.writes)))
        before = {n: views[n].clone() for n in touched}
        for segment in segments:
            bind(segment, alloc.fns[segment.name], views)()
        alloc.synchronize(ctx)
        eager = {n: views[n].clone() for n in touched}
        _restore(views, before)
        call()
        alloc.synchronize(ctx)
        for segment in segments:
            for name in dict.fromkeys(segment.writes):
                if _differs(ctx.plan, views[name], eager[name]) is not None:
                    where = f"region {item[0].name}" if isinstance(item, tuple) else f"eager segment {segment.name}"
                    return segment.name, name, where
        _restore(views, eager)
    return None


def _largest(plan, expected: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor]
             ) -> tuple[float, float, torch.Tensor | None]:
    """The largest difference between what the buffers hold and ``expected``, and the
    magnitude of the values it is in."""
    worst, scale, like = 0.0, 0.0, None
    for name, want in expected.items():
        bad = _differs(plan, views[name], want)
        if bad is not None and bad[1] >= worst:
            worst, scale, like = bad[1], bad[2], want
    return worst, scale, like


def _differs(plan, got: torch.Tensor, want: torch.Tensor) -> tuple[int, float, float] | None:
    """(elements that differ, max |diff|, max |value|) beyond the plan's tolerances, or None."""
    a, b = _comparable(got), _comparable(want)
    atol, rtol = plan.capture.atol, plan.capture.rtol
    if a.is_floating_point():
        same = (a == b) | (a.isnan() & b.isnan())
        if atol or rtol:
            same = same | torch.isclose(a, b, rtol=rtol, atol=atol)
    else:
        same = a == b
    if bool(same.all()):
        return None
    if a.dtype == torch.bool:
        return int((~same).sum()), 1.0, 1.0
    diff = float((a.double() - b.double()).abs().nan_to_num(0.0).max())
    scale = float(b.double().abs().nan_to_num(0.0).max()) if b.numel() else 0.0
    return int((~same).sum()), diff, scale


def _comparable(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _tolerance_hint(plan, diff: float, scale: float, like: torch.Tensor | None) -> list[str]:
    if like is None or not like.is_floating_point() or not 0 < diff <= _NOISE * max(scale, 1e-30):
        return []
    return [f"only if differences of {diff:.2g} (on values up to {scale:.2g}) are float rounding you accept, set "
            "capture.verify atol/rtol"]


def _declare_hint(paths: list[str]) -> str:
    return (f"make that state the plan's: declare a buffer per tensor with adopt (adopt: {paths[0]!r}, role: "
            "state), so verify restores it and the DAG orders it")


def _listed(paths: list[str], limit: int = 4) -> str:
    shown = ", ".join(paths[:limit])
    more = f" and {len(paths) - limit} more" if len(paths) > limit else ""
    return f"tensor{'s' if len(paths) > 1 else ''} {shown}{more}"


def _version(tensor: torch.Tensor) -> int | None:
    try:
        return tensor._version
    except RuntimeError:  # an inference-mode tensor keeps no version
        return None


def _tensors(root: object, depth: int = 8) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``root`` through modules, attributes, lists and
    dicts, with its attribute path (each object once)."""
    seen: set[int] = set()
    stack: list[tuple[str, object, int]] = [("", root, 0)]
    while stack:
        path, value, level = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            yield path, value
            continue
        if level >= depth or isinstance(value, (str, bytes, int, float, bool, type(None), type)) or callable(value) \
                and not isinstance(value, torch.nn.Module):
            continue
        for key, item in _children(value):
            stack.append((f"{path}.{key}" if path else str(key), item, level + 1))


def _children(value: object) -> list[tuple[str, object]]:
    if isinstance(value, torch.nn.Module):
        items = [*value._parameters.items(), *value._buffers.items(), *value._modules.items()]
        items += [(k, v) for k, v in vars(value).items() if not k.startswith("_") and k != "training"]
        return [(k, v) for k, v in items if v is not None]
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()]
    if isinstance(value, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(value)]
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return [(k, v) for k, v in attributes.items() if not k.startswith("_")]
    return []


def _restore(views: dict[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> None:
    for name, value in saved.items():
        views[name].copy_(value)
