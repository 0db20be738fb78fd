"""The validator: one table of rules, run on a plan before any GPU work.

Every rule is a small pure function of the plan, registered with ``@_rule(code,
severity, title)``. Its docstring says which failure it prevents (first paragraph) and
how to fix it (the paragraph that starts ``Fix:``); ``graphflow rules`` and
``docs/rules.md`` are generated from those docstrings, so they cannot drift.

A rule yields ``Violation`` objects (element, message, fix); the registration wraps it
so that ``Rule.check(plan)`` yields complete ``Diagnostic`` objects with code,
severity and the element's declaration origin.

Rules judge how a plan's values fit together. What one value may be (a dtype, a
device spelled ``cuda:N``, ``warmup_iters >= 1``) is checked when the plan is built, by
its fields (``graphflow.plan.fields``), for YAML, Python and decorated plans alike; so a rule
never sees a value of the wrong type. Rules run on broken plans too: each tolerates
what another rule reports (an undeclared buffer, an unknown symbol, a cycle) and skips
it instead of crashing, so one ``graphflow validate`` shows every problem at once.

Codes of rules that were removed are listed in ``RETIRED`` and never reused. This
module imports no torch.
"""

from __future__ import annotations

import collections
import enum
import functools
import inspect
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import attrs
import networkx as nx

from graphflow.plan.model import (
    Buffer,
    BufferRole,
    Mode,
    Origin,
    Plan,
    Segment,
    WarmupPolicy,
    dim_symbols,
)
from graphflow.units import format_bytes, heaviest

__all__ = ["Diagnostic", "Violation", "MEMORY_CEILING", "RETIRED", "Report", "Rule", "RULES", "Severity",
           "rules_markdown", "unknown_codes", "validate"]

#: Bytes of static buffers no device made today holds (the largest GPUs hold under
#: 300 GB): 1 TiB, generous on purpose, so GF304 fires only on a plan no GPU can run
#: (a batch size of 10**9, a capacity with a digit too many).
MEMORY_CEILING = 1 << 40

#: Codes of rules that were removed, never to be reused, and what checks each failure now.
RETIRED: Mapping[str, str] = {
    "GF111": "unknown dtype: now rejected when the plan is read or built (Buffer.dtype)",
    "GF606": "bad capture settings: warmup_iters >= 1, verify tolerances >= 0 and a positive "
             "barrier_timeout_s are now checked when the plan is read or built (CaptureSettings)",
}


class Severity(enum.Enum):
    ERROR = "error"  # the plan cannot be captured correctly; ``graphflow validate`` exits 1
    WARNING = "warning"  # probably a mistake, harmless to capture


@attrs.frozen
class Diagnostic:
    """One finding of one rule: what is wrong, where, and how to fix it."""

    code: str
    severity: Severity
    element: str
    message: str
    fix: str | None = None
    origin: Origin | None = None

    def __str__(self) -> str:
        where = f"{self.origin}: " if self.origin is not None else ""
        fix = f" — {self.fix}" if self.fix else ""
        return f"{where}{self.code} {self.severity.value} {self.element}: {self.message}{fix}"

    def to_json(self) -> dict:
        return {
            "code": self.code,
            "severity": self.severity.value,
            "element": self.element,
            "message": self.message,
            "fix": self.fix,
            "file": self.origin.file if self.origin is not None else None,
            "line": self.origin.line if self.origin is not None else None,
        }


@attrs.frozen
class Violation:
    """What a rule function yields: the element (kind and name), message and fix.

    ``name`` is None for elements that have no name (``capture``, ``plan``); ``at`` then
    names the key whose declaration line the diagnostic points to (``capture:sizes``).
    """

    kind: str
    name: str | None
    message: str
    fix: str | None = None
    at: str | None = None

    @property
    def element(self) -> str:
        return self.kind if self.name is None else f"{self.kind} {self.name}"


def _rule_doc(rule: Rule) -> str:
    return inspect.getdoc(rule.check) or ""


@attrs.frozen
class Rule:
    """A row of the rule table; ``doc`` explains the failure the rule prevents.

    ``check(plan, device_memory=None)`` yields the rule's diagnostics; ``device_memory``
    (bytes per GPU) is a figure the plan does not hold, which the rules that need it read.
    """

    code: str
    severity: Severity
    check: Callable[..., Iterable[Diagnostic]]
    title: str
    doc: str = attrs.field(default=attrs.Factory(_rule_doc, takes_self=True))

    @property
    def prevents(self) -> str:
        """The doc without its ``Fix:`` paragraph, on one line."""
        return " ".join(p for p in _paragraphs(self.doc) if not p.startswith("Fix:"))

    @property
    def how_to_fix(self) -> str:
        return " ".join(p.removeprefix("Fix:").strip() for p in _paragraphs(self.doc) if p.startswith("Fix:"))


def _paragraphs(doc: str) -> list[str]:
    return [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]


_TABLE: list[Rule] = []


def _rule(code: str, severity: Severity, title: str):
    """Register a rule function: it yields Findings, ``Rule.check`` yields Diagnostics.

    A rule that needs the device memory declares a ``device_memory`` parameter; the
    others take the plan alone.
    """

    def register(find: Callable[..., Iterable[Violation]]) -> Callable[..., Iterator[Diagnostic]]:
        wants_memory = "device_memory" in inspect.signature(find).parameters

        @functools.wraps(find)
        def check(plan: Plan, *, device_memory: int | None = None) -> Iterator[Diagnostic]:
            found = find(plan, device_memory=device_memory) if wants_memory else find(plan)
            for finding in found:
                key = finding.at if finding.at is not None else finding.name
                origin = plan.origin(finding.kind, key) if key is not None else None
                yield Diagnostic(code, severity, finding.element, finding.message, finding.fix, origin)

        _TABLE.append(Rule(code, severity, check, title))
        return check

    return register


@attrs.frozen
class Report:
    """Every diagnostic of one plan, sorted by declaration line then code."""

    plan_name: str
    diagnostics: tuple[Diagnostic, ...] = attrs.field(converter=tuple)

    @property
    def errors(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity is Severity.ERROR)

    @property
    def warnings(self) -> tuple[Diagnostic, ...]:
        return tuple(d for d in self.diagnostics if d.severity is Severity.WARNING)

    @property
    def ok(self) -> bool:
        return not self.errors

    def codes(self) -> tuple[str, ...]:
        return tuple(d.code for d in self.diagnostics)

    def to_json(self) -> dict:
        return {
            "plan": self.plan_name,
            "ok": self.ok,
            "errors": len(self.errors),
            "warnings": len(self.warnings),
            "diagnostics": [d.to_json() for d in self.diagnostics],
        }


def validate(plan: Plan, *, disable: Iterable[str] = (), device_memory: int | None = None) -> Report:
    """Run every rule except the ``disable``d codes, once per plan and arguments (a plan
    is immutable: asked again, the same report).

    ``device_memory`` is the memory of one GPU in bytes, for GF303; without it, only
    plans beyond any GPU (GF304) are flagged. Raises ValueError on an unknown or
    retired code, or a device memory that is not a positive int.
    """
    disabled = set(disable)
    unknown = disabled - {rule.code for rule in RULES}
    if unknown:
        raise ValueError(unknown_codes(unknown))
    if device_memory is not None and (not isinstance(device_memory, int) or isinstance(device_memory, bool)
                                      or device_memory <= 0):
        raise ValueError(f"device_memory must be a positive number of bytes, got {device_memory!r}")
    key = (frozenset(disabled), device_memory)
    if key not in plan._reports:  # noqa: SLF001 - the plan keeps its reports, computed here
        found = [d for rule in RULES if rule.code not in disabled
                 for d in rule.check(plan, device_memory=device_memory)]
        found.sort(key=_sort_key)
        plan._reports[key] = Report(plan.name, tuple(found))  # noqa: SLF001
    return plan._reports[key]  # noqa: SLF001


