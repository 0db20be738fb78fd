"""The allocate phase: everything the later phases use, made once, before any warmup.

``allocate`` builds the model (unless given one), resolves every ``call`` path, creates
streams, pools, the stream schedules with their events, the static buffers and the
detectors, and registers the undo of each on the run's rollback stack the moment it
exists. What it made comes back as one read-only ``Allocation``: the later phases take
it as an argument and never add to it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import attrs
import torch

from graphflow.engine.model.adopt import adopt, attach
from graphflow.engine.model.binding import build_model, resolve
from graphflow.engine.buffers import Copies, StaticBuffers
from graphflow.engine.channels import ChannelRuntimeProtocol
from graphflow.engine.model.calls import prepare, reference
from graphflow.engine.model.compiled import compile_segments
from graphflow.engine.context import Context
from graphflow.engine.execute import BoundSchedule
from graphflow.engine.memory import check_memory, largest_size
from graphflow.engine.options import Watch
from graphflow.engine.pools import PoolSet
from graphflow.plan.schedule import Schedule, build_schedule, dependencies
from graphflow.errors import CaptureError
from graphflow.events import Phase
from graphflow.plan import BufferRole, CaptureRegion, Mode, Segment
from graphflow.plan.rules import RULES

__all__ = ["Allocation", "allocate", "step_items"]


@attrs.frozen(eq=False)
class Allocation:
    """What allocate made (see the module docstring).

    ``streams`` maps each segment to the stream it runs on; ``schedules`` maps a
    sequence of segment names (the eager step, each region) to its bound schedule.
    The model and what is bound to it (``fns``: each segment's callable as warmup and
    capture call it, compiled where the plan says so; ``uncompiled``: the same before
    ``torch.compile``; ``hooks``: each prewarm hook, ``detectors``) live in ``owned``, which rollback
    empties: the record may outlive the run in a traceback, the model must not.
    """

    devices: Mapping[str, torch.device]
    baseline: Mapping[torch.device, int]
    streams: Mapping[str, object]
    #: Each device's graph pools (``graphflow.engine.pools``): captures go to the current one.
    pool_sets: Mapping[torch.device, PoolSet]
    schedules: Mapping[tuple[str, ...], BoundSchedule]
    buffers: StaticBuffers
    owned: _Owned

    @property
    def model(self) -> object:
        return self.owned.model

    @property
    def fns(self) -> Mapping[str, Callable[..., object]]:
        return self.owned.fns

    @property
    def uncompiled(self) -> Mapping[str, Callable[..., object]]:
        """Each segment's callable as the model defines it, before ``torch.compile``
        (the same as ``fns`` for a segment the plan does not compile)."""
        return self.owned.uncompiled

    @property
    def hooks(self) -> Mapping[str, Callable[..., object]]:
        return self.owned.hooks

    @property
    def detectors(self):
        return self.owned.detectors

    @property
    def snapshots(self) -> tuple[tuple[Copies, Copies], ...] | None:
        """Warmup's room for verify's start and expected copies (``Copies``), while verify
        needs them: one pair, or two when verify runs one descriptor behind (``behind``)."""
        return self.owned.snapshots

    @property
    def behind(self) -> bool:
        """Whether each descriptor is verified after the next one's warmup and capture,
        its snapshots kept in a second pair meanwhile: the graphs of a descriptor are
        instantiated beside that work (``Graph.ready``) instead of before its verify."""
        return self.owned.snapshots is not None and len(self.owned.snapshots) > 1

    @property
    def reference(self):
        """The plan's reference step, bound like a segment (``graphflow.engine.model.calls``), or None."""
        return self.owned.reference

    def device_of(self, ctx: Context, segment: Segment) -> torch.device:
        """A segment's device: the plan's answer, else the first device the plan names."""
        name = ctx.plan.segment_device(segment)
        if name is not None:
            return self.devices[name]
        return next(iter(self.devices.values()), torch.device("cpu"))

    @property
    def pools(self) -> dict[torch.device, object]:
        """The pool each device's captures go to."""
        return {device: pools.current for device, pools in self.pool_sets.items()}

    def pool_bytes(self, ctx: Context) -> int | None:
        """Bytes the capture pools hold, when the backend can tell (an allocator snapshot)."""
        sizes = [pools.nbytes() for pools in self.pool_sets.values()]
        return None if any(s is None for s in sizes) else sum(sizes)

    def synchronize(self, ctx: Context) -> None:
        for device in dict.fromkeys(self.devices.values()):
            ctx.backend.synchronize(device)


