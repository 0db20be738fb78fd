"""Hypothesis strategies: valid capture plans, and mutations that inject one conflict each.

``valid_plans()`` builds plans the validator must accept with no diagnostic at all, of
varied structure: one to three families, each a chain of graph and eager segments over
symbolically shaped buffers (new buffers, in-place updates, read-only alias views),
explicit streams on one or two GPUs (a family changes GPU only through an eager copy),
channels owned by their family with real warmup, per-rank segments that keep every
rank's collective order identical, PIECEWISE and/or FULL (FULL only when no family has
an eager segment), and sorted unique sizes.

``MUTATIONS`` maps a rule code to a function ``Plan -> Plan`` that injects exactly that
conflict (with ``attrs.evolve``), choosing a target the plan has or rejecting the example
with ``assume`` when it has none; ``VALIDATE_ARGS`` gives the few rules that judge a
figure the plan does not hold (the device memory) what to validate with.
``FIELD_MUTATIONS`` maps a field to a function that builds the plan with a value that
field refuses: those failures are caught when the plan is built, before any rule.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import attrs
from hypothesis import assume
from hypothesis import strategies as st

from graphflow.plan import (
    DTYPE_BYTES,
    Buffer,
    BufferRole,
    CaptureSettings,
    Channel,
    ChannelKind,
    Compile,
    Family,
    Mode,
    Plan,
    Prewarm,
    Reference,
    Segment,
    SegmentKind,
    Stream,
    WarmupPolicy,
)

__all__ = ["FIELD_MUTATIONS", "MUTATIONS", "VALIDATE_ARGS", "valid_plans"]

FAMILIES = ("target", "draft", "context_kv")
SIZES = (1, 2, 3, 4, 8, 16, 24, 32, 64, 128, 256, 512)
SHAPES = (("B", 64), ("2*B", 16), ("B",), (4, "B", 8), ("B", "H"), ("B", "2*H", 4))

# Strategies built once: building one per draw doubles the time to generate a plan.
_BOOL = st.booleans()
_SHAPE = {True: st.sampled_from(SHAPES), False: st.sampled_from([s for s in SHAPES if "H" not in s and "2*H" not in s])}
_DTYPE = st.sampled_from(sorted(DTYPE_BYTES))
_HEADROOM = st.none() | st.integers(0, 512)  # capacity above the largest size, or none
_KIND = st.sampled_from(list(ChannelKind))
_SIZES = st.lists(st.sampled_from(SIZES), min_size=1, max_size=5, unique=True).map(lambda sizes: tuple(sorted(sizes)))
# Half the plans allow eager segments (no FULL).
_MODES = st.sampled_from([(Mode.PIECEWISE,), (Mode.PIECEWISE,), (Mode.FULL,), (Mode.PIECEWISE, Mode.FULL)])
_FAMILIES = st.lists(st.sampled_from(FAMILIES), min_size=1, max_size=3, unique=True)
_NAME = st.sampled_from(["decode", "dsv4-mini", "spec"])
# torch.compile settings: mostly none; a plan-wide one; a segment's own, over it or alone.
_PLAN_COMPILE = st.sampled_from([None, None, "inductor", Compile(mode="max-autotune-no-cudagraphs", dynamic=True),
                                 Compile(backend="aot_eager", strict=True)])
_SEGMENT_COMPILE = st.sampled_from([None] * 6 + [False, "eager", Compile(fullgraph=True, options={"x": 1})])


@functools.cache
def _choice(options: tuple) -> st.SearchStrategy:
    return st.sampled_from(options)


def _subset(draw, world_size: int) -> list[int]:
    """A proper, non-empty subset of the ranks."""
    mask = draw(st.integers(1, 2**world_size - 2))
    return [rank for rank in range(world_size) if mask >> rank & 1]


@attrs.define
class _Builder:
    """Mutable scratch state while drawing one plan; the result is a frozen Plan."""

    draw: Callable
    sizes: tuple[int, ...]
    symbols: dict[str, int]
    devices: int
    world_size: int
    allow_eager: bool
    buffers: list[Buffer] = attrs.field(factory=list)
    segments: list[Segment] = attrs.field(factory=list)
    channels: list[Channel] = attrs.field(factory=list)
    prewarm: list[Prewarm] = attrs.field(factory=list)

    def new_buffer(self, name: str, device: int, role: BufferRole = BufferRole.INTERNAL) -> Buffer:
        headroom = self.draw(_HEADROOM)
        capacity = {"B": max(self.sizes) + headroom} if headroom is not None else {}
        buffer = Buffer(name, self.draw(_SHAPE["H" in self.symbols]), self.draw(_DTYPE), f"cuda:{device}",
                        role=role, capacity=capacity)
        self.buffers.append(buffer)
        return buffer

    def family(self, family: str, next_id: int) -> int:
        """Append one family's chain of segments; returns the next free channel id."""
        draw = self.draw
        device = draw(st.integers(0, self.devices - 1))
        first = self.new_buffer(f"{family}.in", device, BufferRole.INPUT)
        if "B" in first.shape and draw(_BOOL):  # its padded rows hold a scratch value
            self.buffers[-1] = first = attrs.evolve(first, pad=float(draw(st.integers(0, 7))))
        current = first.name
        read_as = current  # the name the next segment reads ``current`` through (maybe an alias view)
        written = [current]
        channels = []
        for _ in range(draw(st.integers(0, 2))):
            jit = draw(_BOOL)
            hook = None
            if jit and draw(_BOOL):
                hook = f"{family}.warm{next_id}"
                self.prewarm.append(Prewarm(hook, f"comm.prepare_{next_id}", per_size=draw(_BOOL)))
            channels.append(Channel(f"{family}.ch{next_id}", draw(_KIND), "tp", next_id,
                                    family, WarmupPolicy.REAL, hook, jit))
            next_id += 1
        self.channels += channels
        steps = draw(st.integers(1, 6))
        start = len(self.segments)
        for step in range(steps):
            last = step == steps - 1
            actions = ["new"] if last else ["new", "inplace"]
            if not last and self.world_size > 1:
                actions += ["probe"] + (["split"] if channels else [])
            if not last and self.allow_eager and self.devices > 1:
                actions.append("switch")
            action = draw(_choice(tuple(actions)))
            graph = action != "switch" and (not self.allow_eager or draw(_BOOL))
            name = f"{family}.{step}"
            on_device = [b.name for b in self.buffers if b.name in written and b.device == f"cuda:{device}"]
            pick = draw(st.integers(0, len(on_device)))  # one more earlier buffer to read, or none
            extra = on_device[pick:pick + 1]
            common = {"family": family, "data_dependent": draw(_BOOL)}
            if action in ("new", "switch"):
                if action == "switch":
                    device = 1 - device
                role = BufferRole.OUTPUT if last else BufferRole.INTERNAL
                target = self.new_buffer(f"{family}.b{step}", device, role)
                reads = [read_as, *(e for e in extra if e not in (read_as, current) and action == "new")]
                if action == "new" and draw(_BOOL):  # the same call by keyword, the result returned
                    common.update(inputs={"x": reads[0]}, constants={"scale": draw(st.integers(1, 3))})
                    if draw(_BOOL):
                        common.update(returns=(target.name,))
                    if graph and draw(_BOOL):
                        common.update(breaks=("layers.*.attn",))
                segment = self._segment(name, graph, device, reads, [target.name], copy=action == "switch", **common)
                self.segments.append(segment)
                current = read_as = target.name
                written.append(current)
                if not last and draw(_BOOL):
                    view = Buffer(f"{current}.view", target.shape, target.dtype, target.device,
                                  capacity=target.capacity, alias_of=current)
                    self.buffers.append(view)
                    read_as = view.name
            elif action == "inplace":
                reads = [current, *(e for e in extra if e != current)]
                writes = [current]
                if draw(_BOOL):  # a cache the model holds, adopted: one row per batch row, kept when padded
                    state = Buffer(f"{family}.cache{step}", ("B", 4), "float32", f"cuda:{device}",
                                   role=BufferRole.STATE, adopt=f"{family}.layers.{step}.cache", pad="keep")
                    self.buffers.append(state)
                    reads.append(state.name)
                    writes.append(state.name)
                self.segments.append(self._segment(name, graph, device, reads, writes, **common))
                read_as = current
            elif action == "probe":
                ranks = _subset(draw, self.world_size)
                self.segments.append(self._segment(name, graph, device, [current], [current], ranks=ranks, **common))
                read_as = current
            else:  # split: complementary per-rank variants making the same collective
                channel = channels[draw(st.integers(0, len(channels) - 1))].name
                ranks = _subset(draw, self.world_size)
                rest = sorted(set(range(self.world_size)) - set(ranks))
                for suffix, subset in (("a", ranks), ("b", rest)):
                    self.segments.append(self._segment(f"{name}{suffix}", graph, device, [current], [current],
                                                       ranks=subset, channels=[channel], **common))
                read_as = current
        self._use_channels(channels, start)
        self._add_after(start)
        return next_id

    def _segment(self, name, graph, device, reads, writes, *, copy=False, **kwargs) -> Segment:
        if graph:
            stream = f"s{device}"
            kwargs.setdefault("compile", self.draw(_SEGMENT_COMPILE))
        elif copy or not self.draw(_BOOL):
            stream = None
        else:
            stream = f"s{device}"
        kind = SegmentKind.GRAPH if graph else SegmentKind.EAGER
        call = f"model.{name.replace('.', '_')}"
        return Segment(name, kind, call, reads=reads, writes=writes, stream=stream, **kwargs)

    def _use_channels(self, channels: list[Channel], start: int) -> None:
        """Every channel is used at least once, by segments that run on every rank."""
        everywhere = [i for i in range(start, len(self.segments)) if self.segments[i].ranks is None]
        for channel in channels:
            if any(channel.name in s.channels for s in self.segments[start:]):
                continue
            index = everywhere[self.draw(st.integers(0, len(everywhere) - 1))]
            segment = self.segments[index]
            self.segments[index] = attrs.evolve(segment, channels=[*segment.channels, channel.name])

    def _add_after(self, start: int) -> None:
        """Some segments also declare ``after`` an earlier segment: ordering, never a cycle."""
        for index in range(max(start, 1), len(self.segments)):
            if self.draw(st.integers(0, 4)) == 0:
                before = self.segments[self.draw(st.integers(0, index - 1))].name
                self.segments[index] = attrs.evolve(self.segments[index], after=[before])


