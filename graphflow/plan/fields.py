"""What each field of a plan element may hold, declared once, on the plan classes.

A field's *kind* (``Integer(minimum=1)``, ``Choice.of(BufferRole)``,
``Sequence(Text(), "buffer names")``...) is read three ways, so the three cannot disagree:

* as the attrs converter and validator of the frozen class: an element built in Python
  with a bad value raises ``FieldTypeError`` or ``FieldValueError`` naming the field, in
  attrs' words: ``'warmup_iters' must be >= 1 (got 0)``;
* by the YAML loader, which reads every value by its field's kind, so its error names
  the file and line of the value that is wrong (``graphflow.plan.loader``);
* by ``graphflow.plan.schema``, which writes the published JSON Schema from the same kinds.

Only facts about one value live here: its type, range, choices or spelling. Whether
values agree with each other (a read of an undeclared buffer, a size above a capacity)
is a rule of ``graphflow.plan.rules``. Converters are lenient (a list becomes a tuple, an
enum's value string becomes the member) and never raise: what they cannot convert is
left for the validator to name. This module imports no torch.
"""

from __future__ import annotations

import difflib
import enum
import re
from collections.abc import Iterable, Mapping
from typing import Any, Union

import attrs

from graphflow.errors import FieldError, FieldTypeError, FieldValueError

__all__ = [
    "Bounds",
    "Choice",
    "Data",
    "Dimension",
    "Elements",
    "Flag",
    "Setting",
    "Instance",
    "Integer",
    "Kind",
    "Number",
    "OneOf",
    "Optional",
    "Sequence",
    "Table",
    "Text",
    "field",
    "spec",
    "yaml_fields",
]

#: Where ``field`` keeps a field's ``Spec`` in the attrs metadata.
_KEY = "graphflow"


class _Kind:
    """A field kind: the attrs validator is ``check`` under the attribute's name."""

    __slots__ = ()

    def __call__(self, instance, attribute: attrs.Attribute, value) -> None:
        self.check(attribute.name, value)

    def convert(self, value):
        return value

    def check(self, path: str, value) -> None:
        raise NotImplementedError


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_list(value) -> bool:
    return isinstance(value, Iterable) and not isinstance(value, (str, bytes, Mapping))


def _tuple(value):
    """A list (any iterable but a string or mapping) as a tuple; anything else as it is, for the check."""
    return tuple(value) if _is_list(value) else value


@attrs.frozen
class Text(_Kind):
    """A string, optionally spelled by ``pattern`` (a regular expression matching all of it)."""

    pattern: str | None = None
    what: str = "a string"

    @property
    def expected(self) -> str:
        return self.what

    def check(self, path: str, value) -> None:
        if not isinstance(value, str):
            raise FieldTypeError(path, self.what, value)
        if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
            raise FieldValueError(path, self.what, value)


@attrs.frozen
class Integer(_Kind):
    """An int (never a bool: ``true`` is not 1 in a plan), at least ``minimum``."""

    minimum: int | None = None

    @property
    def expected(self) -> str:
        return "an integer" if self.minimum is None else f"an integer >= {self.minimum}"

    def check(self, path: str, value) -> None:
        if not _is_int(value):
            raise FieldTypeError(path, "an integer", value)
        if self.minimum is not None and value < self.minimum:
            raise FieldValueError(path, f">= {self.minimum}", value)


@attrs.frozen
class Number(_Kind):
    """A float (ints are converted), at least ``minimum``, or above it when ``exclusive``."""

    minimum: float | None = None
    exclusive: bool = False

    @property
    def bound(self) -> str:
        return f"{'>' if self.exclusive else '>='} {self.minimum:g}"

    @property
    def expected(self) -> str:
        return "a number" if self.minimum is None else f"a number {self.bound}"

    def convert(self, value):
        return float(value) if _is_int(value) else value

    def check(self, path: str, value) -> None:
        if not _is_number(value):
            raise FieldTypeError(path, "a number", value)
        if self.minimum is not None and (value < self.minimum or (self.exclusive and value == self.minimum)):
            raise FieldValueError(path, self.bound, value)


