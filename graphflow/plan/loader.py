"""Plans in and out of YAML, with ``for_each`` templating; the format is docs/plan-format.md.

Reading composes the YAML into nodes (never constructing arbitrary Python objects) and
walks them, so every element keeps its line: a bad plan gives one ``PlanError`` naming
file, line and element, and ``Plan.origins`` tells the validator where each element
was declared. Loading never imports the model factory a plan names.

Which keys an element has, which are required, and what each value may be are read off
the plan classes (``graphflow.plan.fields``): one generic reader checks every value by its
field's kind, so YAML, Python and the JSON Schema (``graphflow.plan.schema``) state the same
rules. What is particular to the file stays here: sections keyed by name, ``for_each``,
a symbol listing the descriptor sizes, and families named by their members.

Templates (``graphflow.plan.templates``) are substituted in the strings of an element whose
name uses a ``for_each`` variable. ``dump_plan`` writes the expanded plan, with literal
braces escaped, so ``loads_plan(dump_plan(plan)) == plan`` for every plan.
"""

from __future__ import annotations

import difflib
import enum
import itertools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import yaml

from graphflow.plan import fields, templates
from graphflow.errors import FieldError, PlanError, did_you_mean
from graphflow.plan.model import (
    IDENTIFIER,
    Buffer,
    CaptureSettings,
    Channel,
    Family,
    Mode,
    Origin,
    Plan,
    Prewarm,
    Reference,
    Segment,
    Stream,
)

__all__ = ["FORMAT_VERSION", "dump_plan", "load_plan", "loads_plan", "plan_to_dict"]

#: The ``graphflow:`` value this module reads and writes.
FORMAT_VERSION = 1

_IDENT = re.compile(rf"{IDENTIFIER}\Z")
_RANGE = re.compile(rf"{templates.RANGE_PATTERN}\Z")
_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null")}
_MAX_NODES = 200_000  # aliases can make a small file huge ("billion laughs")
_MAX_EXPANSION = 100_000  # copies of one template: a typo like range(10**9) fails fast
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml composes 10x faster
_YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


# -- reading: YAML nodes with lines ------------------------------------------------------
@attrs.frozen(eq=False)
class _Node:
    """A YAML value and its 1-based line: a scalar, a tuple of nodes or a dict of nodes."""

    value: Any
    line: int
    key_lines: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def is_map(self) -> bool:
        return isinstance(self.value, dict)

    @property
    def is_list(self) -> bool:
        return isinstance(self.value, tuple)