def unknown_codes(codes: Iterable[str]) -> str:
    """What to tell someone who names codes no rule has: retired ones say what checks them now."""
    codes = sorted(codes)
    retired = [f"{code} is retired ({RETIRED[code]})" for code in codes if code in RETIRED]
    unknown = [code for code in codes if code not in RETIRED]
    parts = [f"unknown rule code{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (see 'graphflow rules')"
             ] if unknown else []
    return "; ".join(parts + retired)


def _sort_key(diagnostic: Diagnostic) -> tuple:
    origin = diagnostic.origin
    return (origin.file, origin.line, diagnostic.code) if origin is not None else ("", 0, diagnostic.code)


# -- shared helpers ------------------------------------------------------------------------
# Each tolerates broken plans: undeclared names resolve to None, bad shapes to None.

_GPU = re.compile(r"cuda:\d+")
_NON_COMMUNICATING = (WarmupPolicy.PLACEHOLDER, WarmupPolicy.PREPARE)


def _describe(segment: Segment) -> str:
    return f"{segment.kind.value} segment {segment.name}"


def _names(names: Iterable[str], limit: int = 3) -> str:
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, … ({len(names)} in all)"


def _duplicates(items: Iterable[str]) -> list[str]:
    counts = collections.Counter(items)
    return [name for name, n in counts.items() if n > 1]


def _sizes(plan: Plan) -> list[int]:
    """The descriptor sizes of every captured mode, and of every list the plan declares."""
    return sorted({s for _, sizes in _size_lists(plan) for s in sizes})


def _size_lists(plan: Plan) -> list[tuple[str, tuple]]:
    """Each list of sizes the plan declares, with the key it is written under."""
    capture = plan.capture
    lists = [(f"capture.sizes.{m.value}", tuple(v)) for m, v in capture.mode_sizes.items()]
    if not capture.mode_sizes or any(m not in capture.mode_sizes for m in capture.modes):
        lists.insert(0, ("capture.sizes", tuple(capture.sizes)))
    return lists


def _known_symbols(plan: Plan) -> set[str]:
    return {*plan.symbols, plan.capture.size_symbol}


def _nbytes(plan: Plan, buffer: Buffer) -> int | None:
    """Bytes the engine allocates for a buffer, or None without sizes or with an unknown symbol."""
    if not _sizes(plan) or not set(buffer.symbols()) <= _known_symbols(plan):
        return None
    return plan.allocated_bytes(buffer, max(_sizes(plan)))


def _roles(plan: Plan, name: str) -> set[BufferRole]:
    """The roles of a buffer and of every buffer its alias chain views."""
    return {b.role for b in map(plan.buffer, plan.alias_chain(name)) if b is not None}


def _home_device(plan: Plan, segment: Segment) -> str | None:
    """Where a segment's work lives: declared, else where most of its buffers are.

    Ties go to the stream's device. Blaming the buffers' majority (not the stream) makes
    a stream on the wrong device one diagnostic (GF402) rather than one per buffer.
    """
    if segment.device is not None:
        return segment.device
    devices = [b.device for b in (plan.buffer(n) for n in dict.fromkeys((*segment.reads, *segment.writes))) if b]
    if devices:
        counts = collections.Counter(devices)
        top = max(counts.values())
        stream = plan.stream(segment.stream)
        if stream is not None and counts.get(stream.device) == top:
            return stream.device
        return next(d for d in devices if counts[d] == top)
    stream = plan.stream(segment.stream)
    return stream.device if stream is not None else None


def _is_copy(plan: Plan, segment: Segment) -> bool:
    """An eager segment touching buffers on several devices: an explicit copy."""
    devices = {b.device for b in (plan.buffer(n) for n in (*segment.reads, *segment.writes)) if b}
    return not segment.is_graph and len(devices) > 1


def _ranks(plan: Plan, segment: Segment) -> frozenset[int]:
    return frozenset(r for r in range(plan.world_size) if segment.runs_on(r))


def _capture_modes(plan: Plan) -> list[Mode]:
    return [m for m in (Mode.PIECEWISE, Mode.FULL) if m in plan.capture.modes]


# -- structure: GF1xx ----------------------------------------------------------------------


@_rule("GF101", Severity.ERROR, "undeclared buffer")
def undeclared_buffers(plan: Plan) -> Iterator[Violation]:
    """A segment reads or writes, or a buffer aliases, a name that no buffer declares.

    The engine allocates declared buffers only, so capture would fail on a missing
    tensor, or a typo would silently split one buffer into two.

    Fix: declare the buffer under ``buffers`` or correct the name.
    """
    for segment in plan.segments:
        for verb, names in (("read", segment.reads), ("written", segment.writes)):
            for name in dict.fromkeys(names):
                if plan.buffer(name) is None:
                    yield Violation("segment", segment.name,
                                  f"'{name}' is {verb} by {_describe(segment)} but no buffer '{name}' is declared",
                                  "declare it under buffers or fix the name")
    for buffer in plan.buffers:
        if buffer.alias_of is not None and plan.buffer(buffer.alias_of) is None:
            yield Violation("buffer", buffer.name,
                          f"buffer '{buffer.name}' is an alias of '{buffer.alias_of}', which is not declared",
                          "declare the target buffer or fix alias_of")
    reference = plan.reference
    if reference is not None:
        for name in dict.fromkeys((*reference.inputs.values(), *reference.returns)):
            if plan.buffer(name) is None:
                yield Violation("reference", None, f"'{name}' is named by the reference {reference.call} but no buffer "
                              f"'{name}' is declared", "declare it under buffers or fix the name", at="reference")


@_rule("GF102", Severity.ERROR, "undeclared stream")
def undeclared_streams(plan: Plan) -> Iterator[Violation]:
    """A segment names a stream that no stream declares.

    Capture would fall back to an implicit stream, which on any GPU but the first
    records an empty graph or replays stale data.

    Fix: declare the stream under ``streams`` with its device, or correct the name.
    """
    for segment in plan.segments:
        if segment.stream is not None and plan.stream(segment.stream) is None:
            yield Violation("segment", segment.name,
                          f"{_describe(segment)} runs on stream '{segment.stream}', which is not declared",
                          "declare it under streams with its device or fix the name")


@_rule("GF103", Severity.ERROR, "undeclared channel")
def undeclared_channels(plan: Plan) -> Iterator[Violation]:
    """A segment uses a channel that no channel declares.

    An undeclared channel has no owner, id or warmup policy, so the engine cannot
    assign it, warm it up or roll it back.

    Fix: declare the channel under ``channels`` or correct the name.
    """
    for segment in plan.segments:
        for name in dict.fromkeys(segment.channels):
            if plan.channel(name) is None:
                yield Violation("segment", segment.name,
                              f"{_describe(segment)} uses channel '{name}', which is not declared",
                              "declare it under channels with its family and id, or fix the name")


@_rule("GF104", Severity.ERROR, "duplicate name")
def duplicate_names(plan: Plan) -> Iterator[Violation]:
    """Two elements of one kind share a name (often a ``for_each`` template that forgot
    its variable).

    Lookups find only the first, so the second is silently ignored: its shape, stream
    or channel never takes effect, and DAG nodes merge.

    Fix: rename one of them (use the template variable, e.g. ``x{layer}``).
    """
    for kind, items in (("buffer", plan.buffers), ("stream", plan.streams), ("channel", plan.channels),
                        ("segment", plan.segments), ("family", plan.families), ("prewarm", plan.prewarm)):
        counts = collections.Counter(item.name for item in items)
        for name in _duplicates(item.name for item in items):
            yield Violation(kind, name, f"{kind} '{name}' is declared {counts[name]} times",
                          "rename the duplicates; a templated name needs its variable, e.g. 'x{layer}'")