def _mode_sizes(modes, sizes):
    """Sometimes one captured mode takes a prefix of the sizes (vLLM caps FULL decode graphs)."""
    return st.one_of(st.just({}), st.builds(lambda mode, n: {mode: sizes[:n]}, st.sampled_from(modes),
                                            st.integers(1, len(sizes))))


@st.composite
def valid_plans(draw) -> Plan:
    """A plan that validates with no error and no warning."""
    sizes = draw(_SIZES)
    modes = draw(_MODES)
    symbols = {"H": draw(st.integers(1, 64))} if draw(_BOOL) else {}
    devices = draw(st.integers(1, 2))
    builder = _Builder(draw, sizes, symbols, devices, draw(st.integers(1, 3)), Mode.FULL not in modes)
    families = draw(_FAMILIES)
    next_id = draw(st.integers(1, 8))
    for family in families:
        next_id = builder.family(family, next_id)
    # Only what segments use: a declared buffer or stream nobody uses is a warning.
    used = {n for s in builder.segments for n in (*s.reads, *s.writes)}
    used |= {b.alias_of for b in builder.buffers if b.name in used and b.alias_of is not None}
    streams = {s.stream for s in builder.segments}
    outputs = [b.name for b in builder.buffers if b.role is BufferRole.OUTPUT]
    inputs = [b.name for b in builder.buffers if b.role is BufferRole.INPUT]
    reference = Reference("forward", inputs={"x": inputs[0]}, returns=(outputs[0],)) if draw(_BOOL) else None
    # A segment with breaks is never compiled (GF704): no plan-wide setting, none of its own.
    split = any(s.breaks for s in builder.segments)
    builder.segments = [attrs.evolve(s, compile=None) if s.breaks else s for s in builder.segments]
    compile = None if split else draw(_PLAN_COMPILE)
    return Plan(
        reference=reference,
        name=draw(_NAME),
        buffers=[b for b in builder.buffers if b.name in used],
        streams=[Stream(f"s{i}", f"cuda:{i}") for i in range(devices) if f"s{i}" in streams],
        channels=builder.channels,
        segments=builder.segments,
        families=[Family(f) for f in families],
        prewarm=builder.prewarm,
        symbols=symbols,
        capture=CaptureSettings(modes=modes, sizes=sizes, warmup_iters=draw(st.integers(1, 3)),
                                mode_sizes=draw(_mode_sizes(modes, sizes)), compile=compile,
                                # compiled segments are not verified bit-exact (GF703)
                                atol=1e-3 if compile is not None or any(s.compile for s in builder.segments) else 0.0),
        world_size=builder.world_size,
    )


