"""The published JSON Schema of plan files, generated from the plan classes' fields.

Editors and CI check plan files against ``graphflow/plan/schema/plan.schema.json``. It is
written from the field kinds the loader reads (``graphflow.plan.fields``), so the two cannot
drift: ``python -m graphflow.plan.schema > graphflow/plan/schema/plan.schema.json`` regenerates
it, and a test checks that the committed file is current.

The schema describes a file as written, before ``for_each`` expansion. A string inside
an element may hold a template (``device: "cuda:{layer}"``) that only the loader can
check, once expanded; so wherever a string has a spelling (a device, a dtype, a shape
dimension), any text containing a brace is accepted too. The loader is stricter than
the schema: it also checks templates, duplicate keys and names, and symbol references.
This module imports no torch.
"""

from __future__ import annotations

import enum
import json
from typing import Any

import attrs

from graphflow.plan import fields
from graphflow.plan.loader import FORMAT_VERSION
from graphflow.plan.model import Buffer, CaptureSettings, Channel, Compile, Mode, Plan, Prewarm, Reference, Segment, Stream
from graphflow.plan.templates import RANGE_PATTERN

__all__ = ["plan_schema", "schema_json"]

_ID = "https://github.com/graphflow/graphflow/blob/main/graphflow/schema/plan.schema.json"
#: A string holding a template, which the loader checks once expanded.
_TEMPLATED = {"type": "string", "pattern": "[{}]"}
#: Element definitions: $defs name -> (class, keyed by name in its section).
_ELEMENTS = {"stream": (Stream, True), "buffer": (Buffer, True), "channel": (Channel, True),
             "prewarm": (Prewarm, True), "segment": (Segment, False), "reference": (Reference, False)}
#: Nested settings (``graphflow.plan.fields.Setting``): $defs name -> class.
_SETTINGS = {"compile": Compile}


def _kind(cls: type, name: str) -> fields.Kind:
    return fields.spec(attrs.fields_dict(cls)[name]).kind


def _anchored(pattern: str) -> str:
    return f"^(?:{pattern})$"


def _schema(kind: fields.Kind, templated: bool) -> dict[str, Any]:
    """The JSON Schema of one field kind; ``templated``: a string may hold a template instead."""

    def spelled(schema: dict[str, Any]) -> dict[str, Any]:
        return {"anyOf": [schema, _TEMPLATED]} if templated else schema

    if isinstance(kind, fields.Text):
        if kind.pattern is None:
            return {"type": "string"}
        return spelled({"type": "string", "pattern": _anchored(kind.pattern), "description": kind.what})
    if isinstance(kind, fields.Integer):
        return {"type": "integer"} if kind.minimum is None else {"type": "integer", "minimum": kind.minimum}
    if isinstance(kind, fields.Number):
        if kind.minimum is None:
            return {"type": "number"}
        return {"type": "number", "exclusiveMinimum" if kind.exclusive else "minimum": kind.minimum}
    if isinstance(kind, fields.Flag):
        return {"type": "boolean"}
    if isinstance(kind, fields.Choice):
        return spelled({"enum": list(kind.values)})
    if isinstance(kind, fields.Dimension):
        return {"oneOf": [{"type": "integer", "minimum": 1},
                          spelled({"type": "string", "pattern": _anchored(kind.pattern)})]}
    if isinstance(kind, fields.Sequence):
        return {"type": "array", "items": _schema(kind.item, templated)}
    if isinstance(kind, fields.Table):
        return {"type": "object", "propertyNames": _schema(kind.key, False),
                "additionalProperties": _schema(kind.value, templated)}
    if isinstance(kind, fields.Optional):
        inner = _schema(kind.inner, templated)
        if isinstance(inner.get("type"), str) and len(inner) == 1:
            return {"type": [inner["type"], "null"]}
        return {"oneOf": [{"type": "null"}, inner]}
    if isinstance(kind, fields.OneOf):
        return {"anyOf": [_schema(inner, templated) for inner in kind.kinds]}
    if isinstance(kind, fields.Bounds):
        return {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number"},
                "description": f"{kind.expected}, low < high"}
    if isinstance(kind, fields.Setting):
        name = next(key for key, cls in _SETTINGS.items() if cls is kind.cls)
        return {"description": kind.what, "oneOf": [_schema(_kind(kind.cls, kind.scalar), templated),
                                                    {"type": "boolean"}, {"$ref": f"#/$defs/{name}"}]}
    if isinstance(kind, fields.Data):
        return {"type": ["string", "number", "boolean", "null", "array", "object"]}
    raise TypeError(f"no JSON Schema for a field of kind {kind!r}")  # a plan class declares a new kind


def _json(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_json(item) for item in value]
    if isinstance(value, dict):
        return {str(_json(key)): _json(item) for key, item in value.items()}
    return value