@_rule("GF105", Severity.ERROR, "cycle")
def cycles(plan: Plan) -> Iterator[Violation]:
    """The DAG has a cycle: ``after`` edges (or a segment after itself) contradict the
    dataflow order.

    No execution order satisfies it, so the step would deadlock waiting on events or
    run with the order silently broken.

    Fix: remove the ``after`` entry that closes the cycle.
    """
    dag = plan.dag()
    order = {s.name: i for i, s in enumerate(plan.segments)}
    for component in nx.strongly_connected_components(dag):
        if len(component) > 1:
            members = sorted(component, key=lambda n: order.get(n, 0))
            cycle = nx.find_cycle(dag.subgraph(component), source=members[0])
            path = " -> ".join([edge[0] for edge in cycle] + [cycle[0][0]])
            yield Violation("segment", members[0], f"segments {path} form a cycle",
                          "remove the `after` entry that closes it")
    for segment in plan.segments:
        if segment.name in segment.after:
            yield Violation("segment", segment.name, f"{_describe(segment)} is declared after itself",
                          f"remove '{segment.name}' from its `after` list")


@_rule("GF106", Severity.ERROR, "unknown shape symbol")
def bad_shapes(plan: Plan) -> Iterator[Violation]:
    """A buffer shape names a symbol that is neither the size symbol nor declared under
    ``symbols``.

    The engine could not size the buffer for each descriptor, so allocation would fail.
    (How a dimension is spelled, and that an int one is at least 1, is checked when the
    plan is read.)

    Fix: declare the symbol under ``symbols``, or use the size symbol, e.g. ``[B, 1024]``
    or ``["2*B", H]``.
    """
    known = _known_symbols(plan)
    for buffer in plan.buffers:
        for index, dim in enumerate(buffer.shape):
            unknown = [s for s in dim_symbols(dim) if s not in known]
            if unknown:
                yield Violation("buffer", buffer.name,
                              f"buffer '{buffer.name}' shape {list(buffer.shape)}: dimension {index} ({dim!r}) "
                              f"uses unknown symbol {', '.join(unknown)}",
                              f"declare it under symbols, or use a declared symbol ({', '.join(sorted(known))})")


@_rule("GF107", Severity.ERROR, "undeclared family")
def undeclared_families(plan: Plan) -> Iterator[Violation]:
    """A segment or channel names a family that no family declares.

    Its segments belong to no capture region, so they would never be captured, and a
    channel owned by no family is never assigned or rolled back.

    Fix: declare the family under ``families`` or correct the name.
    """
    for segment in plan.segments:
        if plan.family(segment.family) is None:
            yield Violation("segment", segment.name,
                          f"{_describe(segment)} belongs to family '{segment.family}', which is not declared",
                          "declare it under families or fix the name")
    for channel in plan.channels:
        if plan.family(channel.family) is None:
            yield Violation("channel", channel.name,
                          f"channel {channel.name} is owned by family '{channel.family}', which is not declared",
                          "declare it under families or fix the name")


@_rule("GF108", Severity.ERROR, "undeclared prewarm hook")
def undeclared_prewarm(plan: Plan) -> Iterator[Violation]:
    """A channel's ``prewarm`` names a hook that no prewarm entry declares.

    The JIT specialization would stay cold and its first launch would happen inside
    capture, where a kernel that refuses a cold launch under capture fails it.

    Fix: declare the hook under ``prewarm`` with its ``call``, or correct the name.
    """
    for channel in plan.channels:
        if channel.prewarm is not None and plan.hook(channel.prewarm) is None:
            yield Violation("channel", channel.name,
                          f"channel {channel.name} names prewarm hook '{channel.prewarm}', which is not declared",
                          "declare it under prewarm with its call, or fix the name")


@_rule("GF109", Severity.ERROR, "unknown `after` segment")
def unknown_after(plan: Plan) -> Iterator[Violation]:
    """A segment's ``after`` names a segment that does not exist.

    The ordering the author relied on is silently absent from the DAG.

    Fix: name an existing segment, or remove the entry.
    """
    for segment in plan.segments:
        for name in dict.fromkeys(segment.after):
            if plan.segment(name) is None:
                yield Violation("segment", segment.name,
                              f"{_describe(segment)} is declared after '{name}', which is not a segment",
                              "name an existing segment or remove the entry")


@_rule("GF110", Severity.ERROR, "`after` contradicts list order")
def after_order(plan: Plan) -> Iterator[Violation]:
    """A segment is declared ``after`` a segment listed below it.

    Segments run in the order listed, so the declared order is never honoured.
    (Contradictions that close a data cycle are GF105.)

    Fix: move the segment below the one it must follow, or remove the entry.
    """
    position = {}
    for index, segment in enumerate(plan.segments):
        position.setdefault(segment.name, index)
    component_of = {n: i for i, c in enumerate(nx.strongly_connected_components(plan.dag())) for n in c}
    for index, segment in enumerate(plan.segments):
        for name in dict.fromkeys(segment.after):
            later = position.get(name, -1) > index
            if later and component_of.get(name) != component_of.get(segment.name):
                yield Violation("segment", segment.name,
                              f"{_describe(segment)} is declared after {name}, which is listed below it",
                              f"move {segment.name} below {name} (segments run in the order listed)")


@_rule("GF112", Severity.ERROR, "stream not on a GPU")
def bad_devices(plan: Plan) -> Iterator[Violation]:
    """A stream is declared on the CPU.

    Capture records the work queued on a GPU stream; a plan whose streams are on the
    CPU runs only on the engine's CPU backend (tests), never captures a graph.

    Fix: put the stream on the GPU of the segments that use it, e.g. ``cuda:0``.
    """
    for stream in plan.streams:
        if not _GPU.fullmatch(stream.device):
            yield Violation("stream", stream.name, f"stream {stream.name} has device '{stream.device}'",
                          "a capture stream lives on a GPU: write cuda:N")


@_rule("GF113", Severity.ERROR, "bad ranks")
def bad_ranks(plan: Plan) -> Iterator[Violation]:
    """A segment's ``ranks`` names a rank outside ``0..world_size-1``, or no rank at all.

    Per-rank collective orders (GF505) and rank-aware dataflow would be computed over
    ranks that do not exist, and a segment on no rank silently never runs.

    Fix: set ``world_size`` to the number of ranks and list ranks below it.
    """
    for segment in plan.segments:
        if segment.ranks is None:
            continue
        outside = [r for r in segment.ranks if r >= plan.world_size]
        if outside:
            yield Violation("segment", segment.name,
                          f"{_describe(segment)} runs on rank(s) {', '.join(map(str, outside))} "
                          f"but world_size is {plan.world_size}",
                          f"list ranks in 0..{plan.world_size - 1} or raise world_size")
        elif not segment.ranks:
            yield Violation("segment", segment.name, f"{_describe(segment)} runs on no rank (ranks is empty)",
                          "list its ranks, or drop `ranks` to run on every rank")


@_rule("GF114", Severity.ERROR, "keyword argument given twice")
def repeated_keywords(plan: Plan) -> Iterator[Violation]:
    """A segment or the reference passes one keyword argument from two of ``inputs``,
    ``objects`` and ``constants``.

    Only one value could reach the callable; which one the author meant is a guess.

    Fix: give each argument in one place.
    """
    calls = [("segment", s.name, s, None) for s in plan.segments]
    if plan.reference is not None:
        calls.append(("reference", None, plan.reference, "reference"))
    for kind, name, call, at in calls:
        given: dict[str, str] = {}
        for where in ("inputs", "objects", "constants"):
            for keyword in getattr(call, where):
                if keyword in given:
                    yield Violation(kind, name, f"argument '{keyword}' of {call.call} is given by {given[keyword]} "
                                  f"and by {where}", f"keep '{keyword}' in one of them", at=at)
                given.setdefault(keyword, where)