# -- mutations: one conflict each ---------------------------------------------------------------


def _replace(plan: Plan, index: int, **changes) -> Plan:
    segments = list(plan.segments)
    segments[index] = attrs.evolve(segments[index], **changes)
    return attrs.evolve(plan, segments=segments)


def _first(plan: Plan, predicate) -> int:
    index = next((i for i, s in enumerate(plan.segments) if predicate(s)), None)
    assume(index is not None)
    return index


def _graph(plan: Plan) -> int:
    return _first(plan, lambda s: s.is_graph)


def _channel_user(plan: Plan) -> int:
    return _first(plan, lambda s: s.channels and s.ranks is None)


def _device_of(plan: Plan, segment: Segment) -> str:
    return plan.buffer(segment.writes[0]).device


def _output(plan: Plan) -> Buffer:
    return next(b for b in plan.buffers if b.role is BufferRole.OUTPUT)


def undeclared_buffer(plan: Plan) -> Plan:
    return _replace(plan, 0, reads=[*plan.segments[0].reads, "undeclared"])


def undeclared_stream(plan: Plan) -> Plan:
    return _replace(plan, _graph(plan), stream="s_missing")


def undeclared_channel(plan: Plan) -> Plan:
    return _replace(plan, 0, channels=[*plan.segments[0].channels, "ch_missing"])