def step_items(ctx: Context, mode: Mode):
    """A mode's step for this rank: regions (with this rank's segments) and eager
    breaks, family after family."""
    plan = ctx.plan
    for family in plan.families:
        for item in plan.step(family.name, mode):
            if isinstance(item, CaptureRegion):
                segments = tuple(s for s in (plan.segment(n) for n in item.segments) if s.runs_on(ctx.rank))
                if segments:
                    yield item, segments
            elif item.runs_on(ctx.rank):
                yield item


def allocate(ctx: Context, model: object | None, channels: ChannelRuntimeProtocol | None) -> Allocation:
    plan, backend, stack = ctx.plan, ctx.backend, ctx.stack
    devices: dict[str, torch.device] = {}
    baseline: dict[torch.device, int] = {}
    for name in _device_names(ctx):
        device = backend.device(name)
        devices[name] = device
        baseline.setdefault(device, backend.memory_allocated(device))
    first = next(iter(devices.values()), torch.device("cpu"))
    _check_capturable(ctx)
    if ctx.options.verify:
        _check_verifiable(ctx)
    owned = _Owned()
    if model is None:
        offered = {"device": first, "rank": ctx.rank, "world_size": ctx.world_size, "plan": plan}
        if channels is not None:
            offered["channels"] = channels.handles
        model = build_model(plan, offered)
    owned.model = model
    stack.push("drop the model", owned.drop)
    if channels is not None:  # so a channel's prewarm hook resolves on this model
        channels.bind(model)
        stack.push("unbind the model from the channels", functools.partial(channels.bind, None))
    largest = largest_size(ctx)
    adopted = adopt(ctx, model, largest, devices.__getitem__)
    owned.holders.update({a.path.rpartition(".")[0] or a.path: a.slot.owner for a in adopted.values()})
    owned.uncompiled.update(prepare(ctx, model, adopted, lambda: owned.detectors))
    owned.fns.update(compile_segments(ctx, owned.uncompiled))
    owned.reference = reference(ctx, model, adopted)
    for hook in plan.prewarm:
        owned.hooks[hook.name] = resolve(model, hook.call, kind="prewarm", name=hook.name, plan=plan)
    streams = _streams(ctx, devices, first)
    schedules = _schedules(ctx, streams)
    stack.push("drop the schedules and their events", schedules.clear)
    pools: dict[torch.device, PoolSet] = {}
    for segment in ctx.segments:
        name = plan.segment_device(segment)
        device = devices[name] if name is not None else first
        if segment.is_graph and device not in pools:
            pools[device] = PoolSet(backend, device, stack)
    given = {n: a.existing for n, a in adopted.items() if a.existing is not None}
    # Checked before the model was built too (graphflow.engine.memory); again now that its
    # weights have taken memory and the tensors it adopts are known.
    check_memory(ctx, devices, largest, given)
    buffers = StaticBuffers(plan, largest, lambda n: devices[n], given=given)
    stack.push("free the static buffers", buffers.clear)
    attach(adopted, buffers.tensors)
    if ctx.options.verify and ctx.verify_plan.reuses_warmup:
        def pair() -> tuple[Copies, Copies]:
            return Copies(buffers, ctx.verify_plan.start), Copies(buffers, ctx.verify_plan.written)

        owned.snapshots = (pair(),)
        stack.push("free verify's snapshots", owned.free_snapshots)
        if _may_verify_behind(ctx) and _room_for_another(ctx, devices, owned.snapshots[0]):
            owned.snapshots += (pair(),)
    if ctx.options.detectors is not Watch.OFF:
        owned.detectors = _detectors(ctx, buffers, model)
    return Allocation(devices, baseline, streams, pools, schedules, buffers, owned)