@_rule("GF115", Severity.WARNING, "breaks on an eager segment")
def eager_breaks(plan: Plan) -> Iterator[Violation]:
    """An eager segment names ``breaks``.

    Breaks split a graph segment's PIECEWISE capture at submodule calls; an eager
    segment runs all of its work eagerly already, so they change nothing, and usually
    the segment was meant to be a graph segment.

    Fix: make the segment ``kind: graph``, or drop ``breaks``.
    """
    for segment in plan.segments:
        if segment.breaks and not segment.is_graph:
            yield Violation("segment", segment.name, f"{_describe(segment)} names breaks "
                          f"({_names(segment.breaks)}), which only split graph segments",
                          "make it kind: graph, or drop breaks")


# -- dataflow: GF2xx -----------------------------------------------------------------------


@_rule("GF201", Severity.ERROR, "read before written")
def read_before_write(plan: Plan) -> Iterator[Violation]:
    """A segment reads a buffer that no earlier segment writes, on some rank, and the
    buffer is not an ``input`` or ``state``.

    Capture would record a read of uninitialized memory: replay is garbage, and on
    several ranks each reads its own garbage, so data-dependent work diverges.

    Fix: write it in an earlier segment, or declare ``role: input`` (the runtime fills
    it) or ``role: state`` (it persists across steps).
    """
    written: dict[str, set[int]] = {}  # storage buffer -> ranks on which it has been written
    for segment in plan.segments:
        ranks = _ranks(plan, segment)
        for name in dict.fromkeys(segment.reads):
            if plan.buffer(name) is None or _roles(plan, name) & {BufferRole.INPUT, BufferRole.STATE}:
                continue
            missing = ranks - written.get(plan.storage(name), set())
            if not missing:
                continue
            on = f" on rank(s) {', '.join(map(str, sorted(missing)))}"
            if missing == ranks and segment.ranks is None:
                on = ""
            yield Violation("segment", segment.name,
                          f"'{name}' is read by {_describe(segment)} before any segment writes it{on}",
                          "write it in an earlier segment or declare role: input (or state)")
        for name in segment.writes:
            if plan.buffer(name) is not None:
                written.setdefault(plan.storage(name), set()).update(ranks)


@_rule("GF202", Severity.ERROR, "unordered writers")
def unordered_writers(plan: Plan) -> Iterator[Violation]:
    """Two segments write one buffer and no path in the DAG orders them (no data and no
    ``after`` edge), on a rank where both run.

    The engine may run independent segments on separate streams, so the final value
    would depend on timing; list order alone is not a dependency.

    Fix: make the later writer read the buffer (an in-place update), add ``after``, or
    write separate buffers.
    """
    dag = plan.dag()
    writers: dict[str, list[Segment]] = {}
    for segment in plan.segments:
        for name in dict.fromkeys(segment.writes):
            if plan.buffer(name) is not None:
                writers.setdefault(name, []).append(segment)
    for name, segments in writers.items():
        for first, second in zip(segments, segments[1:]):
            if first.name == second.name or not _ranks(plan, first) & _ranks(plan, second):
                continue
            if not nx.has_path(dag, first.name, second.name):
                yield Violation("segment", second.name,
                              f"'{name}' is written by {_describe(first)} and {_describe(second)} "
                              "with no order between them",
                              f"make {second.name} read '{name}', add `after: [{first.name}]`, "
                              "or write separate buffers")


@_rule("GF203", Severity.WARNING, "graph output never read")
def unread_outputs(plan: Plan) -> Iterator[Violation]:
    """A graph segment writes a buffer version that nothing reads before it is
    overwritten or the step ends, and the buffer is not an ``output`` or ``state``.

    The work is wasted on every replay, and usually means a reader names the wrong
    buffer.

    Fix: read it where it is needed, drop the write, or declare ``role: output``.
    """
    pending: dict[str, list[tuple[Segment, str]]] = {}  # storage -> unread writes
    for segment in plan.segments:
        for name in segment.reads:
            if plan.buffer(name) is not None:
                pending.pop(plan.storage(name), None)
        for name in dict.fromkeys(segment.writes):
            if plan.buffer(name) is None:
                continue
            storage = plan.storage(name)
            earlier = [(s, n) for s, n in pending.get(storage, ()) if s is not segment]
            yield from _dead_writes(plan, earlier, "overwritten")
            pending[storage] = [(segment, name)]
    for writes in pending.values():
        yield from _dead_writes(plan, writes, "the step ends")


def _dead_writes(plan: Plan, writes: Iterable[tuple[Segment, str]], until: str) -> Iterator[Violation]:
    for segment, name in writes:
        if segment.is_graph and not _roles(plan, name) & {BufferRole.OUTPUT, BufferRole.STATE}:
            yield Violation("segment", segment.name,
                          f"'{name}' written by {_describe(segment)} is not read before {until}",
                          "read it, drop the write, or declare role: output")


@_rule("GF204", Severity.ERROR, "bad alias")
def bad_aliases(plan: Plan) -> Iterator[Violation]:
    """An ``alias_of`` buffer is larger than its target, on another device, part of an
    alias cycle, or written through more than one name of the same storage. (A chain,
    an alias of an alias, is fine: all of it views the storage of the buffer at its end.)

    A view larger than its storage overruns it; a cycle has no storage at all; writes
    through two names are invisible to the DAG (which versions names), so their order
    is undefined.

    Fix: make the alias fit its target on the same device, and write the storage
    through one name only (read through the others).
    """
    for buffer in plan.buffers:
        target = plan.buffer(buffer.alias_of) if buffer.alias_of is not None else None
        if target is None:
            continue
        loop = _alias_loop(plan, buffer)
        if loop:
            yield Violation("buffer", buffer.name, f"buffer '{buffer.name}' is an alias of itself: {' -> '.join(loop)}",
                          "point alias_of at the buffer that owns the storage")
            continue
        if target.device != buffer.device:
            yield Violation("buffer", buffer.name,
                          f"alias '{buffer.name}' on {buffer.device} views '{target.name}' on {target.device}",
                          "put the alias on its target's device")
        size, target_size = _nbytes(plan, buffer), _nbytes(plan, target)
        if size is not None and target_size is not None and size > target_size:
            yield Violation("buffer", buffer.name,
                          f"alias '{buffer.name}' ({size} bytes) is larger than its target "
                          f"'{target.name}' ({target_size} bytes)",
                          "shrink the alias or grow its target")
    written: dict[str, dict[str, str]] = {}  # storage -> name -> first writer
    for segment in plan.segments:
        for name in segment.writes:
            if plan.buffer(name) is not None:
                written.setdefault(plan.storage(name), {}).setdefault(name, segment.name)
    for storage, names in written.items():
        if len(names) > 1:
            through = ", ".join(f"'{n}' (by {s})" for n, s in names.items())
            yield Violation("buffer", storage, f"storage of '{storage}' is written through {through}",
                          "write it through one name and read through the others")


def _alias_loop(plan: Plan, buffer: Buffer) -> list[str]:
    """The alias chain from ``buffer`` back to itself, or [] when it reaches a storage
    (or runs into a cycle that does not pass through ``buffer``)."""
    chain = plan.alias_chain(buffer.name)
    last = plan.buffer(chain[-1])
    return [*chain, buffer.name] if last is not None and last.alias_of == buffer.name else []


@_rule("GF205", Severity.WARNING, "buffer never used")
def unused_buffers(plan: Plan) -> Iterator[Violation]:
    """A buffer is declared but no segment reads or writes it, directly or through an
    alias.

    It is still allocated at its largest size before capture, and usually a segment
    names the wrong buffer.

    Fix: use it in the segment that needs it, or remove it.
    """
    used = {storage for segment in plan.segments for name in (*segment.reads, *segment.writes)
            for storage in plan.alias_chain(name)}
    yield from _unused("buffer", plan.buffers, used, "buffer '{}' is read or written by no segment",
                       "use it in a segment's reads or writes, or remove it")


