"""Views of a plan for people: a text summary, Graphviz DOT, and a picture.

A 61-layer plan has hundreds of segments and buffers, so every view groups what a
template repeated (``q0`` .. ``q60`` becomes one row ``q{0..60}``) and states counts
instead of listing everything. The summary is built as data (``Summary``) and then
written as plain text or as rich tables, so tests read the same numbers a terminal
shows. The picture needs matplotlib (the ``draw`` extra), imported only by ``draw``,
through its object API (no pyplot, no global backend switch). This module imports no
torch.
"""

from __future__ import annotations

import enum
import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import attrs

from graphflow.plan import Buffer, Mode, Plan, Segment

__all__ = [
    "Group",
    "ImageFormat",
    "Section",
    "Summary",
    "Table",
    "compact_sizes",
    "draw",
    "format_bytes",
    "format_summary",
    "group_by_template",
    "layout_rows",
    "plural",
    "shown_mode",
    "summarize",
    "to_dot",
    "to_rich",
]

#: How many regions the summary lists before it elides the middle.
_REGIONS_SHOWN = 4


# -- compact forms ---------------------------------------------------------------


def compact_sizes(sizes: Iterable[int]) -> str:
    """Sizes as runs: ``[1, 2, 4, 8, 16, ..., 512]`` -> ``"1, 2, 4, 8..512 step 8"``.

    A run of at least three sizes with a constant step is written as a range; anything
    shorter is listed, so nothing is hidden.
    """
    values = sorted(set(sizes))
    parts: list[str] = []
    i = 0
    while i < len(values):
        j = i + 1
        if j < len(values):
            step = values[j] - values[i]
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
            if j - i + 1 >= 3:
                suffix = "" if step == 1 else f" step {step}"
                parts.append(f"{values[i]}..{values[j]}{suffix}")
                i = j + 1
                continue
        parts.append(str(values[i]))
        i += 1
    return ", ".join(parts)


def format_bytes(n: int | None) -> str:
    """Binary units with one decimal: ``2048`` -> ``"2.0 KiB"``; under 1 KiB, exact; None
    (a size nobody could measure, such as the CPU backend's pool) -> ``"n/a"``."""
    if n is None:
        return "n/a"
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


_DIGITS = re.compile(r"(\d+)")


@attrs.frozen
class Group:
    """Items whose names differ only in the numbers a template put there."""

    label: str
    members: tuple[Any, ...]


def group_by_template(items: Sequence[Any], key: Callable[[Any], object] = lambda item: None,
                      min_size: int = 3) -> list[Group]:
    """Group items named like ``q0, q1, ... q60`` into one ``q{0..60}`` group.

    Names are split at their digit runs; items group when the text around the digits
    and ``key(item)`` (shape, dtype, ...) agree. A varying number is written as
    ``{lo..hi}`` when it covers every value in between, else ``{lo,..,hi}`` with the
    count in the group. Groups smaller than ``min_size`` are kept as single items, so
    two unrelated buffers ``w1`` and ``w2`` keep their own rows. Order follows the
    first member of each group.
    """
    buckets: dict[tuple, list[Any]] = {}
    for item in items:
        parts = _DIGITS.split(item.name)
        texts = tuple(parts[0::2])
        buckets.setdefault((texts, key(item)), []).append(item)
    groups: list[tuple[int, Group]] = []
    position = {id(item): i for i, item in enumerate(items)}
    for (texts, _), members in buckets.items():
        if len(members) < min_size or len(texts) == 1:
            groups.extend((position[id(m)], Group(m.name, (m,))) for m in members)
            continue
        numbers = [_DIGITS.split(m.name)[1::2] for m in members]
        label = texts[0]
        for slot in range(len(texts) - 1):
            values = sorted({int(n[slot]) for n in numbers})
            if len(values) == 1:
                label += numbers[0][slot]
            elif values == list(range(values[0], values[-1] + 1)):
                label += f"{{{values[0]}..{values[-1]}}}"
            else:
                label += f"{{{values[0]},..,{values[-1]}}}"
            label += texts[slot + 1]
        groups.append((position[id(members[0])], Group(label, tuple(members))))
    groups.sort(key=lambda pair: pair[0])
    return [group for _, group in groups]


