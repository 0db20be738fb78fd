"""Every descriptor checked before it serves: on its first real batch, where verify before
ready did not check it.

Verify before ready runs on a sample of the descriptors (``Verify.SAMPLE``: each mode's
first and last, three between, those the detectors watch), which keeps time to ready
below a hand-written loop. A capture that goes wrong at one size only (a kernel that picks
another algorithm at some sizes, a custom all-reduce that falls back above a threshold, a
branch on the batch) would then serve wrong values at that size in silence. So every
descriptor verify did not check (all of a lazy engine's) is checked when its first batch
comes, in that step: the model's eager step runs on the batch (the model as written,
segment by segment, uncompiled: ``Engine.eager_calls``) and its results are what the step
serves; then the descriptor's step program replays from the same start, and every buffer
the step writes and leaves behind (outputs, state, written inputs) is compared, bit for
bit unless the plan declares tolerances. A replay that differs is taken out at once and
named (the verify phase's ``CaptureError``: the descriptor, the first buffer that
differs, the segment that last wrote it, how much), the eager step's values are put back
where the replay wrote, and its batches go to a larger descriptor or eagerly.

The start (inputs and state at the descriptor's size) is copied for the check, and the
eager step's results are swapped into that copy as the start goes back into the buffers,
one buffer at a time; freed after the check, which costs one eager step, one replay and
one copy of the state, once per descriptor, and nothing after it. Python values the step changes are
not saved: an eager break runs twice in a checked step.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from graphflow.engine.buffers import StaticBuffers
from graphflow.engine.execute import bind
from graphflow.engine.snapshots import VerifyPlan
from graphflow.engine.verify import VerifyResult, compare
from graphflow.errors import CaptureError
from graphflow.plan import Descriptor, Plan, Segment

__all__ = ["Checks", "FirstUse"]

#: Told each check's verdict: None, or why the descriptor is taken out of service and
#: rolled back.
Verdict = Callable[[Descriptor, CaptureError | None], None]


@attrs.frozen
class Checks:
    """How many descriptors were checked against the eager step, and when: what a server
    reads to know that nothing serves unchecked (``Runner.checks``)."""

    before_ready: int  # by verify, before the engine was returned
    on_first_use: int  # on their first batch since
    waiting: int  # captured, their first batch still to come
    failed: int  # found wrong on their first batch, rolled back


class FirstUse:
    """The descriptors still to check on their first batch, and the checks so far (see the
    module docstring)."""

    def __init__(self, plan: Plan, needs: VerifyPlan, buffers: StaticBuffers,
                 segments: tuple[tuple[Segment, Callable[..., object]], ...], unchecked=(),
                 verdict: Verdict | None = None) -> None:
        self._plan, self._needs, self._buffers, self._segments = plan, needs, buffers, segments
        self._verdict = verdict
        #: Captured, not yet checked.
        self.unchecked: set[Descriptor] = set(unchecked)
        #: Every descriptor checked on its first batch so far, in order.
        self.verified: list[VerifyResult] = []
        #: Descriptors whose first batch found their replay wrong, and why.
        self.failures: dict[Descriptor, CaptureError] = {}

    def check(self, descriptor: Descriptor, program: tuple[Callable[[], object], ...]) -> bool:
        """The batch in the static inputs, eagerly, then replayed from the same start;
        whether the replay matched, told to ``verdict`` too. The buffers hold the eager
        step's results either way."""
        self.unchecked.discard(descriptor)
        try:
            result = self._compare(descriptor, program)
        except CaptureError as error:
            self.failures[descriptor] = error
            if self._verdict is not None:
                self._verdict(descriptor, error)
            return False
        self.verified.append(result)
        if self._verdict is not None:
            self._verdict(descriptor, None)
        return True

    def release(self) -> None:
        """Let go of the model's callables and the buffers (at close, on the run's rollback
        stack): a caller that still holds the engine holds no model through its checks."""
        self._segments, self._buffers = (), None
        self.unchecked.clear()

    def counts(self, before_ready: int) -> Checks:
        return Checks(before_ready, len(self.verified), len(self.unchecked), len(self.failures))

    def _compare(self, descriptor: Descriptor, program: tuple[Callable[[], object], ...]) -> VerifyResult:
        size = descriptor.size
        views = self._buffers.views(size)
        start = {name: views[name].clone() for name in self._needs.start}
        for segment, fn in self._segments:
            bind(segment, fn, views)()
        # The eager results go where the start was kept and the start back into the
        # buffers, one buffer at a time: a check holds one copy of the state, not two (a
        # 61-layer plan's state is 11 GB, and a server has little memory to spare).
        expected = {}
        for name in self._needs.written:
            kept = start.pop(name, None)
            if kept is None:
                expected[name] = views[name].clone()
                continue
            result = views[name].clone()
            views[name].copy_(kept)
            kept.copy_(result)
            expected[name] = kept
            del result
        for name, value in start.items():
            views[name].copy_(value)
        del start
        for call in program:
            call()
        replayed = self._buffers.views_of(descriptor)  # the outputs where the graphs return them
        try:
            return compare(self._plan, descriptor, replayed, expected, self._needs.last_writer,
                           against="the eager step on its first batch")
        except CaptureError as error:
            for name, value in expected.items():
                replayed[name].copy_(value)
            error.add_note("checked on its first batch: that step served the eager step's results")
            raise