def _padded(plan: Plan) -> str | None:
    """The batch sizes that run padded on a larger descriptor (those no captured mode
    captures), as a short phrase; None when every batch size is captured."""
    captured = set(_sizes(plan))
    count = max(captured, default=0) - len(captured)
    if count <= 0:
        return None
    first = list(itertools.islice((b for b in range(1, max(captured)) if b not in captured), 3))
    return ", ".join(map(str, first)) + (f", … ({count} in all)" if count > len(first) else "")


@_rule("GF206", Severity.WARNING, "batch-indexed state without a padding rule")
def unpadded_state(plan: Plan) -> Iterator[Violation]:
    """A ``state`` buffer has a dimension of the size symbol (one row per batch row) and
    no ``pad`` rule, while some batch sizes run padded on a larger descriptor.

    A batch of 3 replayed on the B=4 graph also runs row 3, which writes row 3 of the
    state: the KV cache of whatever sequence owns that row is overwritten by padding.

    Fix: declare ``pad: keep`` (the runtime saves the padded rows and puts them back
    after the step), or index the state through an input whose padded rows point at a
    scratch slot (``pad: N`` on that input), or capture every size.
    """
    padded = _padded(plan)
    if not padded:
        return
    for buffer in plan.buffers:
        if buffer.role is BufferRole.STATE and buffer.pad is None and plan.capture.size_symbol in buffer.symbols():
            yield Violation("buffer", buffer.name,
                          f"state buffer '{buffer.name}' has a row per batch row, and batches of "
                          f"{padded} run padded: the padded rows write its rows",
                          "declare pad: keep, or index it through an input with a scratch slot (pad: N)")


@_rule("GF207", Severity.ERROR, "padding rule that does not apply")
def misplaced_padding(plan: Plan) -> Iterator[Violation]:
    """A buffer's ``pad`` does not fit it: ``keep`` on a buffer that is not ``state``, a
    number on a buffer that is not an ``input``, or any rule on a buffer without a
    dimension of the size symbol (it has no padded rows).

    The runtime would never apply it, so the protection the author relied on is absent.

    Fix: ``pad: keep`` on batch-indexed state, ``pad: N`` on batch-indexed inputs (a
    scratch slot, a pad token), nothing elsewhere.
    """
    for buffer in plan.buffers:
        if buffer.pad is None:
            continue
        if plan.capture.size_symbol not in buffer.symbols():
            yield Violation("buffer", buffer.name, f"buffer '{buffer.name}' declares pad: {buffer.pad} but its shape "
                          f"{list(buffer.shape)} has no {plan.capture.size_symbol} dimension, so no padded rows",
                          "drop pad")
        elif buffer.pad == "keep" and buffer.role is not BufferRole.STATE:
            yield Violation("buffer", buffer.name, f"pad: keep on {buffer.role.value} buffer '{buffer.name}': only state "
                          "persists across steps", "use pad: keep on state buffers; give an input a number")
        elif buffer.pad != "keep" and buffer.role is not BufferRole.INPUT:
            yield Violation("buffer", buffer.name, f"pad: {buffer.pad:g} on {buffer.role.value} buffer "
                          f"'{buffer.name}': only inputs are filled by the runtime",
                          "give the number to the input whose padded rows it fills, or use pad: keep on state")


@_rule("GF208", Severity.ERROR, "bad adoption")
def bad_adoption(plan: Plan) -> Iterator[Violation]:
    """Two buffers adopt one tensor of the model, or an alias adopts one.

    One tensor would be two buffers whose writes the DAG versions separately (their
    order becomes undefined); an alias has no storage of its own to adopt.

    Fix: adopt each tensor once, into a buffer without ``alias_of``.
    """
    seen: dict[str, str] = {}
    for buffer in plan.buffers:
        if buffer.adopt is None:
            continue
        if buffer.alias_of is not None:
            yield Violation("buffer", buffer.name, f"alias '{buffer.name}' adopts {buffer.adopt}",
                          "adopt it into the buffer that owns the storage")
        if buffer.adopt in seen:
            yield Violation("buffer", buffer.name, f"buffers '{seen[buffer.adopt]}' and '{buffer.name}' both adopt "
                          f"{buffer.adopt}", "adopt it into one buffer and read the others through alias_of")
        seen.setdefault(buffer.adopt, buffer.name)


@_rule("GF209", Severity.ERROR, "reference output the step never writes")
def unwritten_reference(plan: Plan) -> Iterator[Violation]:
    """The reference's ``returns`` names a buffer that no segment writes.

    Verify compares what the replay left in that buffer with the reference's output:
    with no writer, the replay never changes it, and the comparison says nothing.

    Fix: name buffers the step writes (its outputs), or write the buffer in a segment.
    """
    if plan.reference is None:
        return
    written = {plan.storage(w) for s in plan.segments for w in s.writes if plan.buffer(w) is not None}
    for name in dict.fromkeys(plan.reference.returns):
        if plan.buffer(name) is not None and plan.storage(name) not in written:
            yield Violation("reference", None, f"the reference's output '{name}' is written by no segment",
                          "compare a buffer the step writes, or write it in a segment", at="reference")


def _unused(kind: str, elements: Iterable, used: set, message: str, fix: str) -> Iterator[Violation]:
    """A finding for each element whose name is not in ``used`` (GF205, GF404, GF506)."""
    for element in elements:
        if element.name not in used:
            yield Violation(kind, element.name, message.format(element.name), fix)


# -- allocation: GF3xx ---------------------------------------------------------------------


@_rule("GF301", Severity.ERROR, "capacity on a symbol the shape does not use")
def uncovered_shapes(plan: Plan) -> Iterator[Violation]:
    """A buffer's ``capacity`` caps a symbol its shape does not use.

    The capacity the author relied on limits nothing: the buffer is allocated without
    it, and sizes above it are neither refused (GF604) nor held.

    Fix: cap a symbol the shape uses, or drop the capacity.
    """
    for buffer in plan.buffers:
        used = set(buffer.symbols())
        for symbol in buffer.capacity:
            if symbol not in used:
                yield Violation("buffer", buffer.name,
                              f"buffer '{buffer.name}' caps '{symbol}' "
                              f"but its shape {list(buffer.shape)} does not use it",
                              "cap a symbol the shape uses, or drop the capacity")


@_rule("GF302", Severity.ERROR, "buffer on another device")
def buffer_devices(plan: Plan) -> Iterator[Violation]:
    """A graph segment reads or writes a buffer on another device than the segment's.

    A graph captures on one device; a cross-GPU access inside it (``x.to("cuda:1")``
    in a layer) is a hidden copy that breaks capture or replays stale data.

    Fix: move the buffer to the segment's device, or add an eager copy segment.
    """
    for segment in plan.segments:
        home = _home_device(plan, segment)
        if not segment.is_graph or home is None:
            continue
        for verb, names in (("read", segment.reads), ("written", segment.writes)):
            for name in dict.fromkeys(names):
                buffer = plan.buffer(name)
                if buffer is not None and buffer.device != home:
                    yield Violation("segment", segment.name,
                                  f"'{name}' on {buffer.device} is {verb} by {_describe(segment)} on {home}",
                                  f"move the buffer to {home} or add an eager copy segment")


def _over(plan: Plan, limit: int) -> Iterator[tuple[str, int, str]]:
    """Each GPU whose static buffers exceed ``limit`` bytes: (device, total, what takes it),
    the largest named by template (``kv_cache{0..60}``) as ``graphflow show`` groups them."""
    for device, sizes in plan.static_memory().items():
        total = sum(sizes.values())
        if not _GPU.fullmatch(device) or total <= limit:
            continue
        yield device, total, f"the largest: {heaviest(sizes)}"


def _amount(total: int) -> str:
    return f"{format_bytes(total)} ({total:,} bytes)"


