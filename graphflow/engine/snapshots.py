"""Verify's snapshot plan: which buffers verify copies and compares, from the plan alone.

Worked out once per run (``Context.verify_plan``) and read by warmup (what to keep for
verify), verify itself, the lazy capture thread (what serving's buffers a phase must
give back) and the memory check (what verify's copies cost, before anything is built).
It needs the plan and nothing of the engine, so it imports no phase and no torch.
"""

from __future__ import annotations

import attrs

from graphflow.plan import BufferRole, Plan, Segment, WarmupPolicy

__all__ = ["VerifyPlan"]


@attrs.frozen
class VerifyPlan:
    """Which buffers verify snapshots and compares, worked out once per run from the step.

    ``start``: what the step reads and the state it keeps (put back before the replay);
    ``written``: what it writes, internal scratch aside, in the order of each buffer's
    last write, with the segment that last writes each in ``last_writer``; ``state``:
    the state buffers.
    ``reuses_warmup``: whether warmup's run is the reference (every channel the step
    uses communicates in warmup, and no segment is compiled); ``compiled``: the
    reference runs the uncompiled callables of compiled segments.
    """

    start: tuple[str, ...]
    written: tuple[str, ...]
    state: tuple[str, ...]
    last_writer: dict[str, str] = attrs.field(eq=False)
    reuses_warmup: bool = True
    compiled: bool = False

    @classmethod
    def of(cls, plan: Plan, segments: tuple[Segment, ...], *, compiled: bool = False) -> VerifyPlan:
        # What the step leaves behind decides a replay: internal buffers are written before
        # they are read in every step (GF201), so once read they may
        # hold anything, and comparing or copying them (most of a deep model's buffers)
        # would only cost time. A mismatch is then located by replaying segment by
        # segment (``graphflow.engine.model.reference.explain``).
        internal = {b.name for b in plan.buffers if b.role is BufferRole.INTERNAL}
        last_writer = {w: s.name for s in segments for w in s.writes if w not in internal}
        position = {s.name: i for i, s in enumerate(segments)}
        written = tuple(sorted(last_writer, key=lambda b: position[last_writer[b]]))
        read = tuple(dict.fromkeys(r for s in segments for r in s.reads))
        state = tuple(b.name for b in plan.buffers if b.role is BufferRole.STATE)
        silent = {c.name for c in plan.channels if c.warmup is not WarmupPolicy.REAL}
        reuses = not compiled and not any(silent.intersection(s.channels) for s in segments)
        return cls(tuple(dict.fromkeys((*read, *state))), written, state, last_writer, reuses, compiled)

    def copied(self, *, replays_graphs: bool) -> tuple[str, ...]:
        """The buffers verify keeps a copy of: the start, what the step writes, and the
        state it puts back after the replay (a backend that replays graphs leaves the
        written state where the comparison needs it; one that replays calls does not)."""
        kept = self.state if not replays_graphs else tuple(n for n in self.state if n not in self.written)
        return (*self.start, *self.written, *kept)