def duplicate_name(plan: Plan) -> Plan:
    return attrs.evolve(plan, buffers=[*plan.buffers, plan.buffers[0]])


def cycle(plan: Plan) -> Plan:
    """A segment is declared after a segment that depends on it."""
    edges = list(plan.dag().edges)
    assume(edges)
    source, target = edges[0]
    index = [s.name for s in plan.segments].index(source)
    return _replace(plan, index, after=[*plan.segments[index].after, target])


def bad_shape(plan: Plan) -> Plan:
    buffer = plan.buffers[0]
    return attrs.evolve(plan, buffers=[attrs.evolve(buffer, shape=(*buffer.shape, "Q")), *plan.buffers[1:]])


def undeclared_family(plan: Plan) -> Plan:
    return _replace(plan, 0, family="ghost")


def undeclared_prewarm(plan: Plan) -> Plan:
    assume(plan.channels)
    return attrs.evolve(plan, channels=[attrs.evolve(plan.channels[0], prewarm="hook_missing"), *plan.channels[1:]])


def unknown_after(plan: Plan) -> Plan:
    return _replace(plan, 0, after=["segment_missing"])


def after_later(plan: Plan) -> Plan:
    """A new independent segment at the end, which the first segment claims to follow."""
    late = Segment("late", SegmentKind.EAGER, "model.late", family=plan.segments[0].family)
    plan = attrs.evolve(plan, segments=[*plan.segments, late])
    return _replace(plan, 0, after=[*plan.segments[0].after, "late"])