@_rule("GF303", Severity.WARNING, "static buffers exceed device memory")
def over_device_memory(plan: Plan, device_memory: int | None = None) -> Iterator[Violation]:
    """The static buffers of one GPU add up to more than its memory, as given to
    ``graphflow validate --device-memory`` (``validate(plan, device_memory=...)``).

    Allocation fails before the first capture, after the model has loaded; or the
    buffers leave no room for the weights and the graphs' memory pools. Buffers are
    counted at their allocation (the largest size, capacities included), aliases not
    at all; buffers on the CPU are not counted.

    Fix: lower the largest sizes or the capacities, use a smaller dtype, or spread the
    buffers over more GPUs.
    """
    if device_memory is None:
        return
    for device, total, largest in _over(plan, device_memory):
        if total <= max(MEMORY_CEILING, device_memory):  # beyond that, GF304 reports it
            yield Violation("plan", None, f"static buffers on {device} take {_amount(total)}, more than its "
                                        f"{_amount(device_memory)} of memory; {largest}",
                          "lower the largest sizes or capacities, or spread the buffers over more GPUs",
                          at=plan.name)


@_rule("GF304", Severity.ERROR, "static buffers fit no GPU")
def beyond_any_gpu(plan: Plan, device_memory: int | None = None) -> Iterator[Violation]:
    """The static buffers of one GPU add up to more than 1 TiB (``MEMORY_CEILING``,
    several times what the largest GPUs hold), or to more than a larger
    ``--device-memory`` figure when one is given.

    No GPU can allocate them: usually a batch size or a capacity with a digit too many
    (``B`` up to 10**9). Without this check the plan validates clean and the engine
    fails only after the model has loaded.

    Fix: lower the largest sizes or the capacities.
    """
    limit = MEMORY_CEILING if device_memory is None else max(MEMORY_CEILING, device_memory)
    for device, total, largest in _over(plan, limit):
        yield Violation("plan", None, f"static buffers on {device} take {_amount(total)}, more than any GPU holds "
                                    f"(over {format_bytes(limit)}); {largest}",
                      "lower the largest sizes or capacities", at=plan.name)


# -- streams: GF4xx ------------------------------------------------------------------------


@_rule("GF401", Severity.ERROR, "graph segment without stream")
def missing_streams(plan: Plan) -> Iterator[Violation]:
    """A graph segment has no explicit stream.

    Capturing on the ambient stream after ``set_device`` records an empty graph on one
    GPU and replays stale data on the others: every replay returns zeros or old values.

    Fix: declare a stream on the segment's device and name it in ``stream``.
    """
    for segment in plan.segments:
        if segment.is_graph and segment.stream is None:
            home = _home_device(plan, segment)
            candidates = [s.name for s in plan.streams if s.device == home]
            hint = (f"add `stream: {candidates[0]}`" if candidates
                    else f"declare a stream on {home or 'its device'} and name it")
            yield Violation("segment", segment.name, f"{_describe(segment)} has no stream", hint)


@_rule("GF402", Severity.ERROR, "stream on another device")
def stream_devices(plan: Plan) -> Iterator[Violation]:
    """A segment's stream is on another device than the segment (its declared device or
    its buffers').

    Kernels would be queued on one GPU for data on another: capture fails or the graph
    replays stale memory.

    Fix: use a stream on the segment's device.
    """
    for segment in plan.segments:
        stream = plan.stream(segment.stream)
        if stream is None or (segment.device is None and _is_copy(plan, segment)):
            continue
        home = _home_device(plan, segment)
        if home is not None and stream.device != home:
            candidates = [s.name for s in plan.streams if s.device == home]
            fix = f"use stream {candidates[0]}" if candidates else f"declare a stream on {home} and use it"
            yield Violation("segment", segment.name,
                          f"{_describe(segment)} on {home} runs on stream {stream.name} on {stream.device}", fix)


@_rule("GF403", Severity.ERROR, "capture region spans devices")
def region_devices(plan: Plan) -> Iterator[Violation]:
    """A capture region (a PIECEWISE run of graph segments, or a FULL family step) holds
    graph segments on different devices.

    One graph captures on one device; moving data across GPUs must be an explicit eager
    copy between graphs, or the graph replays stale data on the second GPU.

    Fix: insert an eager copy segment where the device changes.
    """
    for mode in _capture_modes(plan):
        for region in plan.regions(mode):
            previous = None
            for name in region.segments:
                segment = plan.segment(name)
                if segment is None or not segment.is_graph:
                    continue
                home = _home_device(plan, segment)
                if home is None:
                    continue
                if previous is not None and previous[1] != home:
                    yield Violation("segment", name,
                                  f"{mode.value} region {region.name} runs {previous[0]} on {previous[1]} "
                                  f"then {name} on {home}",
                                  f"insert an eager copy segment between {previous[0]} and {name}")
                    break
                previous = (name, home)


@_rule("GF404", Severity.WARNING, "stream never used")
def unused_streams(plan: Plan) -> Iterator[Violation]:
    """A stream is declared but no segment runs on it.

    The engine still creates it on its device, and usually a segment names the wrong
    stream.

    Fix: name it in the segments that should run on it, or remove it.
    """
    used = {segment.stream for segment in plan.segments}
    yield from _unused("stream", plan.streams, used, "stream {} is used by no segment",
                       "name it in a segment's stream, or remove it")


@_rule("GF405", Severity.ERROR, "breaks in a region on several streams")
def breaks_on_streams(plan: Plan) -> Iterator[Violation]:
    """A segment with ``breaks`` is in a PIECEWISE region whose segments run on more than
    one stream.

    A break ends the region's capture on its stream and starts the next graph there; a
    side stream joined into the capture would be left unjoined, which fails it.

    Fix: run the region's segments on one stream, or put the segment with breaks in a
    region of its own (between eager segments).
    """
    if Mode.PIECEWISE not in plan.capture.modes:
        return
    for region in plan.regions(Mode.PIECEWISE):
        members = [plan.segment(n) for n in region.segments]
        streams = {s.stream for s in members if s is not None}
        for segment in members:
            if segment is not None and segment.breaks and len(streams) > 1:
                yield Violation("segment", segment.name, f"{_describe(segment)} has breaks, and region {region.name} "
                              f"runs on streams {_names(sorted(str(s) for s in streams))}",
                              "run the region on one stream, or give the segment a region of its own")


# -- channels: GF5xx -----------------------------------------------------------------------


@_rule("GF501", Severity.ERROR, "channel id shared by families")
def shared_channel_ids(plan: Plan) -> Iterator[Violation]:
    """One channel id is owned by channels of two families.

    Graph families that share signal buffers or IPC registrations corrupt each other's
    captured collectives (a target model, a speculative draft and a context-KV cache,
    each with its own graphs, replaying against one set of buffers).

    Fix: give each family's channel its own id.
    """
    by_id: dict[int, list] = {}
    for channel in plan.channels:
        by_id.setdefault(channel.id, []).append(channel)
    for channel_id, channels in by_id.items():
        families = dict.fromkeys(c.family for c in channels)
        if len(families) > 1:
            owners = ", ".join(f"{c.name} ({c.family})" for c in channels)
            second = next(c for c in channels if c.family != channels[0].family)
            yield Violation("channel", second.name, f"channel id {channel_id} is owned by several families: {owners}",
                          "give each family's channel its own id")


@_rule("GF502", Severity.ERROR, "channel of another family")
def foreign_channels(plan: Plan) -> Iterator[Violation]:
    """A segment uses a channel owned by another family.

    Its collectives would be captured into another owner's graphs on a shared channel,
    which conflicts when both replay.

    Fix: declare a channel (with its own id) for the segment's family.
    """
    for segment in plan.segments:
        for name in dict.fromkeys(segment.channels):
            channel = plan.channel(name)
            if channel is not None and channel.family != segment.family:
                yield Violation("segment", segment.name,
                              f"{_describe(segment)} of family {segment.family} uses channel {name} "
                              f"owned by family {channel.family}",
                              f"declare a {segment.family} channel with its own id")


