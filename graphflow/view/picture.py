"""The plan's step as a picture people read: lanes per stream, regions boxed, repeats drawn once.

A picture must stay readable at any plan size, so it is computed in two steps:

* ``layout(plan, ...)`` decides *what* is drawn and where, as plain data (``Layout``):
  one lane per stream, segments placed left to right in the order the engine can run
  them (a segment starts after everything it depends on and after the previous segment
  of its lane; PIECEWISE regions and eager breaks follow one another), every DAG edge,
  the cross-stream event waits the engine inserts (``graphflow.plan.schedule``), the
  capture regions as boxes. Copies of one ``for_each`` block collapse into one drawn
  block marked ``×61``; copies whose structure differs from their neighbours' are drawn
  apart. Everything is sized in inches and kept within ``MAX_PIXELS``: what does not fit
  is collapsed, and ``Layout.notes`` says what.
* ``draw(layout, path, fmt)`` paints it with matplotlib's object API (the ``draw`` extra,
  imported only there), one collection per kind of shape, so even a 10,000-segment plan
  draws in about a second.

Tests read ``Layout`` (which real edges each drawn edge stands for, the lanes, the
collapsed counts, the size) instead of pixels. This module imports neither torch nor
matplotlib at import time.
"""

from __future__ import annotations

import enum
import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

import attrs

from graphflow.plan import schedule
from graphflow.plan import CaptureRegion, Mode, Plan, Segment
from graphflow.view.render import kind_counts, shown_mode
from graphflow.view.style import EAGER, REGION_EDGE, REGION_FILL, family_colors, lighten
from graphflow.units import compact_sizes, group_by_template, plural

__all__ = ["Cut", "Expand", "ImageFormat", "Layout", "MAX_PIXELS", "draw", "layout", "parse_layers"]

#: The largest picture drawn, in pixels at ``DPI`` (SVG: the same size in points x 0.72).
MAX_PIXELS = (3840, 3840)
#: The width lines wrap at, and what ``graphflow show --format picture`` still writes as PNG.
SCREEN_PIXELS = (2560, 1440)
DPI = 100


class ImageFormat(enum.Enum):
    PNG = "png"
    SVG = "svg"


class Expand(enum.Enum):
    """How copies of a ``for_each`` block are drawn."""

    NONE = "none"  # each block once (copies that differ apart)
    ALL = "all"  # every copy, as far as MAX_PIXELS allows


# -- sizes, in inches ---------------------------------------------------------------

_BOX_W, _BOX_H = 1.34, 0.46
_COL_GAP = 0.46
_LANE_GAP = 0.34
_LANE_LABEL_W = 0.95
_MARGIN = 0.25
_SECTION_GAP = 0.55
_SECTION_PAD = 0.12  # around the boxes of a section, inside a region or block outline
_TOP = 0.62  # above the first lane of a line: block and region labels
_BUS_H = 0.42  # below the lanes of a line holding a collapsed block: its carry bus
_LINE_GAP = 0.35
_FAMILY_TITLE_H = 0.3
_HEADER_H = 0.95
_NOTE_H = 0.19
_LEGEND_ROW_H = 0.26

_COL = _BOX_W + _COL_GAP
_LANE = _BOX_H + _LANE_GAP

_EVENT = "#D9730D"  # cross-stream event waits, forks and joins
_DATA_DEP = "#7B3FA0"
_CHANNEL = "#1B7F79"
_EDGE = "#555555"
_WEAK_EDGE = "#9A9A9A"
_FULL_EDGE = "#3A78C2"
_LABELLED_BOXES = 48  # edge labels (buffer names) only while the picture is this small


# -- the layout, as data ----------------------------------------------------------------


@attrs.frozen
class Lane:
    """A stream's lane (``key`` is the stream, or ``engine:<device>`` for segments naming none)."""

    key: str
    label: str
    device: str | None


@attrs.frozen
class Box:
    """One drawn segment: a real one, or a collapsed block's position standing for every copy."""

    label: str
    segment: Segment  # the one drawn (the block's first copy)
    members: tuple[str, ...]  # every real segment it stands for
    line: int
    lane: int
    x: float  # centre, inches from the left
    y: float  # centre, inches from the top
    block: int | None = None  # index into Layout.blocks


@attrs.frozen
class Edge:
    """A drawn edge between boxes, and the real plan edges it stands for.

    ``route``: ``direct`` (a line between the boxes), ``carried`` (a collapsed block's
    copy feeding a later copy, drawn on the block's bus), ``connector`` (the other end is
    on another line or not drawn: a labelled stub at each end). ``hazards``: the DAG's
    kinds (``raw``, ``war``, ``after``) and ``event`` when the engine waits on an event
    for it (the event waits also name dependencies the DAG leaves out, such as
    write-after-write).
    """

    source: int  # index into Layout.boxes; len(Layout.boxes) is the elided marker
    target: int
    route: str
    hazards: frozenset[str]
    real: frozenset[tuple[str, str]]
    buffers: tuple[str, ...] = ()  # what the target reads that the source wrote
    overwrites: tuple[str, ...] = ()  # what the target overwrites after the source read it
    offset: int = 0  # carried: how many copies later the target is


@attrs.frozen
class RegionBox:
    """One capture region's piece on a line (a region over a line break, or through a
    collapsed block, has several pieces; pieces of repeated regions are merged)."""

    mode: Mode
    label: str
    line: int
    x0: float
    x1: float
    y0: float
    y1: float
    open_left: bool
    open_right: bool
    regions: tuple[str, ...]


@attrs.frozen
class StreamSync:
    """A fork (the origin stream's event that other streams wait on at a region's start)
    or a join (the origin waiting at the region's end for another stream's last segment)."""

    kind: str  # "fork" | "join"
    line: int
    x: float
    from_lane: int
    to_lane: int


@attrs.frozen
class Block:
    """Copies of one ``for_each`` block drawn once."""

    label: str
    count: int
    copies: tuple[str, ...]  # each copy's label (``L0`` .. ``L60``)
    line: int
    x0: float
    x1: float
    y0: float
    y1: float
    bus_y: float


@attrs.frozen
class Elided:
    """Segments left out to keep the picture within the size cap, and the edges among them
    (an edge between a drawn segment and a left-out one ends at this marker)."""

    count: int
    first: str
    last: str
    edges: frozenset[tuple[str, str]]
    line: int
    x: float
    y: float


@attrs.frozen
class Cut:
    """A drawn segment whose one call PIECEWISE capture cuts at submodules (``breaks``): a
    graph per piece, each break eager between. ``pieces`` is None when a pattern has a
    ``*``: how many submodules match is known only once the model is built, so the cut is
    drawn generically (a piece, the break, more pieces)."""

    box: int  # index into Layout.boxes
    patterns: tuple[str, ...]
    pieces: int | None
    label: str


#: A cut drawn piece by piece up to this many breaks; past it, generically.
_CUT_DRAWN = 3


def _cut(index: int, segment: Segment) -> Cut:
    patterns = segment.breaks
    known = not any("*" in p for p in patterns) and len(patterns) <= _CUT_DRAWN
    at = ", ".join(patterns)
    if known:  # a path without * is one submodule, called once per call of the segment
        pieces = len(patterns) + 1
        return Cut(index, patterns, pieces, f"{pieces} graph pieces, cut at {at} (eager)")
    return Cut(index, patterns, None, f"graph pieces cut at {at} (eager)")


def _cut_text(segments: Iterable[Segment]) -> str:
    """How the segments' breaks cut a region, short enough for the region's label."""
    patterns = dict.fromkeys(p.rsplit(".", 1)[-1] for s in segments if s is not None and s.is_graph
                             for p in s.breaks)
    return f"cut at {', '.join(patterns)}" if patterns else ""


