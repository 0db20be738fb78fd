"""What each segment is called with, resolved once at allocate (the engine's calling convention).

``prepare`` turns every segment of the plan into a ``graphflow.engine.execute.SegmentCall``:
its ``call`` path resolved on the model, the buffers it gets positionally and by keyword
(``inputs``), its ``objects`` resolved and its ``constants``, the buffers its return value
fills (``returns``), the model's slots for the adopted buffers it reads or writes, and
the splitter of its ``breaks``. ``reference`` does the same for the plan's reference step.
A wrong path fails allocate here, naming the segment, before any warmup.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from graphflow.engine.model.adopt import Adopted, slot
from graphflow.engine.model.binding import resolve
from graphflow.engine.context import Context
from graphflow.engine.execute import SegmentCall
from graphflow.engine.model.split import Splitter
from graphflow.errors import PlanError
from graphflow.plan import Plan, Reference, Segment

__all__ = ["prepare", "reference"]


def prepare(ctx: Context, model: object, adopted: Mapping[str, Adopted],
            detectors: Callable[[], object]) -> dict[str, SegmentCall]:
    """Every segment of this rank as a ``SegmentCall``; ``detectors()`` gives the run's
    detectors once they exist (a split registers the tensors it keeps)."""
    plan = ctx.plan
    calls: dict[str, SegmentCall] = {}
    for segment in ctx.segments:
        with ctx.locus.segment(segment.name):
            fn = resolve(model, segment.call, kind="segment", name=segment.name, plan=plan)
            split = Splitter(ctx, segment, model, detectors) if segment.breaks and segment.is_graph else None
            calls[segment.name] = _call(plan, segment, segment.name, fn, model, adopted, split, "segment")
    return calls


def reference(ctx: Context, model: object, adopted: Mapping[str, Adopted]) -> SegmentCall | None:
    """The plan's reference step as a keyword call, or None without one."""
    spec = ctx.plan.reference
    if spec is None:
        return None
    fn = resolve(model, spec.call, kind="reference", name="reference", plan=ctx.plan)
    return _call(ctx.plan, spec, f"reference {spec.call}", fn, model, adopted, None, "reference")


def _call(plan: Plan, spec: Segment | Reference, name: str, fn, model: object, adopted: Mapping[str, Adopted],
          split: Splitter | None, kind: str) -> SegmentCall:
    if isinstance(spec, Segment):
        touched = (*spec.reads, *(w for w in spec.writes if w not in spec.reads))
        # Called by keyword, a segment gets its buffers by keyword only: the rest it
        # returns or reaches through the model.
        positional = () if spec.inputs else tuple(n for n in touched if n not in spec.returns and n not in adopted)
    else:
        touched = tuple(dict.fromkeys((*spec.inputs.values(), *spec.returns)))
        touched += tuple(n for n in adopted if n not in touched)  # the model's own step reaches all of them
        positional = ()
    fixed: dict[str, object] = dict(spec.constants)
    for keyword, path in spec.objects.items():
        try:
            fixed[keyword] = _object(model, path)
        except ValueError as exc:
            origin = plan.origin(kind, spec.name if isinstance(spec, Segment) else "reference")
            where = {"file": origin.file, "line": origin.line} if origin is not None else {}
            raise PlanError(f"objects: {keyword}={path!r}: {exc} — fix the path or the model",
                            element=f"{kind} {name}", **where) from exc
    return SegmentCall(name, fn, positional, tuple(spec.inputs.items()), fixed, tuple(spec.returns),
                       tuple((n, adopted[n].slot) for n in dict.fromkeys(touched) if n in adopted), split)


_ABSENT = object()


def _object(model: object, path: str) -> object:
    place = slot(model, path)
    try:
        value = place.get(_ABSENT)
    except (IndexError, KeyError, TypeError) as exc:
        raise ValueError(f"{type(place.owner).__name__} has no item {place.key!r}") from exc
    if value is _ABSENT:
        raise ValueError(f"{type(place.owner).__name__} has no attribute {place.key!r}")
    return value