@_rule("GF503", Severity.ERROR, "placeholder warmup reaches data-dependent work")
def placeholder_reaches_routing(plan: Plan) -> Iterator[Violation]:
    """A channel whose warmup does not communicate (``placeholder`` or ``prepare``) feeds
    a data-dependent segment (the using segment itself or any DAG descendant).

    During warmup each rank gets rank-local garbage instead of the reduced value; top-k
    routing then picks different paths per rank and capture hangs: every PIECEWISE
    descriptor captures, then FULL capture makes no progress.

    Fix: use ``warmup: real`` for this channel.
    """
    dag = plan.dag()
    position = {}
    for index, segment in enumerate(plan.segments):
        position.setdefault(segment.name, index)
    for segment in plan.segments:
        for name in dict.fromkeys(segment.channels):
            channel = plan.channel(name)
            if channel is None or channel.warmup not in _NON_COMMUNICATING:
                continue
            reached = [segment.name] if segment.data_dependent else []
            reached += sorted((n for n in nx.descendants(dag, segment.name) if dag.nodes[n]["segment"].data_dependent),
                              key=position.__getitem__)
            if reached:
                via = "" if reached[0] == segment.name else f" after {segment.name}"
                yield Violation("segment", segment.name,
                              f"channel {name} warms up with a {channel.warmup.value} output "
                              f"that reaches data-dependent segment {reached[0]}{via}",
                              f"set warmup: real on channel {name}, so ranks see the reduced values")


@_rule("GF504", Severity.ERROR, "JIT channel without prewarm")
def cold_jit_channels(plan: Plan) -> Iterator[Violation]:
    """A channel needs its kernel warmed (``jit``, or ``warmup: prepare``) but its warmup
    is not ``real`` and it names no ``prewarm`` hook.

    The specialization's first launch would be inside capture, which rejects it (a
    CuTe DSL all-reduce raises "cold ... CUDA graph capture is not allowed") or records
    nothing.

    Fix: declare a prewarm hook and name it in the channel's ``prewarm``, or use
    ``warmup: real``.
    """
    for channel in plan.channels:
        needs = channel.jit or channel.warmup is WarmupPolicy.PREPARE
        if needs and channel.warmup is not WarmupPolicy.REAL and channel.prewarm is None:
            what = "a JIT kernel" if channel.jit else "prepared"
            yield Violation("channel", channel.name,
                          f"channel {channel.name} is {what} with warmup: {channel.warmup.value} and no prewarm hook",
                          "declare a prewarm hook and set `prewarm:` on the channel, or use warmup: real")


@_rule("GF505", Severity.ERROR, "collective order differs across ranks")
def rank_collective_order(plan: Plan) -> Iterator[Violation]:
    """Within one family, the ranks would call collectives in different orders (per-rank
    segments that use channels).

    Mismatched collectives pair wrongly and every rank hangs until the timeout, with
    nothing naming the rank that diverged.

    Fix: give every rank the same sequence of channel uses (move the channel to a
    segment that runs on all ranks).
    """
    if not isinstance(plan.world_size, int) or plan.world_size < 2:
        return
    world = frozenset(range(plan.world_size))
    for family in dict.fromkeys(s.family for s in plan.segments):
        segments = plan.family_segments(family)
        calls = {rank: [(s.name, c) for s in segments if s.runs_on(rank) for c in s.channels] for rank in world}
        for position in range(max(len(seq) for seq in calls.values())):
            at = {rank: seq[position] if position < len(seq) else None for rank, seq in sorted(calls.items())}
            if len({call[1] if call else None for call in at.values()}) == 1:
                continue
            # Blame the first per-rank segment with a collective up to here: where ranks part.
            seen = {call[0] for seq in calls.values() for call in seq[: position + 1]}
            culprit = next((s.name for s in segments if s.name in seen and _ranks(plan, s) != world),
                           next(call for call in at.values() if call)[0])
            yield Violation("segment", culprit,
                          f"family {family} collective #{position + 1} differs across ranks: {_calls(at)}",
                          f"give every rank the same sequence of channel uses (see {culprit})")
            break


def _calls(at: Mapping[int, tuple[str, str] | None]) -> str:
    """``rank 0 calls tp_ar in L1.post; rank 1 calls nothing``: ranks grouped by call."""
    groups: dict[str | None, list[int]] = {}
    for rank, call in at.items():
        groups.setdefault(call[1] if call else None, []).append(rank)
    parts = []
    for channel, ranks in groups.items():
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} call{'' if len(ranks) > 1 else 's'}"
        if channel is None:
            parts.append(f"{who} nothing")
        else:
            parts.append(f"{who} {channel} in {', '.join(dict.fromkeys(at[r][0] for r in ranks))}")
    return "; ".join(parts)


@_rule("GF506", Severity.WARNING, "channel never used")
def unused_channels(plan: Plan) -> Iterator[Violation]:
    """A channel is declared but no segment uses it.

    It would still be assigned, warmed up and torn down; usually a segment names the
    wrong channel.

    Fix: use it in the segment that communicates, or remove it.
    """
    used = {name for segment in plan.segments for name in segment.channels}
    yield from _unused("channel", plan.channels, used, "channel {} is used by no segment",
                       "name it in the segment that communicates, or remove it")


# -- modes: GF6xx --------------------------------------------------------------------------


@_rule("GF601", Severity.ERROR, "eager segment in FULL region")
def eager_in_full(plan: Plan) -> Iterator[Violation]:
    """FULL capture is requested but a family's step contains an eager segment.

    FULL captures the family's whole step as one graph, so an eager break (attention on
    a Python-int length, say) would be captured as if static, or break capture.

    Fix: make the segment capturable (static shapes, device-side lengths) and a graph
    segment, or capture this plan PIECEWISE only.
    """
    if Mode.FULL not in plan.capture.modes:
        return
    for family in dict.fromkeys(s.family for s in plan.segments):
        eager = [s.name for s in plan.family_segments(family) if not s.is_graph]
        if eager:
            yield Violation("segment", eager[0],
                          f"FULL region of family {family} contains eager segment(s) {_names(eager)}",
                          "make them graph segments or drop FULL from capture.modes")


@_rule("GF602", Severity.WARNING, "sizes unsorted")
def unsorted_sizes(plan: Plan) -> Iterator[Violation]:
    """``capture.sizes`` is not in increasing order.

    Capture order is computed (largest first), so the order is harmless, but an
    unsorted list hides gaps and duplicates from the reader.

    Fix: list the sizes in increasing order.
    """
    for what, values in _size_lists(plan):
        sizes = list(values)
        if sizes != sorted(sizes):
            yield Violation("capture", None, f"{what} {list(values)} are not in increasing order",
                          f"list them sorted: {sorted(set(sizes))}", at="sizes")


@_rule("GF603", Severity.ERROR, "duplicated sizes or modes")
def duplicated_sizes(plan: Plan) -> Iterator[Violation]:
    """``capture.sizes`` or ``capture.modes`` lists a value twice.

    Usually a typo for a size that is then never captured: batches of that size pad
    up to the next descriptor and run slower without any error.

    Fix: list each size and mode once.
    """
    for what, values in (*_size_lists(plan), ("capture.modes", plan.capture.modes)):
        shown = [v.value if isinstance(v, Mode) else v for v in values]
        repeated = _duplicates(map(repr, shown))
        if repeated:
            yield Violation("capture", None, f"{what} lists {', '.join(repeated)} more than once",
                          f"list each of {what} once", at=what.split(".")[1])