def stream_on_the_cpu(plan: Plan) -> Plan:
    assume(plan.streams)
    return attrs.evolve(plan, streams=[attrs.evolve(plan.streams[0], device="cpu"), *plan.streams[1:]])


def rank_outside_world(plan: Plan) -> Plan:
    return _replace(plan, 0, ranks=[plan.world_size])


def read_before_write(plan: Plan) -> Plan:
    buffer = Buffer("unwritten", ("B",), "float32", _device_of(plan, plan.segments[0]))
    plan = attrs.evolve(plan, buffers=[*plan.buffers, buffer])
    return _replace(plan, 0, reads=[*plan.segments[0].reads, "unwritten"])


def unordered_writers(plan: Plan) -> Plan:
    """An eager segment at the end blindly overwrites an output nothing read."""
    output = _output(plan)
    rogue = Segment("rogue", SegmentKind.EAGER, "model.rogue", writes=[output.name], family=plan.segments[-1].family)
    return attrs.evolve(plan, segments=[*plan.segments, rogue])


def _fresh(taken, stem: str) -> str:
    """A name not in ``taken``, so a mutation applied twice adds two elements, not a duplicate."""
    names = {item.name for item in taken}
    return next(f"{stem}{i}" for i in itertools.count() if f"{stem}{i}" not in names)


def unread_graph_output(plan: Plan) -> Plan:
    segment = plan.segments[_graph(plan)]
    device = _device_of(plan, segment)
    dead = _fresh(plan.buffers, "dead")
    plan = attrs.evolve(plan, buffers=[*plan.buffers, Buffer(dead, ("B",), "float32", device)])
    return _replace(plan, plan.segments.index(segment), writes=[*segment.writes, dead])


def alias_larger_than_target(plan: Plan) -> Plan:
    target = plan.buffers[0]
    big = Buffer("big.view", (*target.shape, 2), target.dtype, target.device, capacity=target.capacity,
                 alias_of=target.name)
    return attrs.evolve(plan, buffers=[*plan.buffers, big])


def unused_buffer(plan: Plan) -> Plan:
    spare = Buffer(_fresh(plan.buffers, "spare"), ("B",), "float32", plan.buffers[0].device)
    return attrs.evolve(plan, buffers=[*plan.buffers, spare])


def capacity_on_an_unused_symbol(plan: Plan) -> Plan:
    buffer = plan.buffers[0]
    capped = attrs.evolve(buffer, capacity={**buffer.capacity, "Z": 4})
    return attrs.evolve(plan, buffers=[capped, *plan.buffers[1:]])


def _huge(plan: Plan, stem: str, rows: int) -> Plan:
    """A buffer of ``rows`` x 1024 float32 on cuda:0 (its capacity), nothing else changed."""
    huge = Buffer(_fresh(plan.buffers, stem), ("B", 1024), "float32", "cuda:0", capacity={"B": rows})
    return attrs.evolve(plan, buffers=[*plan.buffers, huge])


def above_device_memory(plan: Plan) -> Plan:
    return _huge(plan, "big", 1 << 24)  # 64 GiB, validated against 32 GiB (VALIDATE_ARGS)


def beyond_any_gpu(plan: Plan) -> Plan:
    return _huge(plan, "huge", 1 << 30)  # 4 TiB


def buffer_on_other_gpu(plan: Plan) -> Plan:
    index = _graph(plan)
    far = Buffer("far", ("B",), "float32", "cuda:7", role=BufferRole.INPUT)
    plan = attrs.evolve(plan, buffers=[*plan.buffers, far])
    return _replace(plan, index, reads=[*plan.segments[index].reads, "far"])