@attrs.define(eq=False)
class _Owned:
    """The model and everything bound to it; ``drop`` (an undo) lets all of it go."""

    model: object = None
    fns: dict = attrs.field(factory=dict)
    uncompiled: dict = attrs.field(factory=dict)
    hooks: dict = attrs.field(factory=dict)
    detectors: object = None
    reference: object = None
    #: The objects adopted tensors sit in, by path (a cache's layers): their plain values
    #: are state too (``graphflow.engine.model.host_state``).
    holders: dict = attrs.field(factory=dict)
    #: Where warmup copies the step's start and what it wrote for verify (pairs of ``Copies``), or None.
    snapshots: tuple[tuple[Copies, Copies], ...] | None = None

    def free_snapshots(self) -> None:
        """Give verify's snapshot memory back: once every descriptor is verified it holds
        nothing anyone reads."""
        if self.snapshots is not None:
            for pair in self.snapshots:
                for copies in pair:
                    copies.clear()
            self.snapshots = None

    def drop(self) -> None:
        self.model = None
        self.fns.clear()
        self.uncompiled.clear()
        self.hooks.clear()
        self.detectors = None
        self.reference = None
        self.holders.clear()


def _check_verifiable(ctx: Context) -> None:
    """Verify draws random inputs: an integer input needs its range."""
    for buffer in ctx.plan.buffers:
        if buffer.role is BufferRole.INPUT and buffer.values is None and not buffer.dtype.startswith(("float", "bfloat")):
            raise CaptureError(f"input buffer {buffer.name!r} is {buffer.dtype} and declares no values",
                               phase=Phase.ALLOCATE.value,
                               hint="declare 'values: [low, high)' in the buffer, the range its values take, "
                                    "so verify can draw random inputs")


#: Rules a run may skip in validation but not in the engine: a FULL step over an eager
#: segment cannot be one graph (the segment would be recorded as if static, or break the
#: capture), and a size above a buffer's capacity contradicts the rows the buffer was
#: declared to hold, which the model may have sized its own tensors and indices for.
UNSAFE_TO_SKIP = ("GF601", "GF604")


def _check_capturable(ctx: Context) -> None:
    """Refuse what ``UNSAFE_TO_SKIP`` finds in the descriptors this run captures, whether
    or not the run skipped those rules: each rule's own check, on the plan restricted to
    this run's descriptors (``RunOptions.sizes`` may leave out the ones a rule flags)."""
    sizes: dict[Mode, tuple[int, ...]] = {}
    for descriptor in ctx.descriptors:
        sizes[descriptor.mode] = (*sizes.get(descriptor.mode, ()), descriptor.size)
    capture = attrs.evolve(ctx.plan.capture, modes=tuple(sizes), sizes=(), mode_sizes=sizes)
    captured = attrs.evolve(ctx.plan, capture=capture)
    for rule in RULES:
        if rule.code in UNSAFE_TO_SKIP:
            for found in rule.check(captured):
                kind, _, name = found.element.partition(" ")
                raise CaptureError(f"{found.element}: {found.message} ({found.code} {rule.title}: "
                                   "not capturable, even with the rule skipped)",
                                   phase=Phase.ALLOCATE.value, segment=name if kind == "segment" else None,
                                   hint=found.fix)


#: A second pair of verify's snapshots is allocated only when at least this much, and as
#: much again as the pair, stays free after it: the capture pool grows into the rest.
SPARE_BYTES = 1 << 30


def _may_verify_behind(ctx: Context) -> bool:
    """Whether verifying one behind can pay and is safe: the backend instantiates graphs
    later, the run is not lazy (its thread verifies each descriptor at once), and it is one
    rank without channels. Ranks must run their phases in the same order (their barriers
    and their collectives pair up by it), and each rank would decide from its own free
    memory."""
    return (ctx.backend.instantiates_later and not ctx.options.lazy and ctx.world_size == 1
            and not ctx.plan.channels)