@_rule("GF604", Severity.ERROR, "size above capacity")
def sizes_above_capacity(plan: Plan) -> Iterator[Violation]:
    """A descriptor size (or a symbol's value) is above a buffer's ``capacity``.

    The buffer was declared to hold at most ``capacity`` rows, which the model may have
    sized its own tensors and indices for (an adopted cache): a larger batch contradicts
    it, so the descriptor is not captured, even with the rule skipped (the allocate
    phase refuses it).

    Fix: raise the capacity or drop the sizes above it.
    """
    size_symbol = plan.capture.size_symbol
    for buffer in plan.buffers:
        for symbol, cap in buffer.capacity.items():
            if symbol == size_symbol:
                above = [s for s in _sizes(plan) if s > cap]
                if above:
                    yield Violation("buffer", buffer.name,
                                  f"sizes {', '.join(map(str, above))} are above "
                                  f"buffer '{buffer.name}' capacity {symbol}={cap}",
                                  f"raise its capacity to {max(above)} or drop sizes above {cap}")
            elif symbol in plan.symbols and plan.symbols[symbol] > cap:
                yield Violation("buffer", buffer.name,
                              f"symbol {symbol}={plan.symbols[symbol]} is above "
                              f"buffer '{buffer.name}' capacity {symbol}={cap}",
                              f"raise its capacity to {plan.symbols[symbol]} or lower {symbol}")


@_rule("GF605", Severity.ERROR, "no descriptors")
def missing_descriptors(plan: Plan) -> Iterator[Violation]:
    """``capture.modes`` or a mode's ``capture.sizes`` is empty, or sizes are given for
    a mode that is not captured.

    Nothing would be captured, and every batch would fall back to eager; sizes for an
    uncaptured mode are usually a mode missing from ``capture.modes``.

    Fix: list at least one mode and its sizes, and give sizes only to captured modes.
    """
    if not plan.capture.modes:
        yield Violation("capture", None, "capture.modes is empty", "list PIECEWISE and/or FULL", at="modes")
    for what, values in _size_lists(plan):
        if not values:
            yield Violation("capture", None, f"{what} is empty", "list the batch sizes to capture", at="sizes")
    extra = [m.value for m in plan.capture.mode_sizes if m not in plan.capture.modes]
    if extra:
        yield Violation("capture", None, f"capture.sizes gives sizes for {', '.join(extra)}, which capture.modes "
                      "does not list", "add the mode to capture.modes or drop its sizes", at="sizes")


# -- compiled segments (torch.compile) ------------------------------------------------------------
#: Inductor options that capture CUDA graphs of inductor's own.
_OWN_GRAPHS = ("triton.cudagraphs", "triton.cudagraph_trees")
#: Modes that turn them on.
_OWN_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _compile_settings(plan: Plan) -> Iterator[tuple[str, str | None, object]]:
    """Every compile setting the plan writes: (kind, name, setting)."""
    if plan.capture.compile is not None:
        yield "capture", None, plan.capture.compile
    for segment in plan.segments:
        if segment.compile is not None:
            yield "segment", segment.name, segment.compile


@_rule("GF701", Severity.ERROR, "compile on an eager segment")
def compiled_eager_segment(plan: Plan) -> Iterator[Violation]:
    """An eager segment declares ``compile``.

    An eager break runs between graphs at every step, outside any capture, because its
    shapes or control flow depend on values; compiled, it would recompile at serving
    time for every new shape, where nothing warms it. ``capture.compile`` skips eager
    segments for that reason.

    Fix: drop ``compile`` from the eager segment, or make its work static and the
    segment a graph segment.
    """
    for segment in plan.segments:
        if not segment.is_graph and segment.compile is not None and segment.compile.enabled is not False:
            yield Violation("segment", segment.name, f"eager segment {segment.name} declares compile",
                          "remove compile from it (only graph segments are compiled)")


@_rule("GF702", Severity.ERROR, "compile with inductor's own CUDA graphs")
def compile_own_graphs(plan: Plan) -> Iterator[Violation]:
    """A compile setting asks inductor to capture CUDA graphs itself (``mode:
    reduce-overhead`` or ``max-autotune``, or the option ``triton.cudagraphs``).

    graphflow captures the compiled segments in its own graphs, with the plan's pool,
    streams, verify and rollback; a graph inductor records inside that capture fails it,
    and one recorded outside would bypass all of them.

    Fix: use ``mode: default`` or ``max-autotune-no-cudagraphs``, and drop the CUDA-graph
    option.
    """
    for kind, name, setting in _compile_settings(plan):
        if setting.mode in _OWN_GRAPH_MODES:
            yield Violation(kind, name, f"compile mode {setting.mode} captures inductor's own CUDA graphs",
                          "use mode: default or max-autotune-no-cudagraphs (graphflow captures the graphs)",
                          at="compile" if kind == "capture" else None)
        for option in _OWN_GRAPHS:
            if (setting.options or {}).get(option):
                yield Violation(kind, name, f"compile option {option} captures inductor's own CUDA graphs",
                              f"drop {option} (graphflow captures the graphs)",
                              at="compile" if kind == "capture" else None)


@_rule("GF704", Severity.ERROR, "compile on a segment with breaks")
def compiled_breaks(plan: Plan) -> Iterator[Violation]:
    """A compiled graph segment also declares ``breaks``.

    A PIECEWISE capture cuts such a segment at its submodule calls and runs them eagerly
    between graphs; a compiled function is one opaque piece of generated code, with no
    submodule call left to cut at.

    Fix: drop ``compile`` from the segment (``compile: false`` under a plan-wide
    setting), or declare its pieces as segments of their own and compile those.
    """
    for segment in plan.segments:
        if segment.breaks and plan.compile_of(segment) is not None:
            yield Violation("segment", segment.name, f"compiled segment {segment.name} declares breaks "
                          f"({_names(segment.breaks)})", "set compile: false on it, or split it into segments")


@_rule("GF703", Severity.WARNING, "compiled segments verified bit-exact")
def compiled_bit_exact(plan: Plan) -> Iterator[Violation]:
    """Some graph segment is compiled while ``capture.verify`` asks for bit-exact replay.

    Verify compares the replay of the compiled segments with the uncompiled eager step.
    Fusion reorders floating-point work (a sum accumulated in registers, a different
    reduction split), so compiled results usually differ from eager ones by rounding,
    and verify would fail on a correct capture.

    Fix: set ``capture.verify`` tolerances for the compiled step (for bf16, around
    ``atol: 0.02``; the verify report shows the max |diff| it measured).
    """
    if plan.capture.atol or plan.capture.rtol:
        return
    compiled = [s.name for s in plan.segments if plan.compile_of(s) is not None]
    if compiled:
        yield Violation("capture", None, f"{len(compiled)} compiled graph segment(s) ({_names(compiled)}) are "
                      "verified bit-exact against the uncompiled step", "set capture.verify atol/rtol",
                      at="verify")


#: The rule table, ordered by code.
RULES: tuple[Rule, ...] = tuple(sorted(_TABLE, key=lambda rule: rule.code))


def rules_markdown() -> str:
    """``docs/rules.md``: the rule table, generated so the doc cannot drift."""
    lines = [
        "# Validation rules",
        "",
        "Generated from `graphflow.plan.rules.RULES` by `rules_markdown()`; do not edit by hand.",
        "`graphflow validate PLAN` runs every rule before any GPU work; errors make it exit 1.",
        "What a single value may be (a dtype, a device written `cuda:N`, `warmup_iters >= 1`) is checked",
        "earlier, when the plan is read or built: see docs/plan-format.md.",
        "",
        "| code | severity | title | what it prevents | how to fix |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule in RULES:
        cells = (rule.code, rule.severity.value, rule.title, rule.prevents, rule.how_to_fix)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    lines += ["", "## Retired codes", "", "Never reused; each failure is still caught, elsewhere.", ""]
    lines += [f"- {code}: {text}" for code, text in RETIRED.items()]
    return "\n".join(lines) + "\n"