# -- summary as data ----------------------------------------------------------------


@attrs.frozen
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    #: column indexes aligned right (numbers)
    right: frozenset[int] = frozenset()


@attrs.frozen
class Section:
    title: str
    lines: tuple[str, ...] = ()
    table: Table | None = None


@attrs.frozen
class Summary:
    sections: tuple[Section, ...]


def _buffer_bytes(plan: Plan, buffer: Buffer, size: int | None) -> int | None:
    """The bytes of ``buffer``'s view at one descriptor size, or of its allocation (``size``
    None: what the engine allocates, capacities included); None when its shape names an
    undeclared symbol."""
    try:
        return plan.allocated_bytes(buffer) if size is None else buffer.nbytes(plan.buffer_values(buffer, size))
    except KeyError:
        return None


def plural(n: int, word: str) -> str:
    """``1 segment``, ``1,220 segments``: counts as the summaries print them."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def shown_mode(plan: Plan) -> Mode:
    """The mode whose regions DOT and the picture draw: PIECEWISE unless the plan is FULL only."""
    return Mode.FULL if plan.capture.modes and Mode.PIECEWISE not in plan.capture.modes else Mode.PIECEWISE


def _shape(buffer: Buffer) -> str:
    return "[" + ", ".join(str(d) for d in buffer.shape) + "]"


def _kind_counts(segments: Iterable[Segment]) -> str:
    counts = Counter(s.kind.value for s in segments)
    return ", ".join(f"{counts[k]} {k}" for k in ("graph", "eager") if counts[k])


def _region_line(region) -> str:
    names = region.segments
    body = ", ".join(names) if len(names) <= 3 else f"{names[0]} .. {names[-1]} ({plural(len(names), 'segment')})"
    return f"{region.family}#{region.index}: {body}"


def summarize(plan: Plan) -> Summary:
    """Everything ``graphflow show`` prints about a plan, as sections of lines and tables."""
    sizes = list(plan.capture.all_sizes)
    sections = [_overview(plan, sizes), _segments_section(plan), _streams_section(plan)]
    for mode in (Mode.PIECEWISE, Mode.FULL):
        if mode in plan.capture.modes:
            sections.append(_regions_section(plan, mode, len(sizes)))
    sections.append(_buffers_section(plan, sizes))
    sections.append(_channels_section(plan))
    sections.append(_memory_section(plan, sizes))
    return Summary(tuple(sections))


def _overview(plan: Plan, sizes: list[int]) -> Section:
    settings = plan.capture
    lines = [
        f"model: {plan.model or '(none)'}",
        f"world size: {plan.world_size}",
        f"families: {', '.join(f.name for f in plan.families)}",
    ]
    if plan.symbols:
        lines.append("symbols: " + ", ".join(f"{k}={v}" for k, v in plan.symbols.items()))
    span = f"{sizes[0]}..{sizes[-1]}" if sizes else "none"
    for mode in settings.modes:
        lines.append(
            f"descriptors: {mode.value} x {len(sizes)} sizes {span} ({settings.size_symbol} = {compact_sizes(sizes)})"
        )
    verify = "bit-exact" if settings.atol == 0 and settings.rtol == 0 else f"atol={settings.atol} rtol={settings.rtol}"
    lines.append(f"capture: {settings.warmup_iters} warmup iterations, verify {verify}")
    return Section(f"plan {plan.name}", tuple(lines))


def _segments_section(plan: Plan) -> Section:
    lines = [f"{plural(len(plan.segments), 'segment')}: {_kind_counts(plan.segments)}"]
    for family in plan.families:
        members = plan.family_segments(family.name)
        if members:
            lines.append(f"  {family.name}: {_kind_counts(members)}")
    return Section("segments", tuple(lines))


def _streams_section(plan: Plan) -> Section:
    """Which streams carry how many segments, and what the engine can run side by side.

    A DAG edge between segments on different streams is what the engine turns into an
    event (docs/engine.md, "Streams"); segments on other streams with no path between
    them are the work a captured region overlaps.
    """
    counts = Counter(s.stream for s in plan.segments)
    lines = []
    for stream in plan.streams:
        lines.append(f"{stream.name} ({stream.device}): {plural(counts.pop(stream.name, 0), 'segment')}")
    for name, count in counts.items():
        label = "no stream (the engine's own stream on their device)" if name is None else f"{name} (undeclared)"
        lines.append(f"{label}: {plural(count, 'segment')}")
    stream_of = {s.name: s.stream for s in plan.segments}
    crossing = sum(1 for a, b in plan.dag().edges if stream_of[a] != stream_of[b])
    if crossing:
        verb = "dependency crosses" if crossing == 1 else "dependencies cross"
        lines.append(f"{crossing:,} {verb} streams: each is an event wait, unless another wait already covers it")
    for mode in plan.capture.modes:
        regions = plan.regions(mode)
        several = sum(1 for r in regions if len({stream_of[n] for n in r.segments}) > 1)
        if several:
            verb = "forks" if several == 1 else "fork"
            lines.append(f"{mode.value}: {several} of {plural(len(regions), 'region')} {verb} onto several "
                         "streams inside the graph")
    return Section("streams", tuple(lines) or ("none",))


def _regions_section(plan: Plan, mode: Mode, n_sizes: int) -> Section:
    regions = plan.regions(mode)
    per_family = Counter(r.family for r in regions)
    lines = [
        f"{plural(len(regions), 'region')} ({', '.join(f'{f} {n}' for f, n in per_family.items())}): "
        f"{plural(len(regions), 'graph')} per descriptor, {plural(len(regions) * n_sizes, 'graph')} over "
        f"{plural(n_sizes, 'size')}"
    ]
    if mode is Mode.PIECEWISE:
        elide = len(regions) > _REGIONS_SHOWN + 2  # never elide a single region
        shown = [*regions[:_REGIONS_SHOWN], None, regions[-1]] if elide else list(regions)
        for region in shown:
            if region is None:
                lines.append(f"  ... {len(regions) - _REGIONS_SHOWN - 1} more")
            else:
                lines.append("  " + _region_line(region))
    else:
        for region in regions:
            segments = [plan.segment(name) for name in region.segments]
            eager = sum(1 for s in segments if s is not None and not s.is_graph)
            note = f"; {plural(eager, 'eager segment')} inside (FULL needs none)" if eager else ""
            lines.append(f"  {_region_line(region)}{note}")
    return Section(f"{mode.value} regions", tuple(lines))


def _buffers_section(plan: Plan, sizes: list[int]) -> Section:
    """Buffers grouped by template: the bytes a view at the smallest descriptor uses, and
    the bytes allocated (at the largest size, or the capacity where that is larger)."""
    small = sizes[0] if sizes else None
    sym = plan.capture.size_symbol
    columns = ("name", "count", "shape", "dtype", "device", "role", f"bytes {sym}={small}", "allocated")
    rows = []
    groups = group_by_template(
        plan.buffers, key=lambda b: (b.shape, b.dtype, b.device, b.role, b.alias_of is None)
    )
    for group in groups:
        first = group.members[0]
        role = first.role.value if first.alias_of is None else f"alias of {first.alias_of}"
        cells = []
        for size in (small, None):
            total = 0 if sizes else None
            for member in group.members:
                n = _buffer_bytes(plan, member, size) if sizes else None
                total = None if n is None or total is None else total + n
            cells.append("?" if total is None else format_bytes(total))
        rows.append((group.label, str(len(group.members)), _shape(first), first.dtype, first.device, role, *cells))
    lines = (f"{plural(len(plan.buffers), 'buffer')}; a row of a group shows the group's total bytes",)
    return Section("buffers", lines, Table(columns, tuple(rows), frozenset({1, 6, 7})))


def _channels_section(plan: Plan) -> Section:
    users = Counter(name for s in plan.segments for name in s.channels)
    lines = []
    for family in plan.families:
        owned = [c for c in plan.channels if c.family == family.name]
        if not owned:
            continue
        lines.append(f"{family.name}:")
        for c in owned:
            extra = (f" prewarm={c.prewarm}" if c.prewarm else "") + (" jit" if c.jit else "")
            lines.append(
                f"  {c.name}: {c.kind.value} group={c.group} id={c.id} warmup={c.warmup.value}{extra}, "
                f"used by {plural(users[c.name], 'segment')}"
            )
    orphans = [c for c in plan.channels if plan.family(c.family) is None]
    for c in orphans:
        lines.append(f"  {c.name}: owned by undeclared family {c.family!r}")
    return Section("channels", tuple(lines) or ("none",))


def _memory_section(plan: Plan, sizes: list[int]) -> Section:
    """Static memory as the engine allocates it (``Plan.static_memory``): every buffer that
    owns storage (aliases are views), once, at its allocated shape; per device when the
    plan uses several."""
    if not sizes:
        return Section("memory", ("no descriptors",))
    memory = plan.static_memory()
    total = sum(n for per_device in memory.values() for n in per_device.values())
    unknown = sum(1 for b in plan.buffers if b.alias_of is None) - sum(len(d) for d in memory.values())
    note = f" ({plural(unknown, 'buffer')} with an unknown shape symbol not counted)" if unknown else ""
    lines = [f"static memory, allocated once at {plan.capture.size_symbol}={sizes[-1]} (capacities included): "
             f"{format_bytes(total)} ({total:,} bytes){note}"]
    if len(memory) > 1:
        for device, per_device in memory.items():
            n = sum(per_device.values())
            lines.append(f"  {device}: {format_bytes(n)} ({n:,} bytes)")
    return Section("memory", tuple(lines))


def format_summary(summary: Summary) -> str:
    """The summary as plain text (pipes, files, tests)."""
    out: list[str] = []
    for index, section in enumerate(summary.sections):
        if index:
            out.append("")
        out.append(section.title)
        out.append("-" * len(section.title))
        out.extend(section.lines)
        if section.table is not None:
            out.extend(_format_table(section.table))
    return "\n".join(out) + "\n"


def _format_table(table: Table) -> list[str]:
    widths = [len(c) for c in table.columns]
    for row in table.rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) if i in table.right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded).rstrip()

    return [line(table.columns), line(["-" * w for w in widths]), *(line(row) for row in table.rows)]


def to_rich(summary: Summary):
    """The summary as rich renderables, for a terminal."""
    from rich.console import Group as RichGroup
    from rich.table import Table as RichTable
    from rich.text import Text

    parts: list[Any] = []
    for section in summary.sections:
        parts.append(Text(section.title, style="bold cyan"))
        parts.extend(Text(line) for line in section.lines)
        if section.table is not None:
            table = RichTable(show_edge=False, header_style="bold")
            for i, column in enumerate(section.table.columns):
                table.add_column(column, justify="right" if i in section.table.right else "left")
            for row in section.table.rows:
                table.add_row(*row)
            parts.append(table)
        parts.append(Text(""))
    return RichGroup(*parts)


# -- DOT --------------------------------------------------------------------------------

#: Fill colors of graph segments by family, in the order families are declared.
_PALETTE = ("#4C72B0", "#55A868", "#8172B2", "#CCB974", "#64B5CD", "#937860", "#DA8BC3")
_EAGER = "#C44E52"
_REGION_FILL = "#FFF4CC"
_REGION_EDGE = "#D9B44A"


def _family_colors(plan: Plan) -> dict[str, str]:
    names = [f.name for f in plan.families]
    names += [s.family for s in plan.segments if s.family not in names]
    names = list(dict.fromkeys(names))
    return {name: _PALETTE[i % len(_PALETTE)] for i, name in enumerate(names)}


def _lighten(color: str, amount: float = 0.65) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * amount) for c in (r, g, b))
    return f"#{r:02X}{g:02X}{b:02X}"


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _q(text: str) -> str:
    """A DOT quoted string."""
    return f'"{_escape(text)}"'


def _edge_label(buffers: Sequence[tuple]) -> str:
    return ", ".join(f"{name}@{version}" for name, version, kind in buffers if name is not None)


def to_dot(plan: Plan) -> str:
    """The plan's DAG as Graphviz DOT.

    Graph segments are boxes filled by family; eager breaks are red octagons; each
    PIECEWISE region (FULL, for a FULL-only plan) is a ``cluster_`` subgraph; edges carry ``buffer@version`` and
    are solid for read-after-write, dashed for write-after-read (an in-place update
    waiting for earlier readers) and dotted for declared ``after`` orderings.
    """
    colors = _family_colors(plan)
    dag = plan.dag()
    lines = [
        f"digraph {_q(plan.name)} {{",
        "  rankdir=TB;",
        '  graph [fontname="Helvetica", fontsize=10];',
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=8];',
    ]
    in_region: set[str] = set()
    mode = shown_mode(plan)
    for region in plan.regions(mode):
        ident = re.sub(r"\W", "_", f"cluster_{region.family}_{region.index}")
        lines.append(f"  subgraph {ident} {{")
        lines.append(
            f'    label={_q(f"{mode.value} {region.family}#{region.index}")}; style="rounded,filled"; '
            f'fillcolor="{_REGION_FILL}"; color="{_REGION_EDGE}";'
        )
        for name in region.segments:
            lines.append(f"    {_node(plan.segment(name), colors)}")
            in_region.add(name)
        lines.append("  }")
    for segment in plan.segments:
        if segment.name not in in_region:
            lines.append(f"  {_node(segment, colors)}")
    for source, target, data in dag.edges(data=True):
        kinds = {kind for _, _, kind in data["buffers"]}
        style = "solid" if "raw" in kinds else "dashed" if "war" in kinds else "dotted"
        label = _edge_label(data["buffers"])
        attrs_ = [f"style={style}"] + ([f"label={_q(label)}"] if label else [])
        lines.append(f"  {_q(source)} -> {_q(target)} [{', '.join(attrs_)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _node(segment: Segment, colors: dict[str, str]) -> str:
    lines = [segment.name, *([", ".join(segment.channels)] if segment.channels else [])]
    label = '"' + "\\n".join(_escape(line) for line in lines) + '"'
    if segment.is_graph:
        color = colors[segment.family]
        style = f'shape=box, style="rounded,filled", fillcolor="{_lighten(color)}", color="{color}"'
    else:
        style = f'shape=octagon, style=filled, fillcolor="{_lighten(_EAGER, 0.35)}", color="{_EAGER}"'
    return f"{_q(segment.name)} [label={label}, {style}, tooltip={_q(segment.call)}];"


# -- picture -----------------------------------------------------------------------------


class ImageFormat(enum.Enum):
    PNG = "png"
    SVG = "svg"


#: Layout in inches: box size, gaps, and how many rows a column of the picture holds.
_BOX_W, _BOX_H = 1.5, 0.5
_GAP_X, _GAP_Y = 0.9, 0.35
_ROW_LABEL_W = 0.7
_MAX_ROW = 8
_ROWS_PER_COLUMN = 16


@attrs.frozen
class _Row:
    label: str
    segments: tuple[Segment, ...]


def layout_rows(plan: Plan) -> list[_Row]:
    """Split the step into rows a person reads like lines of text.

    Consecutive segments whose names carry the same numbers (``L3.pre``, ``L3.attn``,
    ``L3.post``) form one row: one row per template block. Rows longer than
    ``_MAX_ROW`` wrap.
    """
    rows: list[_Row] = []
    current: list[Segment] = []
    current_key: tuple | None = None
    for segment in plan.segments:
        key = tuple(_DIGITS.findall(segment.name))
        if current and key != current_key:
            rows.extend(_wrap(current, current_key))
            current = []
        current.append(segment)
        current_key = key
    if current:
        rows.extend(_wrap(current, current_key))
    return rows


def _wrap(segments: list[Segment], key: tuple | None) -> list[_Row]:
    prefixes = {re.match(r"\D*\d+", s.name).group(0) for s in segments} if key else set()
    label = prefixes.pop() if len(prefixes) == 1 else "/".join(key or ())
    return [_Row(label, tuple(segments[i:i + _MAX_ROW])) for i in range(0, len(segments), _MAX_ROW)]


def draw(plan: Plan, path: str, image_format: ImageFormat) -> None:
    """Draw the plan's step as a PNG or SVG picture at ``path``.

    One row per template block, step order left to right then top to bottom (many
    rows wrap into several columns); graph segments are boxes colored by family, eager
    breaks red diamonds, PIECEWISE regions (FULL ones for a FULL-only plan) light
    rounded rectangles behind their segments, labeled ``R<index>`` on every piece (a region that goes on to the next
    row ends in ``→``). Arrows join neighbours in a row that the DAG connects, labeled
    ``buffer@version`` while the plan is small enough to read them; ``graphflow show
    --format dot`` has every edge. Shapes go into one collection per kind, so a
    61-layer plan draws in about a second.
    """
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import FancyBboxPatch, Patch, Polygon

    rows = layout_rows(plan)
    n_columns = max(1, math.ceil(len(rows) / _ROWS_PER_COLUMN))
    rows_per_column = max(1, math.ceil(len(rows) / n_columns))
    row_len = max((len(r.segments) for r in rows), default=1)
    column_w = _ROW_LABEL_W + row_len * _BOX_W + (row_len - 1) * _GAP_X + 0.5
    width = max(8.0, n_columns * column_w + 0.4)
    header_h, legend_h = 1.0, 0.5
    rows_bottom = header_h + rows_per_column * (_BOX_H + _GAP_Y)
    height = rows_bottom + legend_h
    labelled = len(rows) <= _ROWS_PER_COLUMN

    fig = Figure(figsize=(width, height), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")

    colors = _family_colors(plan)
    dag = plan.dag()
    mode = shown_mode(plan)
    regions = plan.regions(mode)
    region_of = {name: (r.family, r.index) for r in regions for name in r.segments}
    region_last = {r.segments[-1] for r in regions}
    one_family = len({r.family for r in regions}) <= 1

    sizes = list(plan.capture.all_sizes)
    modes = ", ".join(f"{m.value} x {len(sizes)}" for m in plan.capture.modes)
    ax.text(0.2, 0.3, plan.name, fontsize=14, fontweight="bold", va="center")
    ax.text(0.2, 0.58, f"{len(plan.segments)} segments ({_kind_counts(plan.segments)}), "
            f"{plural(len(regions), mode.value + ' region')}, {plural(len(plan.buffers), 'buffer')}, "
            f"{plural(len(plan.channels), 'channel')}", fontsize=9, va="center", color="#333333")
    ax.text(0.2, 0.78, f"descriptors: {modes} ({plan.capture.size_symbol} = {compact_sizes(sizes)})",
            fontsize=9, va="center", color="#333333")

    region_patches, boxes, box_colors, diamonds = [], [], [], []
    arrows: dict[bool, list] = {False: [], True: []}  # dashed -> shaft segments
    heads: list[tuple[float, float]] = []
    for index, row in enumerate(rows):
        column, slot = divmod(index, rows_per_column)
        x0 = 0.2 + column * column_w
        y = header_h + slot * (_BOX_H + _GAP_Y) + _GAP_Y / 2 + _BOX_H / 2
        ax.text(x0 + _ROW_LABEL_W - 0.15, y, row.label, ha="right", va="center", fontsize=8, color="#666666")
        xs = [x0 + _ROW_LABEL_W + i * (_BOX_W + _GAP_X) for i in range(len(row.segments))]
        for key, first, last in _region_pieces(row, region_of):
            left, right = xs[first] - 0.1, xs[last] + _BOX_W + 0.1
            region_patches.append(FancyBboxPatch((left, y - _BOX_H / 2 - 0.1), right - left, _BOX_H + 0.2,
                                                 boxstyle="round,pad=0,rounding_size=0.1"))
            name = f"R{key[1]}" if one_family else f"{key[0]} R{key[1]}"
            goes_on = row.segments[last].name not in region_last
            ax.text(left + 0.04, y - _BOX_H / 2 - 0.09, name + (" →" if goes_on else ""),
                    fontsize=5.5, color="#8A6D1A", va="top", zorder=2)
        for k, segment in enumerate(row.segments):
            cx = xs[k] + _BOX_W / 2
            if segment.is_graph:
                boxes.append(FancyBboxPatch((xs[k], y - _BOX_H / 2), _BOX_W, _BOX_H,
                                            boxstyle="round,pad=0,rounding_size=0.08"))
                box_colors.append(colors[segment.family])
            else:
                hw, hh = _BOX_W / 2, _BOX_H / 2 + 0.05
                diamonds.append(Polygon([(cx - hw, y), (cx, y - hh), (cx + hw, y), (cx, y + hh)], closed=True))
            text = segment.name if not segment.channels else f"{segment.name}\n⇄ {', '.join(segment.channels)}"
            ax.text(cx, y, text, ha="center", va="center", fontsize=7.5 if not segment.channels else 6.5, zorder=4)
            if k and dag.has_edge(row.segments[k - 1].name, segment.name):
                data = dag.edges[row.segments[k - 1].name, segment.name]["buffers"]
                start, end = xs[k - 1] + _BOX_W + 0.02, xs[k] - 0.06
                arrows[all(kind != "raw" for _, _, kind in data)].append([(start, y), (end, y)])
                heads.append((end, y))
                label = _edge_label(data)
                if labelled and label:
                    label = label if len(label) <= 18 else label[:16] + "…"
                    ax.text((start + end) / 2, y - 0.06, label, ha="center", va="bottom", fontsize=5.5,
                            color="#444444", zorder=4)

    ax.add_collection(PatchCollection(region_patches, facecolor=_REGION_FILL, edgecolor=_REGION_EDGE,
                                      linewidth=0.8, zorder=1))
    ax.add_collection(PatchCollection(boxes, facecolor=[_lighten(c) for c in box_colors], edgecolor=box_colors,
                                      linewidth=1.2, zorder=3))
    ax.add_collection(PatchCollection(diamonds, facecolor=_lighten(_EAGER, 0.45), edgecolor=_EAGER,
                                      linewidth=1.2, zorder=3))
    for dashed, segments in arrows.items():
        ax.add_collection(LineCollection(segments, colors="#555555", linewidths=0.9,
                                         linestyles="--" if dashed else "-", zorder=2))
    if heads:
        ax.plot(*zip(*heads), linestyle="", marker=">", markersize=4, color="#555555", zorder=2)

    handles = [Patch(facecolor=_lighten(c), edgecolor=c, label=f"graph segment ({f})") for f, c in colors.items()
               if any(s.family == f and s.is_graph for s in plan.segments)]
    if diamonds:
        handles.append(Line2D([], [], marker="D", linestyle="", markersize=8, markerfacecolor=_lighten(_EAGER, 0.45),
                              markeredgecolor=_EAGER, label="eager break"))
    if region_patches:
        handles.append(Patch(facecolor=_REGION_FILL, edgecolor=_REGION_EDGE, label=f"{mode.value} region = one graph"))
    handles.append(Line2D([], [], color="#555555", marker=">", markersize=4, label="dataflow (buffer@version)"))
    handles.append(Line2D([], [], color="#555555", linestyle="--", label="in-place order (write after read)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.15 / width, 1 - (rows_bottom + 0.05) / height),
              ncol=min(len(handles), max(1, int(width // 2.6))), fontsize=8, frameon=False)
    fig.savefig(path, format=image_format.value)


def _region_pieces(row: _Row, region_of: dict) -> Iterator[tuple[tuple[str, int], int, int]]:
    """Each region's run of segments in this row: (region key, first, last index)."""
    i = 0
    while i < len(row.segments):
        key = region_of.get(row.segments[i].name)
        j = i
        while key is not None and j + 1 < len(row.segments) and region_of.get(row.segments[j + 1].name) == key:
            j += 1
        if key is not None:
            yield key, i, j
        i = j + 1