def load_plan(path) -> Plan:
    """Read a plan file (UTF-8 YAML)."""
    file = str(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise PlanError(f"cannot read plan file: {exc.strerror or exc}", file=file) from exc
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise PlanError(f"not UTF-8: byte 0x{data[exc.start]:02x} cannot be decoded", file=file, line=line) from exc
    return loads_plan(text, file)


def loads_plan(text: str, file: str = "<string>") -> Plan:
    """Read a plan from YAML text; ``file`` names it in errors and origins."""
    root = _compose(text, file)
    if root is None:
        raise PlanError("empty plan: expected a mapping starting with 'graphflow: 1'", file=file, line=1)
    return _Reader(file).plan(root)


def _compose(text: str, file: str) -> _Node | None:
    try:
        node = yaml.compose(text, Loader=_YAML_LOADER)
    except yaml.MarkedYAMLError as exc:
        message, line = _syntax_error(exc)
        raise PlanError(message, file=file, line=line) from exc
    except yaml.reader.ReaderError as exc:
        line = text.count("\n", 0, exc.position) + 1
        raise PlanError(f"unacceptable character U+{exc.character:04X}: {exc.reason}", file=file, line=line) from exc
    except yaml.YAMLError as exc:
        raise PlanError(f"cannot parse YAML: {exc}", file=file) from exc
    if node is None:
        return None
    return _convert(node, file, set(), [0])


def _syntax_error(exc: yaml.MarkedYAMLError) -> tuple[str, int | None]:
    """A YAML syntax error's message and its one line, the line to fix.

    The parser notices an unclosed bracket or quote, or a key missing its colon, only on
    a later line: the mistake is where that construct starts (PyYAML's context). A
    block's bad indentation is where the parser stopped (its problem): the block it was
    reading may start anywhere above. The message names no other line, so the line
    before it and the text never disagree.
    """
    context = exc.context or ""
    opened = exc.context_mark is not None and context.startswith(("while parsing", "while scanning")) \
        and "block" not in context
    if opened:
        construct = context.split(" ", 2)[2].removeprefix("a ").removeprefix("an ")
        message = f"YAML syntax error in the {construct} that starts on this line: {exc.problem or 'not closed'}"
        return message, exc.context_mark.line + 1
    mark = exc.problem_mark or exc.context_mark
    problem = exc.problem or ""
    if problem and context:
        said = f"{problem} ({context})" if context.startswith("while") else f"{context}, {problem}"
    else:
        said = problem or context
    return f"YAML syntax error: {said}", mark.line + 1 if mark is not None else None


def _convert(node: yaml.Node, file: str, path: set[int], count: list[int]) -> _Node:
    line = node.start_mark.line + 1
    count[0] += 1
    if count[0] > _MAX_NODES or id(node) in path:
        raise PlanError("YAML aliases expand too far (recursive or exponential anchors)", file=file, line=line)
    if isinstance(node, yaml.ScalarNode):
        if node.tag not in _SCALAR_TAGS:
            raise PlanError(f"unsupported YAML value tagged {node.tag}: use plain strings, numbers, "
                            "booleans, lists and mappings", file=file, line=line)
        return _Node(_SCALAR_CONSTRUCTOR.yaml_constructors[node.tag](_SCALAR_CONSTRUCTOR, node), line)
    if node.tag not in (_TAG + "seq", _TAG + "map"):
        raise PlanError(f"unsupported YAML collection tagged {node.tag}", file=file, line=line)
    path.add(id(node))
    try:
        if isinstance(node, yaml.SequenceNode):
            return _Node(tuple(_convert(item, file, path, count) for item in node.value), line)
        items: dict[str, _Node] = {}
        key_lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key_line = key_node.start_mark.line + 1
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag != _TAG + "str":
                if key_node.tag == _TAG + "merge":
                    raise PlanError("merge keys ('<<') are not supported: write the keys out", file=file, line=key_line)
                key = _convert(key_node, file, path, count).value
                raise PlanError(f"mapping keys must be strings, got {_describe(key)}", file=file, line=key_line)
            key = key_node.value
            if key in items:
                raise PlanError(f"duplicate key {key!r} (first at line {key_lines[key]})", file=file, line=key_line)
            items[key] = _convert(value_node, file, path, count)
            key_lines[key] = key_line
        return _Node(items, line, key_lines)
    finally:
        path.discard(id(node))


_SCALAR_CONSTRUCTOR = yaml.constructor.SafeConstructor()  # only its pure scalar constructors are used


def _describe(value: Any) -> str:
    if isinstance(value, tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"bool {str(value).lower()}"
    return f"{type(value).__name__} {value!r}"


def _plain(node: _Node) -> Any:
    if node.is_map:
        return {key: _plain(value) for key, value in node.value.items()}
    if node.is_list:
        return [_plain(item) for item in node.value]
    return node.value


def _closest(word: str, choices: Iterable[str]) -> str:
    return _suggested(tuple(difflib.get_close_matches(word, list(choices), n=1)))


def _suggested(suggestions: tuple[str, ...]) -> str:
    return f" ({did_you_mean(suggestions, '')})" if suggestions else ""


# -- the format: keys of each element ---------------------------------------------------
_TOP_KEYS = ("graphflow", "name", "model", "model_args", "world_size", "symbols", "for_each", "families",
             "streams", "buffers", "channels", "prewarm", "segments", "reference", "capture")
#: ``{*var}`` in a list item: one item per value of ``var`` (``reads: ["k{*layer}"]``).
_EACH = re.compile(r"\{\*\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}")
#: Sections of named elements: section key -> (element class, kind of element).
_SECTIONS = {"streams": (Stream, "stream"), "buffers": (Buffer, "buffer"), "channels": (Channel, "channel"),
             "prewarm": (Prewarm, "prewarm")}


def _kind(cls: type, name: str) -> fields.Kind:
    return fields.spec(attrs.fields_dict(cls)[name]).kind


@attrs.frozen
class _Template:
    """One declared element before expansion: its name, the variables it uses, its body."""

    index: int | None  # position in a list section (segments), None in a mapping section
    name: str
    variables: tuple[str, ...]
    node: _Node
    line: int


class _Reader:
    """Turns the node tree of one file into a Plan; holds the file name and ``for_each``."""

    def __init__(self, file: str):
        self.file = file
        self.variables: dict[str, tuple[int | str, ...]] = {}
        self.origins: dict[str, Origin] = {}

    def fail(self, message: str, line: int | None, element: str | None = None):
        raise PlanError(message, file=self.file, line=line, element=element)

    # -- values, by the kind of the field they fill ------------------------------------
    def mapping(self, node: _Node, where: str | None, known: tuple[str, ...] | None,
                required: tuple[str, ...] = (), what: str = "a mapping") -> dict:
        """The node's entries, checked against the known keys (None: any key)."""
        if not node.is_map:
            keys = f" with keys {', '.join(known)}" if known else ""
            self.fail(f"expected {what}{keys}, got {_describe(node.value)}", node.line, where)
        for key in node.value:
            if known is not None and key not in known:
                self.fail(f"unknown key {key!r}{_closest(key, known)}; known keys: {', '.join(known)}",
                          node.key_lines[key], where)
        for key in required:
            if key not in node.value:
                self.fail(f"missing required key {key!r}", node.line, where)
        return node.value

    def sequence(self, node: _Node, where: str, what: str) -> tuple[_Node, ...]:
        if not node.is_list:
            self.fail(f"expected a list of {what}, got {_describe(node.value)}", node.line, where)
        return node.value

    def read(self, kind: fields.Kind, node: _Node, where: str) -> Any:
        """The value of ``node`` for a field of ``kind``, or a PlanError at the node's line."""
        value = node.value
        if isinstance(kind, fields.Optional):
            return None if value is None else self.read(kind.inner, node, where)
        if isinstance(kind, fields.Text):
            if not isinstance(value, str):
                self.fail(f"expected {kind.what}, got {_describe(value)}", node.line, where)
            if kind.pattern is not None and re.fullmatch(kind.pattern, value) is None:
                self.fail(f"expected {kind.what}, got {value!r}", node.line, where)
            return value
        if isinstance(kind, fields.Integer):
            if not isinstance(value, int) or isinstance(value, bool):
                self.fail(f"expected an integer, got {_describe(value)}", node.line, where)
            if kind.minimum is not None and value < kind.minimum:
                self.fail(f"expected {kind.expected}, got {value}", node.line, where)
            return value
        if isinstance(kind, fields.Number):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                self.fail(f"expected a number, got {_describe(value)}", node.line, where)
            if kind.minimum is not None and (value < kind.minimum or (kind.exclusive and value == kind.minimum)):
                self.fail(f"expected {kind.expected}, got {value}", node.line, where)
            return float(value)
        if isinstance(kind, fields.Flag):
            if not isinstance(value, bool):
                self.fail(f"expected true or false, got {_describe(value)}", node.line, where)
            return value
        if isinstance(kind, fields.Choice):
            if not isinstance(value, str) or value not in kind.values:
                self.fail(f"expected {kind.expected}, got {_describe(value)}{_suggested(kind.closest(str(value)))}",
                          node.line, where)
            return kind.enum(value) if kind.enum is not None else value
        if isinstance(kind, fields.Dimension):
            if isinstance(value, str):
                if re.fullmatch(kind.pattern, value) is None:
                    self.fail(f"bad shape dimension {value!r}: use {kind.expected}", node.line, where)
                return value
            if isinstance(value, int) and not isinstance(value, bool):
                return self.read(fields.Integer(minimum=1), node, where)
            self.fail(f"expected {kind.expected}, got {_describe(value)}", node.line, where)
        if isinstance(kind, fields.Sequence):
            items = self.sequence(node, where, kind.what)
            if isinstance(kind.item, fields.Text) and kind.item.pattern is None:
                for index, item in enumerate(items):  # a list of names: say which entry
                    if not isinstance(item.value, str):
                        self.fail(f"expected a list of {kind.what}, got {_describe(item.value)} at [{index}]",
                                  item.line, where)
            return tuple(self.read(kind.item, item, f"{where}[{index}]") for index, item in enumerate(items))
        if isinstance(kind, fields.Table):
            entries = self.mapping(node, where, None, what=kind.expected)
            for key in entries:
                try:
                    kind.key.check(where, key)
                except FieldError:
                    self.fail(f"expected {kind.key.expected} as a key, got {key!r}", node.key_lines[key], where)
            return {key: self.read(kind.value, item, f"{where}.{key}") for key, item in entries.items()}
        if isinstance(kind, fields.OneOf):
            for inner in kind.kinds:
                try:
                    return self.read(inner, node, where)
                except PlanError:
                    continue
            self.fail(f"expected {kind.expected}, got {_describe(value)}", node.line, where)
        if isinstance(kind, fields.Bounds):
            bounds = self.sequence(node, where, "two numbers [low, high)") if node.is_list else None
            if bounds is None:
                self.fail(f"expected {kind.expected}, got {_describe(value)}", node.line, where)
            if len(bounds) != 2:
                self.fail(f"expected {kind.expected}, got {len(bounds)} items", node.line, where)
            for index, bound in enumerate(bounds):
                self.read(fields.Number(), bound, f"{where}[{index}]")
            low, high = (bound.value for bound in bounds)
            if low >= high:
                self.fail(f"expected {kind.expected} with low < high, got [{low}, {high}]", node.line, where)
            return low, high
        if isinstance(kind, fields.Setting):
            if node.is_map:
                return self.element(kind.cls, node, where)
            if isinstance(value, bool):
                return self.build(kind.cls, {kind.switch: value}, node.line, where)
            if isinstance(value, str):
                short = self.read(_kind(kind.cls, kind.scalar), node, where)
                return self.build(kind.cls, {kind.scalar: short}, node.line, where)
            self.fail(f"expected {kind.expected}, got {_describe(value)}", node.line, where)
        if isinstance(kind, fields.Data):
            return _plain(node)
        raise TypeError(f"no YAML form for a field of kind {kind!r}")  # a plan class declares a new kind

    def element(self, cls: type, node: _Node, where: str, name: str | None = None) -> Any:
        """An element of ``cls`` from its YAML mapping: keys, required keys and values by its fields.

        ``name`` is given for elements keyed by name in their section (streams, buffers...).
        """
        layout = fields.yaml_fields(cls, skip=("name",) if name is not None else ())
        required = tuple(key for key, attribute in layout.items()
                         if isinstance(attribute, attrs.Attribute) and attribute.default is attrs.NOTHING)
        kwargs = self.values(self.mapping(node, where, tuple(layout), required), layout, where)
        if name is not None:
            kwargs["name"] = name
        return self.build(cls, kwargs, node.line, where)

    def values(self, found: Mapping[str, _Node], layout: Mapping[str, Any], where: str) -> dict[str, Any]:
        """The keyword arguments ``found`` gives, each key read by the kind of its field."""
        kwargs: dict[str, Any] = {}
        for key, value in found.items():
            at, attribute = f"{where}.{key}", layout[key]
            if isinstance(attribute, dict):  # a nested mapping (capture.verify)
                for inner, item in self.mapping(value, at, tuple(attribute)).items():
                    kwargs[attribute[inner].name] = self.read(fields.spec(attribute[inner]).kind, item,
                                                              f"{at}.{inner}")
            else:
                kwargs[attribute.name] = self.read(fields.spec(attribute).kind, value, at)
        return kwargs

    def build(self, cls: type, kwargs: Mapping[str, Any], line: int, where: str | None) -> Any:
        """``cls(**kwargs)``; a value its fields refuse becomes a PlanError at ``line``."""
        try:
            return cls(**kwargs)
        except FieldError as exc:
            raise PlanError(str(exc), file=self.file, line=line, element=where) from exc

    # -- templating -------------------------------------------------------------------
    def for_each(self, node: _Node) -> None:
        for var, value in self.mapping(node, "for_each", None).items():
            where = f"for_each.{var}"
            if not _IDENT.match(var):
                self.fail(f"template variable names are identifiers, got {var!r}", node.key_lines[var], "for_each")
            if isinstance(value.value, str):
                match = _RANGE.match(value.value)
                if match is None:
                    self.fail(f"expected 'range(n)', 'range(a, b)', 'range(a, b, step)' or a list, "
                              f"got {value.value!r}", value.line, where)
                args = [int(a) for a in match.groups() if a is not None]
                if len(args) == 3 and args[2] == 0:
                    self.fail("range() step must not be zero", value.line, where)
                if len(range(*args)) > _MAX_EXPANSION:
                    self.fail(f"{value.value} has more than {_MAX_EXPANSION} values", value.line, where)
                values: tuple = tuple(range(*args))
            elif value.is_list:
                for item in value.value:
                    if not isinstance(item.value, (int, str)) or isinstance(item.value, bool):
                        self.fail(f"template values are ints or strings, got {_describe(item.value)}", item.line, where)
                values = tuple(item.value for item in value.value)
            else:
                self.fail(f"expected 'range(...)' or a list, got {_describe(value.value)}", value.line, where)
            if not values:
                self.fail("no values: the elements using it would vanish", value.line, where)
            if len(set(values)) != len(values):
                self.fail("values repeat: the elements using it would be declared twice", value.line, where)
            self.variables[var] = values

    def name_variables(self, name: str, line: int, where: str) -> tuple[str, ...]:
        """The ``for_each`` variables a name uses, in declaration order."""
        used = templates.variables(name)
        for var in used:
            if var not in self.variables:
                self.fail(self.unknown_variable(var, name), line, where)
        return tuple(v for v in self.variables if v in used)

    def unknown_variable(self, var: str, text: str) -> str:
        hint = _closest(var, self.variables) or " (declare it under for_each, or write {{ }} for literal braces)"
        return f"unknown template variable {var!r} in {text!r}{hint}"

    def expand(self, text: str, env: Mapping[str, int | str], line: int, where: str, owner: str) -> str:
        def unbound(var: str) -> str:
            if var not in self.variables:
                return self.unknown_variable(var, text)
            return (f"template variable {var!r} used outside a templated element: {text!r} is in {owner}, "
                    f"whose name does not use {{{var}}}")

        try:
            return templates.expand(text, env, unbound)
        except templates.TemplateError as exc:
            raise PlanError(str(exc), file=self.file, line=line, element=where) from exc

    def substitute(self, node: _Node, env: Mapping, where: str, owner: str) -> _Node:
        """A copy of an element's body with every string expanded (lines kept).

        A list item using ``{*var}`` becomes one item per value of ``var`` (a head
        reading every layer's buffer: ``reads: ["q{*layer}"]``); elsewhere it is an error.
        """
        if isinstance(node.value, str):
            if "{" not in node.value and "}" not in node.value:
                return node
            if _EACH.search(node.value):
                self.fail(f"{node.value!r} uses {{*var}}, which makes one list item per value: use it as an item of "
                          "a list (reads, writes, returns...)", node.line, where)
            return _Node(self.expand(node.value, env, node.line, where, owner), node.line)
        if node.is_list:
            items: list[_Node] = []
            for item in node.value:
                if isinstance(item.value, str) and _EACH.search(item.value):
                    items += self.each(item, env, where, owner)
                else:
                    items.append(self.substitute(item, env, where, owner))
            return _Node(tuple(items), node.line)
        if node.is_map:
            return _Node({k: self.substitute(v, env, f"{where}.{k}", owner) for k, v in node.value.items()},
                         node.line, node.key_lines)
        return node

    def each(self, item: _Node, env: Mapping, where: str, owner: str) -> list[_Node]:
        """The items a ``{*var}`` list item stands for, in ``for_each`` order."""
        starred = tuple(dict.fromkeys(_EACH.findall(item.value)))
        for var in starred:
            if var not in self.variables:
                self.fail(self.unknown_variable(var, item.value), item.line, where)
            if var in env:
                self.fail(f"{item.value!r} uses {{*{var}}} in an element that {var} already expands: write "
                          f"{{{var}}} for this element's own value", item.line, where)
        text = _EACH.sub(lambda m: "{" + m.group(1) + "}", item.value)
        return [_Node(self.expand(text, {**env, **dict(zip(starred, combo))}, item.line, where, owner), item.line)
                for combo in self.combinations(starred, item.line, where)]

    def combinations(self, variables: tuple[str, ...], line: int, where: str) -> Iterable[tuple]:
        """Every combination of the variables' values, the first variable varying slowest."""
        if math.prod(len(self.variables[v]) for v in variables) > _MAX_EXPANSION:
            self.fail(f"{' x '.join(variables)} expand to more than {_MAX_EXPANSION} copies", line, where)
        return itertools.product(*(self.variables[v] for v in variables))

    def expansions(self, template: _Template, where: str) -> Iterable[tuple[str, _Node]]:
        """The expanded (name, body) pairs of one template, in ``for_each`` order."""
        for combo in self.combinations(template.variables, template.line, where):
            env = dict(zip(template.variables, combo))
            owner = f"{template.name!r}"
            name = self.expand(template.name, env, template.line, where, owner)
            yield name, self.substitute(template.node, env, where, owner)

    def record(self, kind: str, name: str, line: int, where: str) -> None:
        key = f"{kind}:{name}"
        if key in self.origins:
            self.fail(f"duplicate {kind} name {name!r} (first declared at line {self.origins[key].line})",
                      line, where)
        self.origins[key] = Origin(self.file, line)

    # -- sections -----------------------------------------------------------------
    def section(self, node: _Node, section: str) -> list:
        cls, kind = _SECTIONS[section]
        if not node.is_map:
            self.fail(f"expected a mapping of {kind} names to their fields, got {_describe(node.value)}",
                      node.line, section)
        elements = []
        for key, body in node.value.items():
            line = node.key_lines[key]
            where = f"{section} {key!r}"
            template = _Template(None, key, self.name_variables(key, line, where), body, line)
            for name, expanded in self.expansions(template, where):
                self.record(kind, name, line, where)
                elements.append(self.element(cls, expanded, where, name))
        return elements

    def segments(self, node: _Node) -> list[Segment]:
        templates_ = []
        for index, item in enumerate(self.sequence(node, "segments", "segment mappings")):
            where = f"segments[{index}]"
            if not item.is_map:
                self.fail(f"expected a segment mapping with name, kind and call, got {_describe(item.value)}",
                          item.line, where)
            if "name" not in item.value:
                self.fail("missing required key 'name'", item.line, where)
            name_node = item.value["name"]
            name = self.read(_kind(Segment, "name"), name_node, f"{where}.name")
            where = f"{where} {name!r}"
            templates_.append(_Template(index, name, self.name_variables(name, name_node.line, where), item,
                                        item.line))
        segments = []
        for _, block in itertools.groupby(templates_, key=lambda t: t.variables):
            block = list(block)
            first = block[0]
            for combo in self.combinations(first.variables, first.line, f"segments[{first.index}] {first.name!r}"):
                for template in block:
                    where = f"segments[{template.index}] {template.name!r}"
                    env = dict(zip(template.variables, combo))
                    body = self.substitute(template.node, env, where, repr(template.name))
                    segment = self.element(Segment, body, where)
                    self.record("segment", segment.name, template.line, where)
                    segments.append(segment)
        return segments

    # -- the whole plan -------------------------------------------------------------
    def plan(self, root: _Node) -> Plan:
        if not root.is_map:
            self.fail(f"a plan is a mapping starting with 'graphflow: 1', got {_describe(root.value)}", root.line)
        top = self.mapping(root, None, _TOP_KEYS)
        if "graphflow" not in top:
            self.fail(f"missing 'graphflow: {FORMAT_VERSION}' (the format version) at the top of the plan", root.line)
        version = top["graphflow"]
        if type(version.value) is not int or version.value != FORMAT_VERSION:
            self.fail(f"unsupported format version {version.value!r}: this graphflow reads version "
                      f"{FORMAT_VERSION}", version.line, "graphflow")
        if "name" not in top:
            self.fail("missing required key 'name'", root.line)
        kwargs: dict[str, Any] = {}
        name = self.expand(self.read(_kind(Plan, "name"), top["name"], "name"), {}, top["name"].line, "name",
                           "the plan name")
        self.origins[f"plan:{name}"] = Origin(self.file, root.key_lines["name"])
        for key in ("model", "world_size"):
            if key in top:
                kwargs[key] = self.read(_kind(Plan, key), top[key], key)
        if "model" in top:
            self.origins["model:model"] = Origin(self.file, top["model"].line)
        if "model_args" in top and top["model_args"].value is not None:
            kwargs["model_args"] = self.read(_kind(Plan, "model_args"), top["model_args"], "model_args")
        if "for_each" in top:
            self.for_each(top["for_each"])
        constants, size_list = self.symbols(top["symbols"]) if "symbols" in top else ({}, None)
        kwargs["symbols"] = constants
        for section in _SECTIONS:
            if section in top:
                kwargs[section] = self.section(top[section], section)
        if "segments" in top:
            kwargs["segments"] = self.segments(top["segments"])
        named = [(self.origins[f"{kind}:{element.name}"].line, element.family)
                 for kind in ("channel", "segment") for element in kwargs.get(f"{kind}s", ())]
        if "reference" in top and top["reference"].value is not None:
            node = self.substitute(top["reference"], {}, "reference", "the reference")
            kwargs["reference"] = self.element(Reference, node, "reference")
            self.origins["reference:reference"] = Origin(self.file, top["reference"].line)
        kwargs["families"] = self.families(top.get("families"), root, named)
        kwargs["capture"] = self.capture(top.get("capture"), constants, size_list)
        return self.build(Plan, {"name": name, "origins": self.origins, **kwargs}, root.line, None)

    def symbols(self, node: _Node) -> tuple[dict[str, int], tuple[str, tuple[int, ...], int] | None]:
        """Constants, and the one symbol listing descriptor sizes (name, sizes, line)."""
        constant = _kind(Plan, "symbols").value
        listing = _kind(CaptureSettings, "sizes")
        constants: dict[str, int] = {}
        size_list = None
        for name, value in self.mapping(node, "symbols", None).items():
            line = node.key_lines[name]
            where = f"symbols.{name}"
            if not _IDENT.match(name):
                self.fail(f"symbol names are identifiers (letters, digits and _), got {name!r}", line, "symbols")
            if value.is_list:
                if size_list is not None:
                    self.fail(f"only one symbol may list descriptor sizes; {size_list[0]!r} already does "
                              f"(line {size_list[2]})", line, where)
                size_list = (name, self.read(listing, value, where), line)
            else:
                constants[name] = self.read(constant, value, where)
        return constants, size_list

    def families(self, node: _Node | None, root: _Node, named: list[tuple[int, str]]) -> tuple[Family, ...]:
        """The declared families, else those the (line, family) pairs name in file order, else target."""
        if node is not None:
            families = []
            for item, name in zip(node.value, self.read(fields.Sequence(fields.Text(), "family names"), node,
                                                        "families")):
                name = self.expand(name, {}, item.line, "families", "families")
                self.record("family", name, item.line, "families")
                families.append(Family(name))
            return tuple(families)
        first: dict[str, int] = {}
        for line, name in sorted(named, key=lambda pair: pair[0]):
            first.setdefault(name, line)
        for name, line in (first or {"target": root.line}).items():
            self.record("family", name, line, "families")
        return tuple(Family(name) for name in first or ("target",))

    def capture(self, node: _Node | None, constants: Mapping[str, int],
                size_list: tuple[str, tuple[int, ...], int] | None) -> CaptureSettings:
        """The capture settings: ``sizes`` may name the list symbol or map modes to sizes,
        ``size_symbol`` must agree with the list symbol; every other key is read by its field."""
        kwargs: dict[str, Any] = {}
        if size_list is not None:
            kwargs["size_symbol"], kwargs["sizes"] = size_list[0], size_list[1]
            self.origins["capture:sizes"] = Origin(self.file, size_list[2])
        if node is None:
            return CaptureSettings(**kwargs)
        layout = fields.yaml_fields(CaptureSettings)
        found = dict(self.mapping(node, "capture", tuple(layout)))
        for key in found:
            self.origins[f"capture:{key}"] = Origin(self.file, node.key_lines[key])
        sizes = found.pop("sizes", None)
        given = self.values(found, layout, "capture")
        if size_list is not None and given.get("size_symbol", size_list[0]) != size_list[0]:
            self.fail(f"size_symbol {given['size_symbol']!r} differs from {size_list[0]!r}, the symbol listing the "
                      "sizes", found["size_symbol"].line, "capture.size_symbol")
        kwargs.update(given)
        if sizes is not None and sizes.is_map:
            kwargs["mode_sizes"] = self.mode_sizes(sizes, constants, size_list)
            kwargs["sizes"] = tuple(sorted({s for values in kwargs["mode_sizes"].values() for s in values}))
            missing = [m.value for m in kwargs.get("modes", CaptureSettings().modes) if m not in kwargs["mode_sizes"]]
            if missing:
                self.fail(f"capture.modes lists {', '.join(missing)} but capture.sizes gives "
                          f"{'it' if len(missing) == 1 else 'them'} no sizes: add {missing[0]}: [...] to "
                          "capture.sizes", sizes.line, "capture.sizes")
        elif sizes is not None:
            kwargs["sizes"] = self.sizes(sizes, constants, size_list)
        return self.build(CaptureSettings, kwargs, node.line, "capture")

    def sizes(self, node: _Node, constants: Mapping[str, int],
              size_list: tuple[str, tuple[int, ...], int] | None, where: str = "capture.sizes") -> tuple[int, ...]:
        if node.is_list:
            return self.read(_kind(CaptureSettings, "sizes"), node, where)
        symbol = self.read(fields.Text(what="a symbol listing sizes under symbols, a list of sizes, or a mapping "
                                            "of modes to either"), node, where)
        if size_list is not None and symbol == size_list[0]:
            return size_list[1]
        if symbol in constants:
            self.fail(f"symbol {symbol!r} is a constant; give it a list of sizes under symbols", node.line, where)
        known = (size_list[0],) if size_list else ()
        self.fail(f"unknown symbol {symbol!r}{_closest(symbol, known)}: list the sizes under symbols "
                  f"(symbols: {{{symbol}: [1, 2, 4]}}) or here", node.line, where)

    def mode_sizes(self, node: _Node, constants: Mapping[str, int],
                   size_list: tuple[str, tuple[int, ...], int] | None) -> dict[Mode, tuple[int, ...]]:
        """``sizes: {PIECEWISE: B, FULL: [1, 2, 4]}``: each mode's own sizes."""
        allowed = tuple(m.value for m in Mode)
        result: dict[Mode, tuple[int, ...]] = {}
        for key, value in self.mapping(node, "capture.sizes", allowed).items():
            result[Mode(key)] = self.sizes(value, constants, size_list, f"capture.sizes.{key}")
        if not result:
            self.fail("expected at least one mode's sizes, e.g. {PIECEWISE: B, FULL: [1, 2, 4]}", node.line,
                      "capture.sizes")
        return result


# -- writing ----------------------------------------------------------------------------
class _Flow(dict):
    """A mapping written on one line: each element of a section."""


class _Dumper(_YAML_DUMPER):
    def ignore_aliases(self, data) -> bool:
        return True


_Dumper.add_representer(_Flow, lambda dumper, data: dumper.represent_mapping(_TAG + "map", data, flow_style=True))


def _fields(element, skip: tuple[str, ...] = ("name",)) -> _Flow:
    """An element's fields in the order of its class, leaving out those at their default."""
    body = _Flow()
    for key, attribute in fields.yaml_fields(type(element), skip=skip).items():
        value = getattr(element, attribute.name)
        default = attribute.default
        if isinstance(default, attrs.Factory):
            default = default.factory()
        if default is not attrs.NOTHING and value == default:
            continue
        body[key] = _data(value)
    return body


def _data(value: Any) -> Any:
    if attrs.has(type(value)):  # a nested setting (compile): its fields that are set
        return {key: _data(item) for key, item in _fields(value, skip=()).items()}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, str):
        return templates.escape(value)
    if isinstance(value, (tuple, list)):
        return [_data(item) for item in value]
    if isinstance(value, Mapping):
        return {key: _data(item) for key, item in value.items()}
    return value


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The expanded plan as plain YAML data, keys in the documented order, braces escaped."""
    data: dict[str, Any] = {"graphflow": FORMAT_VERSION, "name": templates.escape(plan.name)}
    if plan.model is not None:
        data["model"] = plan.model
    if plan.model_args:
        data["model_args"] = _Flow(plan.model_args)
    if plan.world_size != 1:
        data["world_size"] = plan.world_size
    capture = plan.capture
    by_symbol = capture.size_symbol not in plan.symbols
    symbols = {capture.size_symbol: list(capture.sizes)} if by_symbol else {}
    symbols.update(plan.symbols)
    if symbols:
        data["symbols"] = _Flow(symbols)
    data["families"] = [templates.escape(family.name) for family in plan.families]
    for section in _SECTIONS:
        elements = getattr(plan, section)
        if elements:
            data[section] = {templates.escape(element.name): _fields(element) for element in elements}
    if plan.segments:
        data["segments"] = [_fields(segment, skip=()) for segment in plan.segments]
    if plan.reference is not None:
        data["reference"] = _fields(plan.reference, skip=())
    def sizes(values: tuple[int, ...]) -> Any:
        return capture.size_symbol if by_symbol and values == capture.sizes else list(values)

    settings: dict[str, Any] = {
        "modes": [mode.value for mode in capture.modes],
        "sizes": _Flow({m.value: sizes(capture.sizes_for(m)) for m in (*capture.modes, *capture.mode_sizes)
                        if m in capture.modes or m in capture.mode_sizes})
        if capture.mode_sizes else sizes(capture.sizes),
    }
    if not by_symbol and capture.size_symbol != CaptureSettings().size_symbol:
        settings["size_symbol"] = capture.size_symbol
    settings["warmup_iters"] = capture.warmup_iters
    settings["verify"] = {"atol": capture.atol, "rtol": capture.rtol}
    settings["barrier_timeout_s"] = capture.barrier_timeout_s
    if capture.compile is not None:
        settings["compile"] = _data(capture.compile)
    if capture.warmup is not CaptureSettings().warmup:
        settings["warmup"] = capture.warmup.value
    data["capture"] = settings
    return data


def dump_plan(plan: Plan) -> str:
    """The plan as YAML text (expanded: no ``for_each``); ``loads_plan`` reads it back equal."""
    return yaml.dump(plan_to_dict(plan), Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     allow_unicode=True, width=1 << 20)
