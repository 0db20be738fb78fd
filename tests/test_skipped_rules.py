"""Rules a run skips that guard memory or graph safety still stop it, in allocate.

``RunOptions(skip_rules=...)`` leaves a rule out of validation, so that a plan can
reproduce a hazard on purpose; GF601 (an eager segment in a FULL step) and GF604 (a
size above a buffer's capacity) describe plans that cannot be captured at all, so
allocate refuses them before any segment runs.
"""

from __future__ import annotations

import attrs
import pytest

from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError, InvalidPlanError
from graphflow.events import EventKind, Phase
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode
from plans.toy_model import build_toy, toy_plan

P, F = Mode.PIECEWISE, Mode.FULL


class Calls:
    """A listener and a model wrapper: which phases began, which segments ran."""

    def __init__(self):
        self.phases: list[Phase] = []
        self.segments: list[str] = []

    def on_event(self, event):
        if event.kind is EventKind.PHASE_BEGIN:
            self.phases.append(event.phase)

    def model(self, layers: int):
        model = build_toy(layers)
        for i, layer in enumerate(model.layers):
            for name in ("pre", "mix", "blend", "post"):
                setattr(layer, name, self._wrap(f"L{i}.{name}", getattr(layer, name)))
        model.head = self._wrap("head", model.head)
        return model

    def _wrap(self, name, fn):
        def segment(*args):
            self.segments.append(name)
            fn(*args)

        return segment


def capture(plan, skip, **options):
    calls = Calls()
    model = calls.model(len(plan.segments) // 3)
    options = RunOptions(backend="cpu", detectors=False, skip_rules=skip, **options)
    try:
        with run_pipeline(plan, options, model=model, listeners=[calls]):
            pass
    except CaptureError as error:
        return error, calls
    return None, calls


def with_buffer(plan, buffer):
    return attrs.evolve(plan, buffers=(*plan.buffers, buffer))


def refused(error, calls):
    assert error is not None, "the plan committed"
    assert error.phase == Phase.ALLOCATE.value
    assert calls.phases == [Phase.ALLOCATE], "refused before warmup"
    assert calls.segments == [], "no segment ran"


def test_full_over_an_eager_segment_is_refused_in_allocate():
    error, calls = capture(toy_plan(2, sizes=(1, 2), modes=(P, F)), ("GF601",))
    refused(error, calls)
    assert error.segment == "L0.mix"
    assert "GF601" in error.message and "FULL region of family target contains eager segment(s) L0.mix" in error.message
    assert error.hint == "make them graph segments or drop FULL from capture.modes"


def test_a_size_above_a_capacity_is_refused_in_allocate():
    cache = Buffer("cache", ("B", 4), "float32", "cuda:0", role=BufferRole.STATE, capacity={"B": 1})
    error, calls = capture(with_buffer(toy_plan(2, sizes=(1, 2)), cache), ("GF604",))
    refused(error, calls)
    assert error.segment is None
    assert "GF604" in error.message and "buffer cache" in error.message
    assert "sizes 2 are above buffer 'cache' capacity B=1" in error.message


def test_a_symbol_above_a_capacity_is_refused_in_allocate():
    cache = Buffer("cache", ("S", 4), "float32", "cuda:0", role=BufferRole.STATE, capacity={"S": 16})
    plan = attrs.evolve(with_buffer(toy_plan(2, sizes=(1, 2)), cache), symbols={"S": 32})
    error, calls = capture(plan, ("GF604",))
    refused(error, calls)
    assert "GF604" in error.message and "symbol S=32 is above buffer 'cache' capacity S=16" in error.message


def test_only_the_descriptors_the_run_captures_are_judged():
    cache = Buffer("cache", ("B", 4), "float32", "cuda:0", role=BufferRole.STATE, capacity={"B": 1})
    plan = with_buffer(toy_plan(2, sizes=(1, 2)), cache)
    error, calls = capture(plan, ("GF604",), sizes=(1,))
    assert error is None and Phase.CAPTURE in calls.phases
    full = toy_plan(2, modes=(P, F))
    full = attrs.evolve(full, capture=CaptureSettings(modes=(P, F), sizes=(), mode_sizes={P: (1, 2), F: (4,)}))
    error, calls = capture(full, ("GF601",), sizes=(1, 2))
    assert error is None and Phase.CAPTURE in calls.phases


def test_the_rules_still_refuse_in_validation_when_not_skipped():
    with pytest.raises(InvalidPlanError) as info:
        capture(toy_plan(2, sizes=(1, 2), modes=(P, F)), ())
    assert info.value.report.codes() == ("GF601",)