@attrs.frozen
class Layout:
    plan: str
    mode: Mode
    width: float  # inches
    height: float
    header: tuple[str, ...]
    lanes: tuple[tuple[str, tuple[Lane, ...]], ...]  # per family
    line_tops: tuple[float, ...]
    line_lanes: tuple[tuple[float, ...], ...]  # each line's lane centres
    line_family: tuple[str, ...]
    boxes: tuple[Box, ...]
    edges: tuple[Edge, ...]
    regions: tuple[RegionBox, ...]
    syncs: tuple[StreamSync, ...]
    blocks: tuple[Block, ...]
    elided: tuple[Elided, ...]
    notes: tuple[str, ...]
    full_outline: bool  # PIECEWISE drawn, and FULL captured too: FULL pieces are outlined
    labelled: bool
    colors: tuple[tuple[str, str], ...]  # family -> color
    cuts: tuple[Cut, ...] = ()

    @property
    def pixels(self) -> tuple[int, int]:
        return round(self.width * DPI), round(self.height * DPI)

    def real_edges(self) -> set[tuple[str, str]]:
        """Every plan edge the picture accounts for: drawn, or among the segments left out."""
        drawn = {pair for edge in self.edges for pair in edge.real}
        return drawn.union(*(marker.edges for marker in self.elided))


def parse_layers(text: str) -> frozenset[int]:
    """``"3"``, ``"3-5"``, ``"0,10-12"`` -> the copy numbers ``--layers`` expands (ValueError if malformed)."""
    numbers: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if match is None:
            raise ValueError(f"--layers {text!r}: expected numbers and ranges such as 3, 3-5 or 0,10-12")
        low = int(match.group(1))
        high = int(match.group(2)) if match.group(2) is not None else low
        if high < low:
            raise ValueError(f"--layers {text!r}: range {low}-{high} runs backwards")
        numbers.update(range(low, high + 1))
    return frozenset(numbers)


# -- the plan's structure: lanes, units, dependencies, repeated blocks ---------------------


def _lane_key(plan: Plan, segment: Segment) -> str:
    """The stream a segment runs on, as the engine picks it: its own, else one per device."""
    return segment.stream if segment.stream is not None else f"engine:{plan.segment_device(segment)}"


_DIGITS = re.compile(r"\d+")


class _Structure:
    """What every layout of one plan shares: lanes, units, dependencies, copies, schedules."""

    def __init__(self, plan: Plan, mode: Mode):
        self.plan = plan
        self.mode = mode
        self.lane_key = {s.name: _lane_key(plan, s) for s in plan.segments}
        self.position = {s.name: i for i, s in enumerate(plan.segments)}
        self.dag = plan.dag()
        self._schedule = schedule
        # What orders placement: the DAG's edges and the engine's (write-after-write, aliases).
        self.preds: dict[str, set[str]] = defaultdict(set)
        for a, b in self.dag.edges:
            self.preds[b].add(a)
        self.families = []
        for family in plan.families:
            segments = plan.family_segments(family.name)
            if segments:
                self.families.append((family.name, segments))
                for dep in schedule.dependencies(plan, segments):
                    self.preds[dep.target].add(dep.source)
        known = {name for _, segments in self.families for name in (s.name for s in segments)}
        orphans = tuple(s for s in plan.segments if s.name not in known)  # of an undeclared family
        if orphans:
            self.families.append((orphans[0].family, orphans))
        # Units: the step as the runtime runs it in this mode (regions and eager breaks in turn).
        self.unit: dict[str, int] = {}
        self.region_of: dict[str, CaptureRegion] = {}
        self.regions: list[CaptureRegion] = []
        counter = 0
        for name, _ in self.families:
            for item in plan.step(name, mode):
                names = item.segments if isinstance(item, CaptureRegion) else (item.name,)
                for n in names:
                    self.unit[n] = counter
                if isinstance(item, CaptureRegion):
                    self.regions.append(item)
                    for n in names:
                        self.region_of[n] = item
                counter += 1
        for s in plan.segments:
            self.unit.setdefault(s.name, counter)
        self.full_regions = plan.regions(Mode.FULL) if mode is Mode.PIECEWISE and Mode.FULL in plan.capture.modes \
            else ()

    def lanes(self, segments: Sequence[Segment]) -> tuple[Lane, ...]:
        used = dict.fromkeys(self.lane_key[s.name] for s in segments)
        order = [s.name for s in self.plan.streams if s.name in used]
        order += [k for k in used if k not in order]
        lanes = []
        for key in order:
            stream = self.plan.stream(key)
            if stream is not None:
                lanes.append(Lane(key, key, stream.device))
            elif key.startswith("engine:"):
                device = key.split(":", 1)[1]
                lanes.append(Lane(key, "engine stream", device))
            else:
                lanes.append(Lane(key, f"{key} (undeclared)", None))
        return tuple(lanes)

    def schedule(self, region: CaptureRegion):
        segments = [self.plan.segment(n) for n in region.segments]
        return self._schedule.build_schedule(region.segments, [self.lane_key[n] for n in region.segments],
                                             self._schedule.dependencies(self.plan, segments))


def _template_ids(plan: Plan, segments: Sequence[Segment]) -> list[object]:
    """Which template each segment was expanded from, or None for a one-off.

    Copies of a ``for_each`` template share a declaration line (``Plan.origins``); a plan
    with no origins (the decorator API, a generated plan) is grouped by name instead, the
    numbers in it masked (``L7.pre`` -> ``L#.pre``).
    """
    lines = Counter()
    patterns = Counter()
    keys = []
    for s in segments:
        origin = plan.origin("segment", s.name)
        key = ("line", origin.file, origin.line) if origin is not None else ("name", _DIGITS.sub("#", s.name))
        keys.append(key)
        (lines if key[0] == "line" else patterns)[key] += 1
    ids: list[object] = []
    for s, key in zip(segments, keys):
        repeated = (lines if key[0] == "line" else patterns)[key] > 1
        named = key[0] == "line" or _DIGITS.search(s.name) is not None
        ids.append(key if repeated and named else None)
    return ids


@attrs.frozen
class _Part:
    """A run of the step drawn together: one-off segments, one copy, or a block of copies."""

    copies: tuple[tuple[Segment, ...], ...]
    group: int | None = None  # the repeated block it comes from
    numbers: tuple[int, ...] = ()  # each copy's number (for --layers)

    @property
    def collapsed(self) -> bool:
        return len(self.copies) > 1

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.copies[0]


def _copies(segments: Sequence[Segment], ids: Sequence[object]) -> list[tuple[int | None, list[list[Segment]]]]:
    """Split the step into one-off runs ``(None, [run])`` and repeated blocks ``(group, copies)``.

    A block's copy is the run from one template's segment to the next segment of that same
    template (the loader expands consecutive templates of one ``for_each`` together, copy
    after copy); the block lasts while the next run repeats the same templates.
    """
    out: list[tuple[int | None, list[list[Segment]]]] = []
    i, n, group = 0, len(segments), 0
    while i < n:
        if ids[i] is None:
            j = i
            while j < n and ids[j] is None:
                j += 1
            out.append((None, [list(segments[i:j])]))
            i = j
            continue
        j = i + 1
        while j < n and ids[j] is not None and ids[j] != ids[i]:
            j += 1
        shape = ids[i:j]
        if j >= n or ids[j] != ids[i] or len(set(shape)) != len(shape):
            out.append((None, [list(segments[i:j])]))
            i = j
            continue
        copies = []
        while ids[i:i + len(shape)] == shape:
            copies.append(list(segments[i:i + len(shape)]))
            i += len(shape)
        out.append((group, copies))
        group += 1
    return out


def _signature(structure: _Structure, copy: Sequence[Segment]) -> tuple:
    """What must agree for copies to be drawn once: each segment's kind, lane, family,
    channels, flags, and the edges inside the copy."""
    index = {s.name: i for i, s in enumerate(copy)}
    parts = [(s.kind, structure.lane_key[s.name], s.family, s.channels, s.data_dependent, s.ranks, s.device,
              structure.region_of.get(s.name) is not None) for s in copy]
    edges = sorted((index[a], index[s.name], tuple(sorted({k for _, _, k in structure.dag.edges[a, s.name]["buffers"]})))
                   for s in copy for a in structure.dag.predecessors(s.name) if a in index)
    return tuple(parts), tuple(edges)


def _copy_number(copies: Sequence[Sequence[Segment]]) -> list[int]:
    """Each copy's number: the number in its names that changes from copy to copy, else its index."""
    runs = [_DIGITS.findall(c[0].name) for c in copies]
    if runs and all(len(r) == len(runs[0]) for r in runs):
        for slot in range(len(runs[0])):
            values = [int(r[slot]) for r in runs]
            if len(set(values)) == len(values):
                return values
    return list(range(len(copies)))


