"""Bytes, counts and runs of numbers as people read them, for every layer's messages.

A 61-layer plan names hundreds of buffers: messages group what a template repeated
(``q0`` .. ``q60`` becomes ``q{0..60}``) and state sizes in binary units, the same way
in a validation finding, an engine error and ``graphflow show``. Plain Python: no plan,
no torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs

__all__ = ["Group", "compact_sizes", "format_bytes", "group_by_template", "heaviest", "plural"]


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


@attrs.frozen
class _Named:
    name: str


def heaviest(sizes: Mapping[str, int], n: int = 3) -> str:
    """The ``n`` heaviest of some buffers' byte counts, grouped by template the way
    ``graphflow show`` groups them: ``kv_cache{0..60} (7.6 GiB in 61 buffers), ...``."""
    groups = group_by_template([_Named(name) for name in sizes])
    weighed = sorted(((sum(sizes[m.name] for m in g.members), g) for g in groups), key=lambda item: -item[0])
    return ", ".join(f"{g.label} ({format_bytes(total)}{f' in {len(g.members)} buffers' if len(g.members) > 1 else ''})"
                     for total, g in weighed[:n])


def plural(n: int, word: str) -> str:
    """``1 segment``, ``1,220 segments``: counts as the summaries print them."""
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"
