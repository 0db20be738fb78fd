"""Source lines tagged ``# <name>``, so a test compares the place a finding names with
the exact line that made the call."""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["marked"]


def marked(file: str) -> Callable[[str], str]:
    """``at(name)``: ``file.py:N`` of the one line of ``file`` tagged ``# <name>``."""
    with open(file, encoding="utf-8") as source:
        lines = source.read().splitlines()
    base = os.path.basename(file)

    def at(marker: str) -> str:
        tag = f"# <{marker}>"
        (number,) = [i for i, text in enumerate(lines, 1) if text.rstrip().endswith(tag)]
        return f"{base}:{number}"

    return at