def _property(attribute: attrs.Attribute, templated: bool) -> dict[str, Any]:
    spec = fields.spec(attribute)
    schema = dict(_schema(spec.kind, templated))
    if spec.doc is not None:
        schema["description"] = spec.doc
    default = attribute.default
    if isinstance(default, attrs.Factory):
        default = default.factory()
    if default is not attrs.NOTHING:
        schema["default"] = _json(default)
    return schema


def _object(layout: dict[str, Any], templated: bool, required: tuple[str, ...] = ()) -> dict[str, Any]:
    properties = {}
    for key, attribute in layout.items():
        if isinstance(attribute, dict):
            properties[key] = _object(attribute, templated)
        else:
            properties[key] = _property(attribute, templated)
    schema: dict[str, Any] = {"type": "object"}
    if required:
        schema["required"] = list(required)
    schema.update(additionalProperties=False, properties=properties)
    return schema


def _element(cls: type, keyed: bool) -> dict[str, Any]:
    """An element's mapping: its class's YAML keys, required where the field has no default."""
    layout = fields.yaml_fields(cls, skip=("name",) if keyed else ())
    required = tuple(key for key, attribute in layout.items()
                     if isinstance(attribute, attrs.Attribute) and attribute.default is attrs.NOTHING)
    return _object(layout, templated=True, required=required)


def _capture() -> dict[str, Any]:
    """The capture settings; ``sizes`` names the list symbol, lists sizes, or maps modes to either."""
    schema = _object(fields.yaml_fields(CaptureSettings), templated=False)
    either = {"oneOf": [{"$ref": "#/$defs/identifier"}, {"$ref": "#/$defs/sizes"}]}
    schema["properties"]["sizes"] = {"oneOf": [
        {"$ref": "#/$defs/identifier"}, {"$ref": "#/$defs/sizes"},
        {"type": "object", "additionalProperties": False, "minProperties": 1,
         "description": "Each mode's own sizes: a symbol listing sizes, or a list.",
         "properties": {mode.value: either for mode in Mode}},
    ]}
    return schema


def plan_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a plan file, format version ``FORMAT_VERSION``."""
    plan = attrs.fields_dict(Plan)
    symbols = _kind(Plan, "symbols")
    sections = {f"{name}s" if name != "prewarm" else name: {"type": "object",
                                                            "additionalProperties": {"$ref": f"#/$defs/{name}"}}
                for name, (_, keyed) in _ELEMENTS.items() if keyed}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": _ID,
        "title": f"graphflow capture plan, format version {FORMAT_VERSION}",
        "description": "A YAML capture plan as written (before for_each expansion); see docs/plan-format.md. "
                       "Generated by `python -m graphflow.plan.schema` from the plan classes. Element names and "
                       "string fields may use {var}, {var+N} and {var-N}; {{ and }} are literal braces.",
        "type": "object",
        "required": ["graphflow", "name"],
        "additionalProperties": False,
        "properties": {
            "graphflow": {"description": "Format version.", "const": FORMAT_VERSION},
            "name": _schema(_kind(Plan, "name"), False),
            "model": _property(plan["model"], False),
            "model_args": {**_property(plan["model_args"], False), "type": ["object", "null"]},
            "world_size": _property(plan["world_size"], False),
            "symbols": {
                "description": "An integer is a constant; a list gives the descriptor sizes of that symbol "
                               "(at most one list).",
                "type": "object",
                "propertyNames": {"$ref": "#/$defs/identifier"},
                "additionalProperties": {"oneOf": [_schema(symbols.value, False), {"$ref": "#/$defs/sizes"}]},
            },
            "for_each": {
                "description": "Template variables and their values.",
                "type": "object",
                "propertyNames": {"$ref": "#/$defs/identifier"},
                "additionalProperties": {"oneOf": [
                    {"type": "string", "pattern": _anchored(RANGE_PATTERN)},
                    {"type": "array", "minItems": 1, "uniqueItems": True, "items": {"type": ["integer", "string"]}},
                ]},
            },
            "families": {"type": "array", "uniqueItems": True, "items": {"type": "string"}},
            **{key: sections[key] for key in ("streams", "buffers", "channels", "prewarm")},
            "segments": {"type": "array", "items": {"$ref": "#/$defs/segment"}},
            "reference": {"description": fields.spec(plan["reference"]).doc,
                          "oneOf": [{"type": "null"}, {"$ref": "#/$defs/reference"}]},
            "capture": {"$ref": "#/$defs/capture"},
        },
        "$defs": {
            "identifier": _schema(symbols.key, False),
            "sizes": _schema(_kind(CaptureSettings, "sizes"), False),
            **{name: _element(cls, keyed) for name, (cls, keyed) in _ELEMENTS.items()},
            **{name: _element(cls, False) for name, cls in _SETTINGS.items()},
            "capture": _capture(),
        },
    }


def schema_json() -> str:
    """``plan_schema()`` as the text of ``plan.schema.json``."""
    return json.dumps(plan_schema(), indent=2, ensure_ascii=False) + "\n"
