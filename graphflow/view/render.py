"""Views of a plan for people: a text summary and Graphviz DOT (the picture is ``graphflow.view.picture``).

A 61-layer plan has hundreds of segments and buffers, so every view groups what a
template repeated (``q0`` .. ``q60`` becomes one row ``q{0..60}``) and states counts
instead of listing everything. The summary is built as data (``Summary``) and then
written as plain text or as rich tables, so tests read the same numbers a terminal
shows. This module imports neither torch nor matplotlib.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import attrs

from graphflow.plan import Buffer, Mode, Plan, Segment
from graphflow.view.style import EAGER, REGION_EDGE, REGION_FILL, family_colors, lighten
from graphflow.units import compact_sizes, format_bytes, group_by_template, plural

__all__ = [
    "Section",
    "Summary",
    "SummaryTable",
    "format_summary",
    "kind_counts",
    "shown_mode",
    "summarize",
    "to_dot",
    "to_rich",
]

#: How many regions the summary lists before it elides the middle.
_REGIONS_SHOWN = 4


# -- summary as data ----------------------------------------------------------------


@attrs.frozen
class SummaryTable:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    #: column indexes aligned right (numbers)
    right: frozenset[int] = frozenset()


@attrs.frozen
class Section:
    title: str
    lines: tuple[str, ...] = ()
    table: SummaryTable | None = None


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


def shown_mode(plan: Plan) -> Mode:
    """The mode whose regions DOT and the picture draw: PIECEWISE unless the plan is FULL only."""
    return Mode.FULL if plan.capture.modes and Mode.PIECEWISE not in plan.capture.modes else Mode.PIECEWISE


def _shape(buffer: Buffer) -> str:
    return "[" + ", ".join(str(d) for d in buffer.shape) + "]"


def kind_counts(segments: Iterable[Segment]) -> str:
    counts = Counter(s.kind.value for s in segments)
    return ", ".join(f"{counts[k]:,} {k}" for k in ("graph", "eager") if counts[k])


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
    lines = [f"{plural(len(plan.segments), 'segment')}: {kind_counts(plan.segments)}"]
    for family in plan.families:
        members = plan.family_segments(family.name)
        if members:
            lines.append(f"  {family.name}: {kind_counts(members)}")
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
        cut = [s for s in plan.segments if s.is_graph and s.breaks]
        for segment in cut:  # how many calls a break gets is known only once the model runs
            lines.append(f"  {segment.name} breaks at {', '.join(segment.breaks)}: one more graph per call, the "
                         "call eager between")
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
    return Section("buffers", lines, SummaryTable(columns, tuple(rows), frozenset({1, 6, 7})))


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


def _format_table(table: SummaryTable) -> list[str]:
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

def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def _q(text: str) -> str:
    """A DOT quoted string."""
    return f'"{_escape(text)}"'


def _edge_label(buffers: Sequence[tuple]) -> str:
    return ", ".join(f"{name}@{version}" for name, version, kind in buffers if name is not None)


def to_dot(plan: Plan) -> str:
    """The plan's DAG as Graphviz DOT.

    Graph segments are boxes filled by family (a PIECEWISE one cut at ``breaks``: a record
    of its graph pieces and the eager breaks between); eager breaks are red octagons; each
    PIECEWISE region (FULL, for a FULL-only plan) is a ``cluster_`` subgraph; edges carry ``buffer@version`` and
    are solid for read-after-write, dashed for write-after-read (an in-place update
    waiting for earlier readers) and dotted for declared ``after`` orderings.
    """
    colors = family_colors(plan)
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
        cut = dict.fromkeys(p for n in region.segments for p in plan.segment(n).breaks
                            if mode is Mode.PIECEWISE and plan.segment(n).is_graph)
        title = f"{mode.value} {region.family}#{region.index}" + (f", cut at {', '.join(cut)}" if cut else "")
        lines.append(
            f'    label={_q(title)}; style="rounded,filled"; '
            f'fillcolor="{REGION_FILL}"; color="{REGION_EDGE}";'
        )
        for name in region.segments:
            lines.append(f"    {_node(plan.segment(name), colors, cut=mode is Mode.PIECEWISE)}")
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


def _record(text: str) -> str:
    """A record field's text: DOT reads ``{}|<>`` there as structure, and ``"`` ends the string."""
    return re.sub(r'([{}|<>"\\])', r"\\\1", text)


def _node(segment: Segment, colors: dict[str, str], cut: bool = False) -> str:
    lines = [segment.name, *([", ".join(segment.channels)] if segment.channels else [])]
    label = '"' + "\\n".join(_escape(line) for line in lines) + '"'
    if cut and segment.is_graph and segment.breaks:
        # PIECEWISE makes a graph per piece: the node shows them, the breaks eager between,
        # so the DOT view counts graphs as ``graphflow show`` does.
        color = colors[segment.family]
        at = ", ".join(segment.breaks)
        pieces = f"graph|eager: {at}|graph …" if any("*" in p for p in segment.breaks) else \
            "|".join(["graph", *(f"eager: {p}|graph" for p in segment.breaks)])
        fields = "|".join(_record(f) for f in pieces.split("|"))
        label = '"{' + _record(" · ".join(lines)) + "|{" + fields + "}|" + _record(
            f"graph pieces cut at {at} (eager)") + '}"'
        return (f'{_q(segment.name)} [shape=record, label={label}, style="rounded,filled", '
                f'fillcolor="{lighten(color)}", color="{color}", tooltip={_q(segment.call)}];')
    if segment.is_graph:
        color = colors[segment.family]
        style = f'shape=box, style="rounded,filled", fillcolor="{lighten(color)}", color="{color}"'
    else:
        style = f'shape=octagon, style=filled, fillcolor="{lighten(EAGER, 0.35)}", color="{EAGER}"'
    return f"{_q(segment.name)} [label={label}, {style}, tooltip={_q(segment.call)}];"