def _parts(structure: _Structure, segments: Sequence[Segment]) -> list[_Part]:
    ids = _template_ids(structure.plan, segments)
    parts: list[_Part] = []
    for group, copies in _copies(segments, ids):
        if group is None:
            parts.append(_Part((tuple(copies[0]),)))
            continue
        numbers = _copy_number(copies)
        signatures = [_signature(structure, c) for c in copies]
        start = 0
        for k in range(1, len(copies) + 1):
            if k == len(copies) or signatures[k] != signatures[start]:
                parts.append(_Part(tuple(tuple(c) for c in copies[start:k]), group, tuple(numbers[start:k])))
                start = k
    return parts


def _expanded(parts: Sequence[_Part], keep: int | None, chosen: frozenset[int] | None) -> list[_Part]:
    """The parts with copies drawn apart: the first ``keep`` expandable copies (all when
    None), only those numbered in ``chosen`` when given; the rest stay collapsed."""
    out: list[_Part] = []
    budget = math.inf if keep is None else keep
    for part in parts:
        if not part.collapsed:
            out.append(part)
            continue
        run: list[int] = []

        def flush():
            if run:
                out.append(_Part(tuple(part.copies[i] for i in run), part.group, tuple(part.numbers[i] for i in run)))
                run.clear()

        for i, number in enumerate(part.numbers):
            wanted = chosen is None or number in chosen
            if wanted and budget > 0:
                flush()
                out.append(_Part((part.copies[i],), part.group, (number,)))
                budget -= 1
            else:
                run.append(i)
        flush()
    return out


# -- placement ------------------------------------------------------------------------------


class _Section:
    """A part with its columns: each segment's column, from its dependencies and its lane."""

    def __init__(self, structure: _Structure, part: _Part, lanes: dict[str, int], family: str):
        self.part = part
        self.family = family
        self.column: dict[str, int] = {}
        names = {s.name for s in part.segments}
        floor, last_unit, top = 0, None, -1
        lane_last: dict[str, int] = {}
        for s in part.segments:
            unit = structure.unit[s.name]
            if unit != last_unit:
                floor, last_unit = top + 1, unit
            col = floor
            for p in structure.preds[s.name]:
                if p in names:
                    col = max(col, self.column[p] + 1)
            lane = structure.lane_key[s.name]
            if lane in lane_last:
                col = max(col, lane_last[lane] + 1)
            self.column[s.name] = col
            lane_last[lane] = col
            top = max(top, col)
        self.columns = top + 1
        self.lanes = lanes

    @property
    def collapsed(self) -> bool:
        return self.part.collapsed


@attrs.frozen
class _Chunk:
    """Columns ``[first, last]`` of a section, placed on one line at ``x`` (its left edge)."""

    section: int
    first: int
    last: int
    line: int
    x: float

    @property
    def width(self) -> float:
        return _chunk_width(self.last - self.first + 1)


def _chunk_width(columns: int) -> float:
    return columns * _BOX_W + (columns - 1) * _COL_GAP + 2 * _SECTION_PAD