def graph_without_stream(plan: Plan) -> Plan:
    return _replace(plan, _graph(plan), stream=None)


def unused_stream(plan: Plan) -> Plan:
    return attrs.evolve(plan, streams=[*plan.streams, Stream(_fresh(plan.streams, "s_idle"), "cuda:0")])


def stream_on_other_gpu(plan: Plan) -> Plan:
    plan = attrs.evolve(plan, streams=[*plan.streams, Stream("s_far", "cuda:7")])
    return _replace(plan, _graph(plan), stream="s_far")


def region_spans_gpus(plan: Plan) -> Plan:
    """A graph segment on another GPU appended right after a family's last graph segment."""
    family = next((f.name for f in plan.families if plan.family_segments(f.name)
                   and plan.family_segments(f.name)[-1].is_graph), None)
    assume(family is not None)
    out = Buffer("far.out", ("B",), "float32", "cuda:7", role=BufferRole.OUTPUT)
    far = Segment("far", SegmentKind.GRAPH, "model.far", writes=[out.name], stream="s_far", family=family)
    return attrs.evolve(plan, buffers=[*plan.buffers, out], streams=[*plan.streams, Stream("s_far", "cuda:7")],
                        segments=[*plan.segments, far])


def shared_channel_id(plan: Plan) -> Plan:
    assume(plan.channels)
    rival = attrs.evolve(plan.channels[0], name="rival.ch", family="rival")
    return attrs.evolve(plan, families=[*plan.families, Family("rival")], channels=[*plan.channels, rival])


def foreign_channel(plan: Plan) -> Plan:
    ids = [c.id for c in plan.channels]
    other = Channel("other.ch", ChannelKind.ALL_REDUCE, "tp", max(ids, default=0) + 1, "other")
    plan = attrs.evolve(plan, families=[*plan.families, Family("other")], channels=[*plan.channels, other])
    return _replace(plan, 0, channels=[*plan.segments[0].channels, other.name])


def placeholder_reaches_routing(plan: Plan) -> Plan:
    index = _channel_user(plan)
    name = plan.segments[index].channels[0]
    channels = [attrs.evolve(c, warmup=WarmupPolicy.PLACEHOLDER, prewarm=None, jit=False) if c.name == name else c
                for c in plan.channels]
    return _replace(attrs.evolve(plan, channels=channels), index, data_dependent=True)


def cold_jit_channel(plan: Plan) -> Plan:
    assume(plan.channels)
    channel = attrs.evolve(plan.channels[0], jit=True, warmup=WarmupPolicy.PLACEHOLDER, prewarm=None)
    return attrs.evolve(plan, channels=[channel, *plan.channels[1:]])


def rank_order_diverges(plan: Plan) -> Plan:
    index = _channel_user(plan)
    return _replace(attrs.evolve(plan, world_size=max(plan.world_size, 2)), index, ranks=[0])


def unused_channel(plan: Plan) -> Plan:
    ids = [c.id for c in plan.channels]
    spare = Channel(_fresh(plan.channels, "spare.ch"), ChannelKind.P2P, "pp", max(ids, default=0) + 1, plan.families[0].name)
    return attrs.evolve(plan, channels=[*plan.channels, spare])


def eager_in_full(plan: Plan) -> Plan:
    index = _graph(plan)
    plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, modes=(Mode.PIECEWISE, Mode.FULL)))
    return _replace(plan, index, kind=SegmentKind.EAGER)


def unsorted_sizes(plan: Plan) -> Plan:
    assume(len(plan.capture.sizes) > 1)
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, sizes=tuple(reversed(plan.capture.sizes))))


def duplicated_size(plan: Plan) -> Plan:
    sizes = plan.capture.sizes
    assume(sizes)
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, sizes=(*sizes, sizes[-1])))


