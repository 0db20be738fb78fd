"""Name templates, shared by YAML plans (``for_each``) and decorated models (``position()``).

The grammar is deliberately tiny: ``{var}``, ``{var+N}`` and ``{var-N}``; ``{{`` and
``}}`` are literal braces. Anything else in braces is an error, so a typo never
survives as a buffer name. Where the values come from differs (a YAML plan's
``for_each``, a module's position in its ModuleList), and so does what an unbound
variable means; each caller says that in its own words, through ``unbound``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

__all__ = ["RANGE_PATTERN", "TemplateError", "escape", "expand", "variables"]

#: How YAML spells the values of a ``for_each`` variable as a range: ``range(n)``,
#: ``range(a, b)`` or ``range(a, b, step)``, with nothing else evaluated.
RANGE_PATTERN = r"\s*range\(\s*([+-]?\d+)\s*(?:,\s*([+-]?\d+)\s*(?:,\s*([+-]?\d+)\s*)?)?\)\s*"
_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
_VAR = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:([+-])\s*(\d+)\s*)?\Z")


class TemplateError(ValueError):
    """A template that cannot expand; the caller adds where it was written."""


def variables(text: str) -> tuple[str, ...]:
    """The variables ``text`` uses, in order of first use (malformed braces are left to ``expand``)."""
    found = (_VAR.match(m.group(1)) for m in _TOKEN.finditer(text) if m.group(1) is not None)
    return tuple(dict.fromkeys(var.group(1) for var in found if var is not None))


def expand(text: str, env: Mapping[str, int | str], unbound: Callable[[str], str]) -> str:
    """``text`` with every template replaced by its value in ``env``.

    Raises ``TemplateError``: for braces that are not a template, arithmetic on a string
    value, or a variable ``env`` lacks (``unbound(name)`` gives that message).
    """

    def substitute(match: re.Match) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        if match.group(1) is None:
            raise TemplateError(f"unbalanced {token!r} in {text!r}: write {token * 2!r} for a literal brace")
        var = _VAR.match(match.group(1))
        if var is None:
            raise TemplateError(f"unexpanded {token!r} in {text!r}: templates are {{var}}, {{var+N}} or {{var-N}}")
        name, sign, offset = var.groups()
        if name not in env:
            raise TemplateError(unbound(name))
        value = env[name]
        if sign is not None:
            if not isinstance(value, int):
                raise TemplateError(f"arithmetic on {name!r}, whose value {value!r} is not an integer")
            value = value + int(offset) if sign == "+" else value - int(offset)
        return str(value)

    return _TOKEN.sub(substitute, text)


def escape(text: str) -> str:
    """``text`` as a template that expands to itself: braces doubled."""
    return text.replace("{", "{{").replace("}", "}}")