def _break_lines(sections: Sequence[_Section], families: Sequence[str], width: float) -> list[list[_Chunk]]:
    """Sections left to right, a new line when the next does not fit (or a new family
    starts); a section wider than a line is cut at columns."""
    usable = max(width - 2 * _MARGIN - _LANE_LABEL_W, _chunk_width(1))
    fit = max(1, int((usable - 2 * _SECTION_PAD + _COL_GAP) // _COL))
    lines: list[list[_Chunk]] = [[]]
    x = 0.0
    family = None
    for index, section in enumerate(sections):
        if family is not None and families[index] != family and lines[-1]:
            lines.append([])
            x = 0.0
        family = families[index]
        first = 0
        while first < section.columns:
            room = fit if not lines[-1] else int((usable - x - _SECTION_GAP - 2 * _SECTION_PAD + _COL_GAP) // _COL)
            take = min(section.columns - first, room)
            whole = take == section.columns - first
            if take <= 0 or (lines[-1] and not whole and first == 0):
                lines.append([])
                x = 0.0
                continue
            left = x + (_SECTION_GAP if lines[-1] else 0.0)
            chunk = _Chunk(index, first, first + take - 1, len(lines) - 1, left)
            lines[-1].append(chunk)
            x = left + chunk.width
            first += take
            if first < section.columns:
                lines.append([])
                x = 0.0
    return [line for line in lines if line]


def _line_height(n_lanes: int, has_block: bool, family_title: bool) -> float:
    return (_FAMILY_TITLE_H if family_title else 0.0) + _TOP + n_lanes * _LANE - _LANE_GAP + \
        (_BUS_H if has_block else 0.12)


@attrs.frozen
class _Arrangement:
    sections: tuple[_Section, ...]
    families: tuple[str, ...]  # per section
    lines: tuple[tuple[_Chunk, ...], ...]
    width: float
    body_height: float


def _arrange(structure: _Structure, parts_by_family, lanes_by_family, max_width: float) -> _Arrangement:
    sections, families = [], []
    for family, parts in parts_by_family:
        lanes = {lane.key: i for i, lane in enumerate(lanes_by_family[family])}
        for part in parts:
            sections.append(_Section(structure, part, lanes, family))
            families.append(family)
    lines = _break_lines(sections, families, max_width)
    width = 0.0
    height = 0.0
    seen: set[str] = set()
    for line in lines:
        family = families[line[0].section]
        titled = len(parts_by_family) > 1 and family not in seen
        seen.add(family)
        width = max(width, line[-1].x + line[-1].width)
        height += _line_height(len(lanes_by_family[family]), any(sections[c.section].collapsed for c in line),
                               titled) + _LINE_GAP
    return _Arrangement(tuple(sections), tuple(families), tuple(tuple(line) for line in lines),
                        width + 2 * _MARGIN + _LANE_LABEL_W, height)


# -- the public entry point -------------------------------------------------------------------


def layout(plan: Plan, *, mode: Mode | None = None, expand: Expand = Expand.NONE,
           layers: frozenset[int] | None = None, max_pixels: tuple[int, int] = MAX_PIXELS) -> Layout:
    """Decide what the picture of ``plan`` shows, within ``max_pixels`` (see the module docstring).

    ``mode`` picks whose regions are boxed and how the step is ordered (default: PIECEWISE
    unless the plan captures FULL only). ``layers`` draws the copies with these numbers
    apart (``--layers``) and keeps the others collapsed.
    """
    mode = mode or shown_mode(plan)
    structure = _Structure(plan, mode)
    lanes_by_family = {family: structure.lanes(segments) for family, segments in structure.families}
    parts_by_family = [(family, _parts(structure, segments)) for family, segments in structure.families]
    cap_w, cap_h = max_pixels[0] / DPI, max_pixels[1] / DPI
    screen_w = min(SCREEN_PIXELS[0] / DPI, cap_w)
    header_h = _HEADER_H
    legend_h = 2 * _LEGEND_ROW_H + 0.15

    def arrangement(keep: int | None, chosen, width: float) -> _Arrangement:
        parts = [(family, _expanded(p, keep, chosen)) for family, p in parts_by_family]
        return _arrange(structure, parts, lanes_by_family, width)

    def fits(arr: _Arrangement, notes: int, w: float, h: float) -> bool:
        total = header_h + notes * _NOTE_H + arr.body_height + legend_h
        return arr.width <= w + 1e-9 and total <= h + 1e-9

    expandable = sum(1 for _, parts in parts_by_family for p in parts if p.collapsed for n in p.numbers
                     if layers is None or n in layers)
    notes: list[str] = []
    if plan.capture.modes and mode not in plan.capture.modes:
        notes.append(f"the plan does not capture {mode.value}: the boxes show how {mode.value} would group the step")
    keep = 0 if expand is Expand.NONE and layers is None else None
    chosen = arrangement(keep, layers, screen_w)
    if keep is None and not fits(chosen, 3, cap_w, cap_h):
        # Draw as many copies apart as fit, in step order, and keep the rest collapsed.
        low, high = 0, expandable
        while low < high:
            mid = (low + high + 1) // 2
            if fits(arrangement(mid, layers, screen_w), 3, cap_w, cap_h):
                low = mid
            else:
                high = mid - 1
        chosen = arrangement(low, layers, screen_w)
        notes.append(f"{low:,} of {expandable:,} copies drawn apart; the other {expandable - low:,} stay "
                     f"collapsed to keep the picture within {max_pixels[0]} x {max_pixels[1]} px "
                     "(--layers A-B picks which copies)")
    return _build(structure, chosen, lanes_by_family, parts_by_family, notes, keep is None, cap_w, cap_h,
                  header_h, legend_h, max_pixels)


# -- turning an arrangement into boxes, edges and regions ----------------------------------------


def _copy_label(copies: Sequence[Sequence[Segment]]) -> str:
    """``L{0..60}`` for the copies of a block, from their first segments' names."""
    firsts = [c[0].name for c in copies]
    prefixes = [m.group(0) for m in (re.match(r"\D*\d+", n) for n in firsts) if m is not None]
    if len(prefixes) == len(firsts):
        groups = group_by_template([_Named(p) for p in prefixes], min_size=2)
        if len(groups) == 1:
            return groups[0].label
        if len(set(prefixes)) == 1:
            return prefixes[0]
    return firsts[0] if len(firsts) == 1 else f"{firsts[0]} … {firsts[-1]}"


@attrs.frozen
class _Named:
    name: str


def _members_label(names: Sequence[str]) -> str:
    if len(names) == 1:
        return names[0]
    groups = group_by_template([_Named(n) for n in names], min_size=2)
    return groups[0].label if len(groups) == 1 else f"{names[0]} …"


def _build(structure: _Structure, arr: _Arrangement, lanes_by_family, parts_by_family, notes: list[str],
           expanding: bool, cap_w: float, cap_h: float, header_h: float, legend_h: float, max_pixels) -> Layout:
    plan = structure.plan
    header_notes = list(notes)
    # Lines to keep: all that fit under the cap; what follows is elided.
    budget = cap_h - header_h - legend_h - (len(header_notes) + 2) * _NOTE_H
    kept_lines = []
    used = 0.0
    seen_family: set[str] = set()
    geometry = []
    for line in arr.lines:
        family = arr.families[line[0].section]
        titled = len(parts_by_family) > 1 and family not in seen_family
        h = _line_height(len(lanes_by_family[family]), any(arr.sections[c.section].collapsed for c in line), titled)
        if kept_lines and used + h > budget:
            break
        seen_family.add(family)
        kept_lines.append(line)
        geometry.append((family, titled, h))
        used += h + _LINE_GAP

    # Where each drawn segment is.
    boxes: list[Box] = []
    box_of: dict[str, int] = {}  # real segment -> box
    copy_of: dict[str, int] = {}  # real segment -> copy index within its section
    section_of_box: list[int] = []
    line_tops, line_lanes, line_family = [], [], []
    blocks: list[Block] = []  # one per chunk of a collapsed section (a block wider than a line has several)
    first_block: dict[int, int] = {}  # collapsed section -> its first block
    left = _MARGIN + _LANE_LABEL_W
    y = 0.0  # body-relative; shifted below the header at the end
    for line_index, (line, (family, titled, h)) in enumerate(zip(kept_lines, geometry)):
        top = y + (_FAMILY_TITLE_H if titled else 0.0)
        lane_ys = tuple(top + _TOP + i * _LANE + _BOX_H / 2 for i in range(len(lanes_by_family[family])))
        line_tops.append(y)
        line_lanes.append(lane_ys)
        line_family.append(family if titled else "")
        for chunk in line:
            section = arr.sections[chunk.section]
            part = section.part
            block = None
            if section.collapsed:
                block = len(blocks)
                first_block.setdefault(chunk.section, block)
                bottom = lane_ys[-1] + _BOX_H / 2
                blocks.append(Block(_copy_label(part.copies), len(part.copies),
                                    tuple(_copy_label([c]) for c in part.copies), line_index, left + chunk.x,
                                    left + chunk.x + chunk.width, top + 0.04, bottom + _BUS_H, bottom + _BUS_H * 0.55))
            x0 = left + chunk.x + _SECTION_PAD
            for p, segment in enumerate(part.segments):
                col = section.column[segment.name]
                if not chunk.first <= col <= chunk.last:
                    continue
                members = tuple(c[p].name for c in part.copies)
                lane = section.lanes[structure.lane_key[segment.name]]
                for k, name in enumerate(members):
                    box_of[name] = len(boxes)
                    copy_of[name] = k
                boxes.append(Box(_members_label(members), segment, members, line_index, lane,
                                 x0 + (col - chunk.first) * _COL + _BOX_W / 2, lane_ys[lane], block))
                section_of_box.append(chunk.section)
        y += h + _LINE_GAP

    # Elided: everything in sections not drawn, as one marker after the last drawn chunk.
    elided: list[Elided] = []
    missing = [s for sec in arr.sections for s in _all_segments(sec.part) if s.name not in box_of]
    if missing:
        last_line = len(kept_lines) - 1
        last = kept_lines[-1][-1]
        x = left + last.x + last.width + _SECTION_GAP / 2 + 0.5
        names = {s.name for s in missing}
        inside = frozenset((a, b) for a, b in structure.dag.edges if a in names and b in names)
        marker = Elided(len(missing), missing[0].name, missing[-1].name, inside, last_line, x, line_lanes[-1][0])
        elided.append(marker)
        header_notes.append(f"{plural(len(missing), 'segment')} ({missing[0].name} .. {missing[-1].name}) not drawn: "
                            f"the picture would pass {max_pixels[0]} x {max_pixels[1]} px; "
                            "graphflow show --format dot has every segment")
    hint = "" if expanding else "; --expand or --layers N-M draws them apart"
    for index in first_block.values():
        block = blocks[index]
        header_notes.append(f"{block.label}: {block.count} copies of one for_each block, drawn once "
                            f"(×{block.count}){hint}")
    differing = _differing_notes(parts_by_family)
    header_notes.extend(differing)
    cuts = [_cut(i, b.segment) for i, b in enumerate(boxes) if structure.mode is Mode.PIECEWISE
            and b.segment.is_graph and b.segment.breaks]
    header_notes += [f"{boxes[c.box].label}: {c.label}, a graph per piece" for c in cuts]

    edges = _edges(structure, boxes, box_of, copy_of, section_of_box, missing)
    regions = _region_boxes(structure, boxes, box_of, line_lanes)
    syncs = _syncs(structure, boxes, box_of, regions, lanes_by_family)

    width = max(arr.width, 6.0)
    if elided:
        width = max(width, elided[0].x + 1.2 + _MARGIN)
    width = min(width, cap_w)
    header_h += len(header_notes) * _NOTE_H
    height = header_h + y + legend_h

    def down(value: float) -> float:
        return value + header_h

    boxes = [attrs.evolve(b, y=down(b.y)) for b in boxes]
    blocks = [attrs.evolve(b, y0=down(b.y0), y1=down(b.y1), bus_y=down(b.bus_y)) for b in blocks]
    regions = [attrs.evolve(r, y0=down(r.y0), y1=down(r.y1)) for r in regions]
    elided = [attrs.evolve(e, y=down(e.y)) for e in elided]
    line_tops = [down(t) for t in line_tops]
    line_lanes = [tuple(down(v) for v in lanes) for lanes in line_lanes]
    sizes = list(plan.capture.all_sizes)
    modes = ", ".join(f"{m.value} x {len(plan.capture.sizes_for(m))}" for m in plan.capture.modes)
    mode = structure.mode
    cut_regions = sum(1 for r in structure.regions if _cut_text(plan.segment(n) for n in r.segments)) \
        if mode is Mode.PIECEWISE else 0
    header = (
        plan.name,
        f"{plural(len(plan.segments), 'segment')} ({kind_counts(plan.segments)}), "
        f"{plural(len(structure.regions), mode.value + ' region')}"
        + (f" ({cut_regions} cut into graph pieces)" if cut_regions else "")
        + f", {plural(len(plan.buffers), 'buffer')}, "
        f"{plural(len(plan.channels), 'channel')}, {plural(len(plan.streams), 'stream')}"
        + (f", world size {plan.world_size}" if plan.world_size > 1 else ""),
        f"descriptors: {modes} ({plan.capture.size_symbol} = {compact_sizes(sizes)})",
        *header_notes,
    )
    # The counts line must not run off a narrow picture (about 0.066 in a character at 8.5 pt).
    width = min(max(width, 2 * _MARGIN + 0.066 * len(header[1])), cap_w)
    return Layout(plan.name, mode, width, height, header, tuple((f, lanes_by_family[f]) for f, _ in parts_by_family),
                  tuple(line_tops), tuple(line_lanes), tuple(line_family), tuple(boxes), tuple(edges),
                  tuple(regions), tuple(syncs), tuple(blocks), tuple(elided), tuple(header_notes),
                  bool(structure.full_regions), len(boxes) <= _LABELLED_BOXES,
                  tuple(family_colors(plan).items()), tuple(cuts))


def _all_segments(part: _Part) -> list[Segment]:
    return [s for copy in part.copies for s in copy]


def _differing_notes(parts_by_family) -> list[str]:
    """A note for each copy drawn apart because its structure differs from its block's others."""
    notes = []
    for _, parts in parts_by_family:
        by_group: dict[int, list[_Part]] = defaultdict(list)
        for part in parts:
            if part.group is not None:
                by_group[part.group].append(part)
        for group_parts in by_group.values():
            if len(group_parts) < 2:
                continue
            common = max(group_parts, key=lambda p: len(p.copies))
            odd = [p for p in group_parts if p is not common and len(p.copies) == 1 and len(common.copies) > 1]
            if odd:
                labels = ", ".join(_copy_label(p.copies) for p in odd)
                notes.append(f"{labels}: {'differs' if len(odd) == 1 else 'differ'} from the other copies of "
                             f"{_copy_label(common.copies)}'s block (kinds, streams, channels or edges), drawn apart")
    return notes


def _edges(structure: _Structure, boxes, box_of, copy_of, section_of_box, missing) -> list[Edge]:
    """Every DAG edge and every event wait, mapped onto the drawn boxes and merged."""
    missing_names = {s.name for s in missing}
    marker = len(boxes)  # the elided marker's index, when there is one
    merged: dict[tuple, dict] = {}

    def add(a: str, b: str, hazard: str, buffers: Iterable[str]):
        if a in missing_names and b in missing_names:
            return
        sa = box_of.get(a, marker if a in missing_names else None)
        sb = box_of.get(b, marker if b in missing_names else None)
        if sa is None or sb is None:
            return
        offset = 0
        if sa == marker or sb == marker:
            route = "connector"
        elif section_of_box[sa] == section_of_box[sb] and copy_of[a] != copy_of[b] and \
                boxes[sa].block == boxes[sb].block:
            route, offset = "carried", copy_of[b] - copy_of[a]
        elif boxes[sa].line == boxes[sb].line and boxes[sa].x < boxes[sb].x:
            route = "direct"
        else:
            route = "connector"
        key = (sa, sb, route, offset)
        entry = merged.setdefault(key, {"hazards": set(), "real": set(), "raw": [], "war": []})
        entry["hazards"].add(hazard)
        if hazard != "event":
            entry["real"].add((a, b))
        for name in buffers:
            if name is not None and hazard in ("raw", "war") and name not in entry[hazard]:
                entry[hazard].append(name)

    for a, b, data in structure.dag.edges(data=True):
        for buffer, _, kind in data["buffers"]:
            add(a, b, kind, [buffer])
    for region in _drawn_regions(structure, box_of):
        schedule = structure.schedule(region)
        for step in schedule.steps:
            for waited in step.waits:
                add(waited, step.name, "event", [])
    edges = []
    for (sa, sb, route, offset), entry in merged.items():
        edges.append(Edge(sa, sb, route, frozenset(entry["hazards"]), frozenset(entry["real"]),
                          tuple(entry["raw"]), tuple(entry["war"]), offset))
    return edges


def _drawn_regions(structure: _Structure, box_of) -> list[CaptureRegion]:
    """The regions whose schedules the picture shows: one per distinct set of drawn boxes."""
    seen = set()
    out = []
    for region in structure.regions:
        if len(region.segments) < 2 or region.segments[0] not in box_of:
            continue
        key = tuple(box_of.get(n) for n in region.segments)
        if key in seen:
            continue
        seen.add(key)
        out.append(region)
    return out


def _region_boxes(structure: _Structure, boxes, box_of, line_lanes) -> list[RegionBox]:
    one_family = len({r.family for r in structure.regions}) <= 1
    pieces: dict[tuple, dict] = {}

    def pieces_of(region: CaptureRegion):
        run: list[int] = []
        for name in region.segments:
            index = box_of.get(name)
            if index is None:
                continue
            previous = boxes[run[-1]] if run else None
            if previous is not None and (boxes[index].line != previous.line or boxes[index].x < previous.x
                                         or boxes[index].block != previous.block):
                yield run
                run = []
            if index not in run:
                run.append(index)
        if run:
            yield run

    def collect(region_list, mode: Mode):
        for region in region_list:
            runs = list(pieces_of(region))
            for k, run in enumerate(runs):
                key = (mode, frozenset(run))
                entry = pieces.setdefault(key, {"labels": [], "open_left": False, "open_right": False, "boxes": run,
                                                "mode": mode})
                entry["labels"].append(region)
                first_drawn = box_of.get(region.segments[0]) in run and k == 0
                last_drawn = box_of.get(region.segments[-1]) in run and k == len(runs) - 1
                entry["open_left"] |= not first_drawn or k > 0
                entry["open_right"] |= not last_drawn or k < len(runs) - 1

    collect(structure.regions, structure.mode)
    collect(structure.full_regions, Mode.FULL)
    out = []
    for (mode, _), entry in pieces.items():
        run = entry["boxes"]
        line = boxes[run[0]].line
        # A piece spans every lane its region forks onto, so its joins and forks sit inside it.
        lanes = [boxes[box_of[n]].lane for r in entry["labels"] for n in r.segments if n in box_of]
        pad = _SECTION_PAD * (0.55 if mode is structure.mode else 0.95)
        x0 = min(boxes[i].x for i in run) - _BOX_W / 2 - pad
        x1 = max(boxes[i].x for i in run) + _BOX_W / 2 + pad
        y0 = line_lanes[line][min(lanes)] - _BOX_H / 2 - pad - 0.12
        y1 = line_lanes[line][max(lanes)] + _BOX_H / 2 + pad
        regions = entry["labels"]
        label = _merged_region_label(regions, one_family, mode)
        cut = _cut_text(structure.plan.segment(n) for r in regions for n in r.segments) \
            if mode is Mode.PIECEWISE else ""
        label += f", {cut}" if cut else ""
        out.append(RegionBox(mode, label, line, x0, x1, y0, y1, entry["open_left"], entry["open_right"],
                             tuple(r.name for r in regions)))
    return out


def _merged_region_label(regions: Sequence[CaptureRegion], one_family: bool, mode: Mode) -> str:
    if mode is Mode.FULL:
        families = ", ".join(dict.fromkeys(r.family for r in regions))
        return f"FULL graph ({families})" if not one_family else "FULL graph"
    by_family: dict[str, list[int]] = defaultdict(list)
    for r in regions:
        if r.index not in by_family[r.family]:
            by_family[r.family].append(r.index)
    parts = []
    for family, indexes in by_family.items():
        text = f"R{indexes[0]}" if len(indexes) == 1 else f"R{{{compact_sizes(indexes)}}}".replace(" step ", "/")
        parts.append(text if one_family else f"{family} {text}")
    return ", ".join(parts)


def _syncs(structure: _Structure, boxes, box_of, regions: Sequence[RegionBox], lanes_by_family) -> list[StreamSync]:
    """Forks at each drawn region's first piece and joins at its last, deduplicated."""
    found: dict[tuple, StreamSync] = {}
    for region in _drawn_regions(structure, box_of):
        schedule = structure.schedule(region)
        lane = {lane.key: i for i, lane in enumerate(lanes_by_family[region.family])}
        origin = lane[schedule.origin]
        first = boxes[box_of[region.segments[0]]]
        for stream in schedule.fork:
            x = _piece_edge(regions, region.name, first, left=True)
            found.setdefault(("fork", first.line, round(x, 3), lane[stream]),
                             StreamSync("fork", first.line, x, origin, lane[stream]))
        last_index = box_of.get(region.segments[-1])
        if last_index is None:
            continue
        last = boxes[last_index]
        for name in schedule.join:
            x = _piece_edge(regions, region.name, last, left=False)
            joined = lane[structure.lane_key[name]]
            found.setdefault(("join", last.line, round(x, 3), joined), StreamSync("join", last.line, x, joined, origin))
    return list(found.values())


def _piece_edge(regions: Sequence[RegionBox], region: str, box: Box, left: bool) -> float:
    """The x of the region piece's left (fork) or right (join) side that holds ``box``."""
    for piece in regions:
        if region in piece.regions and piece.line == box.line and piece.x0 <= box.x <= piece.x1:
            return piece.x0 + 0.07 if left else piece.x1 - 0.07
    return box.x - _BOX_W / 2 - 0.08 if left else box.x + _BOX_W / 2 + 0.08


# -- drawing ------------------------------------------------------------------------------------


def draw(picture: Layout, path: str, image_format: ImageFormat) -> None:
    """Paint ``picture`` into ``path`` as PNG or SVG (SVG text stays text, so it is small
    and searchable)."""
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "graphflow", "path.simplify": True}):
        fig = Figure(figsize=(picture.width, picture.height), dpi=DPI)
        ax = fig.add_axes((0, 0, 1, 1))
        ax.set_xlim(0, picture.width)
        ax.set_ylim(picture.height, 0)
        ax.axis("off")
        _Painter(ax, picture).paint()
        metadata = {"Date": None} if image_format is ImageFormat.SVG else {}
        fig.savefig(path, format=image_format.value, metadata=metadata)


class _Painter:
    def __init__(self, ax, picture: Layout):
        self.ax = ax
        self.p = picture
        self.colors = dict(picture.colors)

    def text(self, x, y, s, **kw):
        kw.setdefault("fontsize", 7)
        self.ax.text(x, y, s, **kw)

    def paint(self) -> None:
        self.header()
        self.lanes()
        self.regions()
        self.blocks()
        self.edges()
        self.segments()
        self.syncs()
        self.elided()
        self.legend()

    def header(self) -> None:
        title, *rest = self.p.header
        self.text(_MARGIN, 0.3, title, fontsize=14, fontweight="bold", va="center")
        for i, line in enumerate(rest):
            note = i >= 2
            self.text(_MARGIN, 0.58 + i * (0.2 if i < 2 else _NOTE_H), line, fontsize=8.5 if not note else 8,
                      va="center", color="#333333" if not note else "#7A4B00")

    def lanes(self) -> None:
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import Rectangle

        stripes = []
        lanes_of = dict(self.p.lanes)
        right = self.p.width - _MARGIN / 2
        family_of_line = []
        current = None
        for index, ys in enumerate(self.p.line_lanes):
            family = self.p.line_family[index] or current
            if family is None:
                family = self.p.lanes[0][0]
            current = family
            family_of_line.append(family)
            lanes = lanes_of[family]
            if self.p.line_family[index] and len(self.p.lanes) > 1:
                self.text(_MARGIN, ys[0] - _BOX_H / 2 - _TOP - 0.05, f"family {family}", fontsize=10,
                          fontweight="bold", va="center", color=self.colors.get(family, "#333333"))
            for k, (y, lane) in enumerate(zip(ys, lanes)):
                if k % 2 == 0:
                    stripes.append(Rectangle((_MARGIN, y - _LANE / 2), right - _MARGIN, _LANE))
                self.text(_MARGIN + 0.05, y - 0.06, lane.label, fontsize=8, fontweight="bold", va="center",
                          color="#444444")
                if lane.device:
                    self.text(_MARGIN + 0.05, y + 0.1, lane.device, fontsize=6.5, va="center", color="#777777")
        self.ax.add_collection(PatchCollection(stripes, facecolor="#F3F4F6", edgecolor="none", zorder=0))

    def regions(self) -> None:
        from matplotlib.collections import LineCollection, PatchCollection
        from matplotlib.patches import Rectangle

        fills, outlines, full_outlines = [], [], []
        for region in self.p.regions:
            x0, x1, y0, y1 = region.x0, region.x1, region.y0, region.y1
            sides = []
            if not region.open_left:
                sides.append([(x0, y0), (x0, y1)])
            if not region.open_right:
                sides.append([(x1, y0), (x1, y1)])
            sides += [[(x0, y0), (x1, y0)], [(x0, y1), (x1, y1)]]
            if region.mode is self.p.mode:
                fills.append(Rectangle((x0, y0), x1 - x0, y1 - y0))
                outlines.extend(sides)
                label = ("… " if region.open_left else "") + region.label + (" …" if region.open_right else "")
                self.text(x0 + 0.05, y0 + 0.08, label, fontsize=6.5, color="#8A6D1A", va="center", zorder=2,
                          fontweight="bold")
            else:
                full_outlines.extend(sides)
                if not region.open_left:
                    self.text(x0 + 0.05, y1 - 0.07, region.label, fontsize=6.5, color=_FULL_EDGE, va="center",
                              zorder=2)
        self.ax.add_collection(PatchCollection(fills, facecolor=REGION_FILL, edgecolor="none", zorder=1))
        self.ax.add_collection(LineCollection(outlines, colors=REGION_EDGE, linewidths=1.0, zorder=1))
        if full_outlines:
            self.ax.add_collection(LineCollection(full_outlines, colors=_FULL_EDGE, linewidths=1.0,
                                                  linestyles=(0, (4, 2)), zorder=1))

    def blocks(self) -> None:
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import FancyBboxPatch

        outlines = []
        for block in self.p.blocks:
            outlines.append(FancyBboxPatch((block.x0, block.y0), block.x1 - block.x0, block.y1 - block.y0,
                                           boxstyle="round,pad=0,rounding_size=0.12"))
            self.text(block.x0 + 0.08, block.y0 + 0.11, f"{block.label}  ×{block.count}", fontsize=9,
                      fontweight="bold", va="center", color="#1F3B73", zorder=5)
        self.ax.add_collection(PatchCollection(outlines, facecolor="none", edgecolor="#1F3B73", linewidths=1.3,
                                               linestyles=(0, (5, 2)), zorder=1.5))

    def segments(self) -> None:
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import FancyBboxPatch, Polygon, Rectangle

        graph, graph_colors, eager, breaks, dd, channel_tags = [], [], [], [], [], []
        cut_of = {cut.box: cut for cut in self.p.cuts}
        for index, box in enumerate(self.p.boxes):
            s = box.segment
            x0, y0 = box.x - _BOX_W / 2, box.y - _BOX_H / 2
            patch = FancyBboxPatch((x0, y0), _BOX_W, _BOX_H, boxstyle="round,pad=0,rounding_size=0.07")
            if index in cut_of:
                self.cut(box, cut_of[index])
                continue
            if s.is_graph:
                graph.append(patch)
                graph_colors.append(self.colors[s.family])
            else:
                eager.append(patch)
                ys = self.p.line_lanes[box.line]
                breaks.append(Rectangle((box.x - _BOX_W / 2 - 0.06, ys[0] - _LANE / 2 + 0.04), _BOX_W + 0.12,
                                        ys[-1] - ys[0] + _LANE - 0.08))
            if s.data_dependent:
                cx, cy = x0 + _BOX_W - 0.1, y0 + 0.1
                dd.append(Polygon([(cx, cy - 0.07), (cx + 0.07, cy), (cx, cy + 0.07), (cx - 0.07, cy)]))
            lines = [box.label]
            if s.channels:
                channel_tags.append(box)
            if not s.is_graph:
                lines.append("eager")
            if s.ranks is not None:
                lines.append("ranks " + ",".join(map(str, s.ranks)))
            size = 7.2 if len(box.label) <= 17 else max(5.2, 7.2 * 17 / len(box.label))
            self.text(box.x, box.y - (0.06 if s.channels else 0.0), lines[0], ha="center", va="center",
                      fontsize=size, zorder=6)
            if len(lines) > 1:
                self.text(box.x, box.y + 0.13, " · ".join(lines[1:]), ha="center", va="center", fontsize=5.8,
                          color=EAGER if not s.is_graph else "#555555", zorder=6)
        for box in channel_tags:
            self.text(box.x, box.y + 0.13 if box.segment.is_graph else box.y - 0.17,
                      "⇄ " + ", ".join(box.segment.channels), ha="center", va="center", fontsize=6,
                      color=_CHANNEL, fontweight="bold", zorder=6)
        self.ax.add_collection(PatchCollection(breaks, facecolor="#FBE3E3", edgecolor="none", zorder=0.5))
        self.ax.add_collection(PatchCollection(graph, facecolor=[lighten(c) for c in graph_colors],
                                               edgecolor=graph_colors, linewidths=1.2, zorder=3))
        self.ax.add_collection(PatchCollection(eager, facecolor=lighten(EAGER, 0.5), edgecolor=EAGER,
                                               linewidths=1.8, zorder=3))
        if dd:
            self.ax.add_collection(PatchCollection(dd, facecolor=_DATA_DEP, edgecolor="white", linewidths=0.5,
                                                   zorder=7))
        tagged = [box for box in channel_tags]
        if tagged:
            ring = [FancyBboxPatch((b.x - _BOX_W / 2 - 0.035, b.y - _BOX_H / 2 - 0.035), _BOX_W + 0.07,
                                   _BOX_H + 0.07, boxstyle="round,pad=0,rounding_size=0.09") for b in tagged]
            self.ax.add_collection(PatchCollection(ring, facecolor="none", edgecolor=_CHANNEL, linewidths=1.0,
                                                   zorder=2.9))

    def cut(self, box: Box, cut: Cut) -> None:
        """A box per graph piece and the eager break between, so the picture counts the
        graphs PIECEWISE makes as ``graphflow show`` does; a cut whose size the plan cannot
        know ends in a piece marked ``…``."""
        from matplotlib.collections import PatchCollection
        from matplotlib.patches import FancyBboxPatch

        color = self.colors[box.segment.family]
        if cut.pieces is None:
            slots = [("graph", ""), ("eager", cut.patterns[0].rsplit(".", 1)[-1]), ("graph", "…")]
        else:
            slots = [("graph", "")]
            for pattern in cut.patterns:
                slots += [("eager", pattern.rsplit(".", 1)[-1]), ("graph", "")]
        gap = 0.04
        width = (_BOX_W - gap * (len(slots) - 1)) / len(slots)
        y0, h = box.y - _BOX_H / 2 + 0.17, _BOX_H - 0.17
        pieces, eager = [], []
        for k, (kind, text) in enumerate(slots):
            x = box.x - _BOX_W / 2 + k * (width + gap)
            patch = FancyBboxPatch((x, y0), width, h, boxstyle="round,pad=0,rounding_size=0.05")
            (pieces if kind == "graph" else eager).append(patch)
            size = 5.5 if len(text) <= 9 else max(4.0, 5.5 * 9 / len(text))
            self.text(x + width / 2, y0 + h / 2, text, ha="center", va="center", fontsize=size,
                      color=EAGER if kind == "eager" else "#333333", zorder=6)
        self.ax.add_collection(PatchCollection(pieces, facecolor=lighten(color), edgecolor=color, linewidths=1.2,
                                               zorder=3))
        self.ax.add_collection(PatchCollection(eager, facecolor=lighten(EAGER, 0.5), edgecolor=EAGER,
                                               linewidths=1.4, zorder=3))
        size = 7.2 if len(box.label) <= 17 else max(5.2, 7.2 * 17 / len(box.label))
        self.text(box.x, box.y - _BOX_H / 2 + 0.07, box.label, ha="center", va="center", fontsize=size, zorder=6)

    def edges(self) -> None:
        from matplotlib.collections import LineCollection, PatchCollection, PathCollection
        from matplotlib.patches import Polygon
        from matplotlib.path import Path as MPath

        styles = {"raw": ([], _EDGE, 0.9, "-"), "war": ([], _WEAK_EDGE, 0.7, (0, (3, 2))),
                  "after": ([], _WEAK_EDGE, 0.7, (0, (1, 1.5))), "event": ([], _EVENT, 1.5, "-")}
        heads: dict[str, list] = defaultdict(list)
        taps: list = []
        tap_dots: list = []
        connectors: dict[tuple[int, bool], list[str]] = defaultdict(list)
        boxes = self.p.boxes
        ports = _ports(self.p)
        lane_xs: dict[tuple[int, int], list[float]] = defaultdict(list)
        for box in boxes:
            lane_xs[(box.line, box.lane)].append(box.x)
        for index, edge in enumerate(self.p.edges):
            style = "event" if "event" in edge.hazards else "raw" if "raw" in edge.hazards else \
                "war" if "war" in edge.hazards else "after"
            if edge.route == "direct":
                a, b = boxes[edge.source], boxes[edge.target]
                out_dy, in_dy = ports[index]
                x1, y1 = a.x + _BOX_W / 2, a.y + out_dy
                x2, y2 = b.x - _BOX_W / 2 - 0.05, b.y + in_dy
                dx = x2 - x1
                if a.lane == b.lane and _blocked(lane_xs[(a.line, a.lane)], a.x, b.x):
                    lift = 0.3 + min(0.35, 0.05 * dx)
                    verts = [(x1, y1), (x1 + 0.35, y1 - lift), (x2 - 0.35, y2 - lift), (x2, y2)]
                else:
                    bend = max(0.15, min(dx * 0.5, 0.8))
                    verts = [(x1, y1), (x1 + bend, y1), (x2 - bend, y2), (x2, y2)]
                styles[style][0].append(MPath(verts, [MPath.MOVETO, MPath.CURVE4, MPath.CURVE4, MPath.CURVE4]))
                heads[style].append(_head(verts[2], verts[3]))
                if self.p.labelled and edge.buffers and style in ("raw", "event") and "raw" in edge.hazards:
                    label = ", ".join(_short_buffers(edge))
                    if len(label) > 22:
                        label = label[:20] + "…"
                    mx, my = _bezier_mid(verts)
                    self.text(mx, my - 0.05, label, ha="center", va="bottom", fontsize=5.3, color="#444444",
                              zorder=4)
            elif edge.route == "carried":
                a, b = boxes[edge.source], boxes[edge.target]
                block = self.p.blocks[a.block]
                # Down the gap right of the source, along the bus, up the gap left of the target.
                xa, xb = a.x + _BOX_W / 2 + _SECTION_PAD * 0.6, b.x - _BOX_W / 2 - _SECTION_PAD * 0.6
                bus = block.bus_y
                taps.append(([(a.x + _BOX_W / 2, a.y + 0.1), (xa, a.y + 0.1), (xa, bus), (xb, bus), (xb, b.y + 0.1),
                              (b.x - _BOX_W / 2 - 0.05, b.y + 0.1)], style))
                tap_dots.append((xa, bus))
                heads[style].append(_head((xb, b.y + 0.1), (b.x - _BOX_W / 2 - 0.02, b.y + 0.1)))
            else:
                if edge.source < len(boxes):
                    connectors[(edge.source, True)].append(_end_label(self.p, edge.target))
                if edge.target < len(boxes):
                    connectors[(edge.target, False)].append(_end_label(self.p, edge.source))
        for name, (paths, color, width, dash) in styles.items():
            if paths:
                self.ax.add_collection(PathCollection(paths, facecolor="none", edgecolor=color, linewidths=width,
                                                      linestyles=dash, zorder=2.5 if name == "event" else 2))
        for style, lines in _group(taps).items():
            _, color, width, dash = styles[style]
            self.ax.add_collection(LineCollection(lines, colors=color, linewidths=width * 0.9, linestyles=dash,
                                                  zorder=2))
        if tap_dots:
            self.ax.plot(*zip(*tap_dots), linestyle="", marker="o", markersize=2.2, color=_EDGE, zorder=2)
        for style, triangles in heads.items():
            color = styles[style][1]
            self.ax.add_collection(PatchCollection([Polygon(t) for t in triangles], facecolor=color,
                                                   edgecolor="none", zorder=2.6))
        for index, block in enumerate(self.p.blocks):
            carried = [e for e in self.p.edges if e.route == "carried" and boxes[e.source].block == index]
            if carried:
                buffers = [g.label for g in group_by_template(
                    [_Named(n) for n in dict.fromkeys(b for e in carried for b in (*e.buffers, *e.overwrites))],
                    min_size=2)]
                offsets = sorted({e.offset for e in carried})
                more = "" if offsets == [1] else " (" + ", ".join(f"+{o}" for o in offsets) + " copies)"
                text = "↩ each copy feeds the next" + more + ": " + ", ".join(buffers)
                if len(text) > 110:
                    text = text[:108] + "…"
                self.text(block.x0 + 0.1, block.bus_y + 0.12, text, fontsize=6, color="#444444", va="center",
                          zorder=5)
        stubs = []
        for (index, outgoing), ends in connectors.items():
            box = boxes[index]
            names = _ends_text(ends)
            if outgoing:
                x1 = box.x + _BOX_W / 2
                stubs.append([(x1, box.y), (x1 + 0.2, box.y)])
                heads["raw"].append(_head((x1, box.y), (x1 + 0.2, box.y)))
                self.text(x1 + 0.04, box.y - _BOX_H / 2 - 0.04, "→ " + names, fontsize=5.5, color="#555555",
                          va="bottom", ha="left", style="italic", zorder=5)
            else:
                x2 = box.x - _BOX_W / 2
                stubs.append([(x2 - 0.2, box.y), (x2, box.y)])
                self.text(x2 - 0.04, box.y + _BOX_H / 2 + 0.04, names + " →", fontsize=5.5, color="#555555",
                          va="top", ha="right", style="italic", zorder=5)
        if stubs:
            self.ax.add_collection(LineCollection(stubs, colors=_EDGE, linewidths=0.9, linestyles=(0, (2, 1)),
                                                  zorder=2))
            self.ax.add_collection(PatchCollection([Polygon(_head((s[0][0], s[0][1]), (s[1][0], s[1][1])))
                                                    for s in stubs], facecolor=_EDGE, edgecolor="none", zorder=2.6))

    def syncs(self) -> None:
        from matplotlib.collections import LineCollection, PatchCollection
        from matplotlib.patches import Polygon

        lines, heads = [], []
        for sync in self.p.syncs:
            ys = self.p.line_lanes[sync.line]
            y0, y1 = ys[sync.from_lane], ys[sync.to_lane]
            direction = 1 if y1 > y0 else -1
            end = y1 - direction * _BOX_H / 2 * 0.0
            lines.append([(sync.x, y0), (sync.x, end)])
            heads.append(Polygon(_head((sync.x, end - direction * 0.2), (sync.x, end))))
            self.text(sync.x + (0.04 if sync.kind == "fork" else -0.04), (y0 + y1) / 2, sync.kind, fontsize=5.3,
                      color=_EVENT, rotation=90, va="center", ha="left" if sync.kind == "fork" else "right",
                      zorder=5)
        if lines:
            self.ax.add_collection(LineCollection(lines, colors=_EVENT, linewidths=1.3, linestyles=(0, (2, 1)),
                                                  zorder=2.7))
            self.ax.add_collection(PatchCollection(heads, facecolor=_EVENT, edgecolor="none", zorder=2.7))

    def elided(self) -> None:
        for marker in self.p.elided:
            self.text(marker.x, marker.y, f"… {marker.count:,} more\n{marker.first} .. {marker.last}",
                      fontsize=7.5, va="center", ha="left", color="#7A4B00", fontweight="bold")

    def legend(self) -> None:
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        p = self.p
        kinds = {s.segment.family for s in p.boxes if s.segment.is_graph}
        handles = [Patch(facecolor=lighten(c), edgecolor=c, label=f"graph segment ({f})")
                   for f, c in self.colors.items() if f in kinds]
        if any(not b.segment.is_graph for b in p.boxes) or p.cuts:
            handles.append(Patch(facecolor=lighten(EAGER, 0.5), edgecolor=EAGER, linewidth=1.8,
                                 label="eager break"))
        if any(b.segment.data_dependent for b in p.boxes):
            handles.append(Line2D([], [], marker="D", linestyle="", markersize=5, color=_DATA_DEP,
                                  label="data-dependent"))
        if any(b.segment.channels for b in p.boxes):
            handles.append(Patch(facecolor="white", edgecolor=_CHANNEL, label="⇄ uses a channel"))
        if any(r.mode is p.mode for r in p.regions):
            handles.append(Patch(facecolor=REGION_FILL, edgecolor=REGION_EDGE,
                                 label=f"{p.mode.value} region = one graph" + (" per piece where cut" if p.cuts
                                                                              else "")))
        if p.full_outline:
            handles.append(Patch(facecolor="none", edgecolor=_FULL_EDGE, linestyle="--", label="FULL graph"))
        if p.blocks:
            handles.append(Patch(facecolor="none", edgecolor="#1F3B73", linestyle="--",
                                 label="repeated block, drawn once"))
        hazards = {h for e in p.edges for h in e.hazards}
        handles.append(Line2D([], [], color=_EDGE, label="dataflow (read after write)"))
        if "war" in hazards:
            handles.append(Line2D([], [], color=_WEAK_EDGE, linestyle=(0, (3, 2)),
                                  label="in-place order (write after read)"))
        if "after" in hazards:
            handles.append(Line2D([], [], color=_WEAK_EDGE, linestyle=(0, (1, 1.5)), label="declared after"))
        if "event" in hazards or p.syncs:
            handles.append(Line2D([], [], color=_EVENT, linewidth=1.5, label="event wait across streams, fork/join"))
        per_row = max(1, int((p.width - 2 * _MARGIN) // 2.45))
        self.ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(_MARGIN / p.width, 0.02),
                       ncol=min(len(handles), per_row), fontsize=7, frameon=False, handlelength=1.8,
                       columnspacing=1.2)


def _ports(picture: Layout) -> list[tuple[float, float]]:
    """Spread the ends of a box's direct edges along its side, ordered by the other end's height."""
    outgoing: dict[int, list[int]] = defaultdict(list)
    incoming: dict[int, list[int]] = defaultdict(list)
    for index, edge in enumerate(picture.edges):
        if edge.route == "direct":
            outgoing[edge.source].append(index)
            incoming[edge.target].append(index)
    result = [(0.0, 0.0)] * len(picture.edges)
    offsets: dict[int, list[float]] = {i: [0.0, 0.0] for i in range(len(picture.edges))}
    for table, side, other in ((outgoing, 0, "target"), (incoming, 1, "source")):
        for box, indexes in table.items():
            indexes.sort(key=lambda i: (picture.boxes[getattr(picture.edges[i], other)].y,
                                        picture.boxes[getattr(picture.edges[i], other)].x))
            n = len(indexes)
            step = min(0.07, (_BOX_H - 0.12) / max(1, n - 1)) if n > 1 else 0.0
            for k, i in enumerate(indexes):
                offsets[i][side] = (k - (n - 1) / 2) * step
    for i in range(len(result)):
        result[i] = (offsets[i][0], offsets[i][1])
    return result


def _blocked(xs: Sequence[float], left: float, right: float) -> bool:
    """Whether a box of the lane sits between two boxes of it (a straight edge would cross it)."""
    return any(left + 1e-6 < x < right - 1e-6 for x in xs)


def _head(before: tuple[float, float], tip: tuple[float, float], size: float = 0.075) -> list[tuple[float, float]]:
    dx, dy = tip[0] - before[0], tip[1] - before[1]
    length = math.hypot(dx, dy) or 1.0
    ux, uy = dx / length, dy / length
    bx, by = tip[0] - ux * size, tip[1] - uy * size
    return [tip, (bx - uy * size * 0.5, by + ux * size * 0.5), (bx + uy * size * 0.5, by - ux * size * 0.5)]


def _bezier_mid(verts) -> tuple[float, float]:
    (x0, y0), (x1, y1), (x2, y2), (x3, y3) = verts
    return (x0 + 3 * x1 + 3 * x2 + x3) / 8, (y0 + 3 * y1 + 3 * y2 + y3) / 8


def _short_buffers(edge: Edge) -> list[str]:
    """The buffers an edge carries, copies grouped: ``q0 .. q60`` -> ``q{0..60}``."""
    return [g.label for g in group_by_template([_Named(n) for n in edge.buffers], min_size=2)]


def _end_label(picture: Layout, index: int) -> str:
    if index < len(picture.boxes):
        return picture.boxes[index].label
    marker = picture.elided[0]
    return f"{marker.first} .. {marker.last}"


def _ends_text(names: Sequence[str]) -> str:
    unique = list(dict.fromkeys(names))
    if len(unique) > 3:
        groups = group_by_template([_Named(n) for n in unique], min_size=2)
        unique = [g.label for g in groups]
    text = ", ".join(unique[:3]) + (f" +{len(unique) - 3}" if len(unique) > 3 else "")
    return text


def _group(taps):
    out: dict[str, list] = defaultdict(list)
    for points, style in taps:
        out[style].append(points)
    return out