def size_above_capacity(plan: Plan) -> Plan:
    assume(plan.max_size > 1)
    buffer = plan.buffers[0]
    return attrs.evolve(plan, buffers=[attrs.evolve(buffer, capacity={"B": plan.max_size - 1}), *plan.buffers[1:]])


def no_sizes(plan: Plan) -> Plan:
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, sizes=()))


def keyword_twice(plan: Plan) -> Plan:
    segment = plan.segments[0]
    return _replace(plan, 0, inputs={**segment.inputs, "x": segment.reads[0]}, constants={"x": 1})


def breaks_on_eager(plan: Plan) -> Plan:
    return _replace(plan, _first(plan, lambda s: not s.is_graph), breaks=("layers.*.attn",))


def _padded(plan: Plan) -> bool:
    sizes = plan.capture.all_sizes
    return bool(sizes) and max(sizes) > len(sizes)


def unpadded_state(plan: Plan) -> Plan:
    assume(_padded(plan))
    segment = plan.segments[0]
    state = Buffer(_fresh(plan.buffers, "kv"), ("B", 4), "float32", _device_of(plan, segment), role=BufferRole.STATE)
    plan = attrs.evolve(plan, buffers=[*plan.buffers, state])
    return _replace(plan, 0, reads=[*segment.reads, state.name], writes=[*segment.writes, state.name])


def keep_on_an_input(plan: Plan) -> Plan:
    index, buffer = next((i, b) for i, b in enumerate(plan.buffers) if b.role is BufferRole.INPUT)
    assume("B" in buffer.shape)
    buffers = list(plan.buffers)
    buffers[index] = attrs.evolve(buffer, pad="keep")
    return attrs.evolve(plan, buffers=buffers)


def adopted_twice(plan: Plan) -> Plan:
    plain = [i for i, b in enumerate(plan.buffers) if b.alias_of is None]
    assume(len(plain) > 1)
    buffers = list(plan.buffers)
    for i in plain[:2]:
        buffers[i] = attrs.evolve(buffers[i], adopt="shared.tensor")
    return attrs.evolve(plan, buffers=buffers)


def reference_of_an_unwritten_buffer(plan: Plan) -> Plan:
    written = {plan.storage(w) for s in plan.segments for w in s.writes}
    name = next((b.name for b in plan.buffers if b.role is BufferRole.INPUT and plan.storage(b.name) not in written),
                None)
    assume(name is not None)
    return attrs.evolve(plan, reference=Reference("forward", returns=(name,)))


def breaks_across_streams(plan: Plan) -> Plan:
    """A break on one graph segment of a region whose other graph segment moves to a side stream."""
    region = next((r for r in plan.regions(Mode.PIECEWISE) if len(r.segments) > 1), None)
    assume(region is not None and Mode.PIECEWISE in plan.capture.modes)
    names = [s.name for s in plan.segments]
    first, second = names.index(region.segments[0]), names.index(region.segments[1])
    device = plan.stream(plan.segments[second].stream).device
    plan = attrs.evolve(plan, streams=[*plan.streams, Stream(_fresh(plan.streams, "s_side"), device)])
    plan = _replace(plan, second, stream=plan.streams[-1].name)
    return _replace(plan, first, breaks=("layers.*.attn",))
def compiled_eager_segment(plan: Plan) -> Plan:
    index = _first(plan, lambda s: not s.is_graph)
    return _replace(plan, index, compile="inductor")


def compile_own_graphs(plan: Plan) -> Plan:
    return _capture(plan, compile=Compile(mode="reduce-overhead"))


def compiled_breaks(plan: Plan) -> Plan:
    return _replace(plan, _graph(plan), compile="inductor", breaks=("layers.*.attn",))


def compiled_bit_exact(plan: Plan) -> Plan:
    # A segment without breaks: compiling one with breaks is another conflict (GF704).
    index = _first(plan, lambda s: s.is_graph and not s.breaks)
    return _replace(_capture(plan, atol=0.0, rtol=0.0), index, compile="inductor")