def _room_for_another(ctx: Context, devices: Mapping[str, torch.device], pair: tuple[Copies, Copies]) -> bool:
    """Whether a second pair of snapshots like ``pair`` fits on every device it lives on
    with room to spare (``SPARE_BYTES``); a backend that cannot tell its free memory gets none."""
    need: dict[torch.device, int] = {}
    for copies in pair:
        for tensor in copies.tensors.values():
            need[tensor.device] = need.get(tensor.device, 0) + tensor.nbytes
    for device, size in need.items():
        free = ctx.backend.free_memory(device)
        if free is None or free - size < max(size, SPARE_BYTES):
            return False
    return True


def _device_names(ctx: Context) -> tuple[str, ...]:
    plan = ctx.plan
    names = [b.device for b in plan.buffers] + [s.device for s in plan.streams]
    names += [d for s in ctx.segments if (d := plan.segment_device(s)) is not None]
    return tuple(dict.fromkeys(names))


def _streams(ctx: Context, devices: Mapping[str, torch.device], first: torch.device) -> dict[str, object]:
    """Each segment's stream: the plan's, or one per device for segments naming none."""
    plan, backend = ctx.plan, ctx.backend
    taken: list[object] = []

    def take(device: torch.device) -> object:
        taken.append(backend.new_stream(device))
        return taken[-1]

    def give_back() -> None:
        streams.clear()
        while taken:
            backend.release_stream(taken.pop())

    streams: dict[str, object] = {}
    # Pushed first: the run's graphs, captured on these streams, are destroyed before.
    ctx.stack.push("give the streams back", give_back)
    named = {s.name: take(devices[s.device]) for s in plan.streams}
    defaults: dict[torch.device, object] = {}
    for segment in ctx.segments:
        if segment.stream is not None:
            streams[segment.name] = named[segment.stream]
            continue
        name = plan.segment_device(segment)
        device = devices[name] if name is not None else first
        if device not in defaults:
            defaults[device] = take(device)
        streams[segment.name] = defaults[device]
    return streams


def _schedules(ctx: Context, streams: Mapping[str, object]) -> dict[tuple[str, ...], BoundSchedule]:
    """Schedule the eager step and every region to capture over their streams, and
    preallocate the events the largest of them needs on each device."""
    sequences = [ctx.segments]
    for mode in dict.fromkeys(d.mode for d in ctx.descriptors):
        sequences += [item[1] for item in step_items(ctx, mode) if not isinstance(item, Segment)]
    placed: dict[tuple[str, ...], tuple[Schedule, list[tuple[torch.device, int]]]] = {}
    needed: dict[torch.device, int] = {}
    for segments in sequences:
        names = tuple(s.name for s in segments)
        if names in placed:
            continue
        schedule = build_schedule(names, [streams[n] for n in names], dependencies(ctx.plan, segments))
        # Each event slot is the k-th event of its stream's device; schedules never run
        # at the same time, so they share each device's events.
        taken: dict[torch.device, int] = {}
        slots = []
        for stream in schedule.events:
            device = stream.device
            slots.append((device, taken.get(device, 0)))
            taken[device] = taken.get(device, 0) + 1
            needed[device] = max(needed.get(device, 0), taken[device])
        placed[names] = (schedule, slots)
    events = {device: [ctx.backend.new_event(device) for _ in range(count)] for device, count in needed.items()}
    return {names: BoundSchedule.of(schedule, [events[device][k] for device, k in slots])
            for names, (schedule, slots) in placed.items()}


def _detectors(ctx: Context, buffers: StaticBuffers, model: object):
    from graphflow.engine.detectors import Check, Detectors

    known = list(buffers.tensors.values())
    if isinstance(model, torch.nn.Module):
        known += [*model.parameters(), *model.buffers()]
    return Detectors(checks=[c for c in Check.default() if c not in ctx.options.disabled_checks], known=known)
