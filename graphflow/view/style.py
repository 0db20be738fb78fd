"""The colors the DOT view and the picture share, so both draw a plan alike."""

from __future__ import annotations

from graphflow.plan import Plan

__all__ = ["EAGER", "PALETTE", "REGION_EDGE", "REGION_FILL", "family_colors", "lighten"]

#: Fill colors of graph segments by family, in the order families are declared.
PALETTE = ("#4C72B0", "#55A868", "#8172B2", "#CCB974", "#64B5CD", "#937860", "#DA8BC3")
EAGER = "#C44E52"
REGION_FILL = "#FFF4CC"
REGION_EDGE = "#D9B44A"


def family_colors(plan: Plan) -> dict[str, str]:
    names = [f.name for f in plan.families]
    names += [s.family for s in plan.segments if s.family not in names]
    names = list(dict.fromkeys(names))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def lighten(color: str, amount: float = 0.65) -> str:
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    r, g, b = (round(c + (255 - c) * amount) for c in (r, g, b))
    return f"#{r:02X}{g:02X}{b:02X}"