#: One mutation per conflict class, keyed by the code that must report it.
MUTATIONS: dict[str, Callable[[Plan], Plan]] = {
    "GF101": undeclared_buffer,
    "GF102": undeclared_stream,
    "GF103": undeclared_channel,
    "GF104": duplicate_name,
    "GF105": cycle,
    "GF106": bad_shape,
    "GF107": undeclared_family,
    "GF108": undeclared_prewarm,
    "GF109": unknown_after,
    "GF110": after_later,
    "GF112": stream_on_the_cpu,
    "GF113": rank_outside_world,
    "GF114": keyword_twice,
    "GF115": breaks_on_eager,
    "GF201": read_before_write,
    "GF202": unordered_writers,
    "GF203": unread_graph_output,
    "GF204": alias_larger_than_target,
    "GF205": unused_buffer,
    "GF206": unpadded_state,
    "GF207": keep_on_an_input,
    "GF208": adopted_twice,
    "GF209": reference_of_an_unwritten_buffer,
    "GF301": capacity_on_an_unused_symbol,
    "GF302": buffer_on_other_gpu,
    "GF303": above_device_memory,
    "GF304": beyond_any_gpu,
    "GF401": graph_without_stream,
    "GF402": stream_on_other_gpu,
    "GF403": region_spans_gpus,
    "GF404": unused_stream,
    "GF405": breaks_across_streams,
    "GF501": shared_channel_id,
    "GF502": foreign_channel,
    "GF503": placeholder_reaches_routing,
    "GF504": cold_jit_channel,
    "GF505": rank_order_diverges,
    "GF506": unused_channel,
    "GF601": eager_in_full,
    "GF602": unsorted_sizes,
    "GF603": duplicated_size,
    "GF604": size_above_capacity,
    "GF605": no_sizes,
    "GF701": compiled_eager_segment,
    "GF702": compile_own_graphs,
    "GF703": compiled_bit_exact,
    "GF704": compiled_breaks,
}

#: What ``validate`` needs besides the plan to judge a mutation (by code).
VALIDATE_ARGS: dict[str, dict] = {"GF303": {"device_memory": 32 << 30}}


# -- field mutations: a value the plan classes refuse ---------------------------------------------


def _buffer(plan: Plan, **changes) -> Plan:
    return attrs.evolve(plan, buffers=[attrs.evolve(plan.buffers[0], **changes), *plan.buffers[1:]])


def _capture(plan: Plan, **changes) -> Plan:
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, **changes))


#: One refused value per field, keyed by the field the error must name. These were
#: validator rules (unknown dtype, bad device, bad shape, bad capture settings...)
#: before the classes checked their own fields.
FIELD_MUTATIONS: dict[str, Callable[[Plan], Plan]] = {
    "dtype": lambda plan: _buffer(plan, dtype="float13"),
    "device": lambda plan: _buffer(plan, device="cuda"),
    "shape": lambda plan: _buffer(plan, shape=(*plan.buffers[0].shape, 0)),
    "capacity": lambda plan: _buffer(plan, capacity={"B": 0}),
    "values": lambda plan: _buffer(plan, values=(1, 1)),
    "symbols": lambda plan: attrs.evolve(plan, symbols={**plan.symbols, "Z": 0}),
    "world_size": lambda plan: attrs.evolve(plan, world_size=0),
    "ranks": lambda plan: _replace(plan, 0, ranks=[-1]),
    "sizes": lambda plan: _capture(plan, sizes=(0, *plan.capture.sizes)),
    "warmup_iters": lambda plan: _capture(plan, warmup_iters=0),
    "atol": lambda plan: _capture(plan, atol=-1e-3),
    "barrier_timeout_s": lambda plan: _capture(plan, barrier_timeout_s=0.0),
    "kind": lambda plan: _replace(plan, 0, kind="capturable"),
    "compile": lambda plan: _capture(plan, compile={"mode": "fastest"}),
}