@attrs.frozen
class Choice(_Kind):
    """One of ``values``; with ``enum``, the member (its value string converts to it).

    ``aliases`` maps other spellings people use for a value (``bf16``, ``half``) to the
    values they mean: a refused one is answered with those, where a guess by letters
    alone would be wrong (``float`` reads closest to ``float64``, torch's ``float`` is
    ``float32``).
    """

    values: tuple[str, ...]
    enum: type[enum.Enum] | None = None
    aliases: Mapping[str, tuple[str, ...]] = attrs.field(factory=dict, eq=False, hash=False)

    @classmethod
    def of(cls, kind: type[enum.Enum]) -> Choice:
        return cls(tuple(member.value for member in kind), kind)

    @property
    def expected(self) -> str:
        return f"one of {', '.join(self.values)}"

    def closest(self, value) -> tuple[str, ...]:
        """The values ``value`` most likely meant: by its alias, spelled in any case or
        with a ``torch.`` prefix, else the closest by letters; none when nothing is close."""
        if not isinstance(value, str):
            return ()
        word = value.strip()
        folded = word.lower().removeprefix("torch.")
        by_case = {v.lower(): v for v in self.values}
        if folded in by_case and by_case[folded] != value:
            return (by_case[folded],)
        if folded in self.aliases:
            return tuple(self.aliases[folded])
        return tuple(difflib.get_close_matches(word, self.values, n=1)
                     or [by_case[m] for m in difflib.get_close_matches(folded, list(by_case), n=1)])

    def convert(self, value):
        if self.enum is not None and isinstance(value, str) and value in self.values:
            return self.enum(value)
        return value

    def check(self, path: str, value) -> None:
        if self.enum is not None:
            if not isinstance(value, self.enum):
                if isinstance(value, str):
                    raise FieldValueError(path, self.expected, value, self.closest(value))
                raise FieldTypeError(path, self.expected, value)
        elif not isinstance(value, str):
            raise FieldTypeError(path, self.expected, value)
        elif value not in self.values:
            raise FieldValueError(path, self.expected, value, self.closest(value))


@attrs.frozen
class Dimension(_Kind):
    """A shape dimension: an int >= 1, or a string spelled by ``pattern`` (``B``, ``2*B``)."""

    pattern: str

    @property
    def expected(self) -> str:
        return "an int >= 1, a symbol or a product like '2*B'"

    def check(self, path: str, value) -> None:
        if _is_int(value):
            if value < 1:
                raise FieldValueError(path, ">= 1", value)
        elif not isinstance(value, str):
            raise FieldTypeError(path, self.expected, value)
        elif re.fullmatch(self.pattern, value) is None:
            raise FieldValueError(path, self.expected, value)


@attrs.frozen
class Sequence(_Kind):
    """A tuple of ``item`` (any list or iterable converts); ``what`` names the items."""

    item: Kind
    what: str

    @property
    def expected(self) -> str:
        return f"a list of {self.what}"

    def convert(self, value):
        return tuple(self.item.convert(item) for item in value) if _is_list(value) else value

    def check(self, path: str, value) -> None:
        if not isinstance(value, tuple):
            raise FieldTypeError(path, self.expected, value)
        for index, item in enumerate(value):
            self.item.check(f"{path}[{index}]", item)


@attrs.frozen
class Table(_Kind):
    """A mapping of ``key`` to ``value``; ``sort`` orders it by key, so equal tables print alike."""

    key: Kind
    value: Kind
    what: str
    sort: bool = False

    @property
    def expected(self) -> str:
        return f"a mapping of {self.what}"

    def convert(self, value):
        if not isinstance(value, Mapping):
            return value
        items = [(self.key.convert(k), self.value.convert(v)) for k, v in value.items()]
        return dict(sorted(items, key=lambda item: str(item[0])) if self.sort else items)

    def check(self, path: str, value) -> None:
        if not isinstance(value, Mapping):
            raise FieldTypeError(path, self.expected, value)
        for key, item in value.items():
            try:
                self.key.check(path, key)
            except FieldError as exc:
                raise type(exc)(f"{path} key", exc.expected, key) from None
            self.value.check(f"{path}.{getattr(key, 'value', key)}", item)


@attrs.frozen
class Optional(_Kind):
    """``inner`` or None (``null`` in YAML: "not set")."""

    inner: Kind

    @property
    def expected(self) -> str:
        return f"{self.inner.expected} or null"

    def convert(self, value):
        return None if value is None else self.inner.convert(value)

    def check(self, path: str, value) -> None:
        if value is not None:
            self.inner.check(path, value)


@attrs.frozen
class OneOf(_Kind):
    """A value of the first of ``kinds`` that takes it (``pad: 64`` or ``pad: keep``)."""

    kinds: tuple[Kind, ...]

    @property
    def expected(self) -> str:
        return " or ".join(kind.expected for kind in self.kinds)

    def convert(self, value):
        for kind in self.kinds:
            converted = kind.convert(value)
            try:
                kind.check("value", converted)
            except FieldError:
                continue
            return converted
        return value

    def check(self, path: str, value) -> None:
        errors = []
        for kind in self.kinds:
            try:
                kind.check(path, value)
            except FieldError as exc:
                errors.append(exc)
                continue
            return
        kind = FieldTypeError if all(isinstance(e, FieldTypeError) for e in errors) else FieldValueError
        raise kind(path, self.expected, value)


@attrs.frozen
class Bounds(_Kind):
    """A half-open range ``[low, high)`` of two numbers with ``low < high``."""

    @property
    def expected(self) -> str:
        return "two numbers [low, high)"

    def convert(self, value):
        return _tuple(value)

    def check(self, path: str, value) -> None:
        if not isinstance(value, tuple):
            raise FieldTypeError(path, self.expected, value)
        if len(value) != 2:
            raise FieldValueError(path, self.expected, value)
        for index, bound in enumerate(value):
            if not _is_number(bound):
                raise FieldTypeError(f"{path}[{index}]", "a number", bound)
        if value[0] >= value[1]:
            raise FieldValueError(path, "[low, high) with low < high", value)


@attrs.frozen
class Elements(_Kind):
    """A tuple of plan elements of one class (a plan's buffers, segments...)."""

    cls: type

    @property
    def expected(self) -> str:
        return f"a list of {self.cls.__name__} elements"

    def convert(self, value):
        return _tuple(value)

    def check(self, path: str, value) -> None:
        if not isinstance(value, tuple):
            raise FieldTypeError(path, self.expected, value)
        for index, item in enumerate(value):
            if not isinstance(item, self.cls):
                raise FieldTypeError(f"{path}[{index}]", f"a {self.cls.__name__}", item)


@attrs.frozen
class Instance(_Kind):
    """An instance of ``cls`` (a plan's capture settings); ``what`` says it in words."""

    cls: type
    what: str | None = None

    @property
    def expected(self) -> str:
        return self.what or f"a {self.cls.__name__}"

    def check(self, path: str, value) -> None:
        if not isinstance(value, self.cls):
            raise FieldTypeError(path, self.expected, value)


@attrs.frozen
class Flag(Instance):
    """A bool (never 1 or "true")."""

    cls: type = bool
    what: str | None = "true or false"


@attrs.frozen
class Setting(_Kind):
    """A nested element of class ``cls``, also spelled shortly: a mapping of its fields,
    a string meaning ``{scalar: string}``, or a bool meaning ``{switch: bool}``
    (``compile: inductor``, ``compile: false``, ``compile: {mode: ...}``).

    A mapping ``cls`` refuses is left as it is by the converter; the check then builds
    it again to name the inner field that is wrong (``'compile.mode' must be ...``).
    """

    cls: type
    scalar: str
    switch: str
    what: str

    @property
    def expected(self) -> str:
        return self.what

    def convert(self, value):
        if isinstance(value, bool):
            value = {self.switch: value}
        elif isinstance(value, str):
            value = {self.scalar: value}
        if isinstance(value, Mapping):
            try:
                return self.cls(**value)
            except (FieldError, TypeError):
                return value
        return value

    def check(self, path: str, value) -> None:
        if isinstance(value, self.cls):
            return
        if not isinstance(value, Mapping):
            raise FieldTypeError(path, self.what, value)
        known = [a.name for a in attrs.fields(self.cls)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise FieldValueError(f"{path} key", f"one of {', '.join(known)}", unknown[0])
        try:
            self.cls(**value)
        except FieldError as exc:
            raise type(exc)(f"{path}.{exc.field}", exc.expected, exc.value) from None


@attrs.frozen
class Data(_Kind):
    """Plain data, as YAML holds it: strings, numbers, bools, null, lists and string-keyed mappings."""

    @property
    def expected(self) -> str:
        return "plain data (strings, numbers, bools, null, lists and mappings)"

    def check(self, path: str, value) -> None:
        if value is None or isinstance(value, (str, int, float, bool)):
            return
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                self.check(f"{path}[{index}]", item)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                if not isinstance(key, str):
                    raise FieldTypeError(f"{path} key", "a string", key)
                self.check(f"{path}.{key}", item)
        else:
            raise FieldTypeError(path, self.expected, value)


Kind = Union[Text, Integer, Number, Flag, Choice, Dimension, Sequence, Table, Optional, OneOf, Bounds, Elements,
             Instance, Setting, Data]


@attrs.frozen
class Spec:
    """What ``field`` records about an attribute: its kind, its YAML key, a line of documentation.

    ``key`` is the YAML key the attribute is written under (its name when None; a
    dotted key such as ``verify.atol`` nests); ``in_yaml`` is false for a field YAML
    spells another way (the loader builds it).
    """

    kind: Kind
    key: str | None = None
    doc: str | None = None
    in_yaml: bool = True


def field(kind: Kind, *, key: str | None = None, doc: str | None = None, in_yaml: bool = True, **kwargs: Any):
    """An attrs field whose converter and validator are ``kind``'s, with its ``Spec`` in the metadata.

    Other keyword arguments (``default``, ``factory``, ``hash``...) go to ``attrs.field``.
    """
    return attrs.field(converter=kind.convert, validator=kind, metadata={_KEY: Spec(kind, key, doc, in_yaml)},
                       **kwargs)


def spec(attribute: attrs.Attribute) -> Spec | None:
    """The ``Spec`` of an attribute declared with ``field``, else None."""
    return attribute.metadata.get(_KEY)


def yaml_fields(cls: type, *, skip: tuple[str, ...] = ()) -> dict[str, attrs.Attribute | dict[str, attrs.Attribute]]:
    """An element class's YAML keys, in field order: key -> attribute, or -> {sub-key: attribute}
    for dotted keys (``verify: {atol, rtol}``). Fields in ``skip`` and fields YAML spells
    another way are left out."""
    layout: dict[str, Any] = {}
    for attribute in attrs.fields(cls):
        found = spec(attribute)
        if attribute.name in skip or found is None or not found.in_yaml:
            continue
        outer, _, inner = (found.key or attribute.name).partition(".")
        if inner:
            layout.setdefault(outer, {})[inner] = attribute
        else:
            layout[outer] = attribute
    return layout
