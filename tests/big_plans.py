"""Generated plans of any size, for the picture's size cap (tests and ``bench/picture_bench.py``)."""

from __future__ import annotations

import string

from graphflow.plan.loader import loads_plan
from graphflow.plan import Plan, Segment, SegmentKind, Stream


def layered_plan(layers: int = 2500) -> Plan:
    """The plan of ``layered_yaml``."""
    return loads_plan(layered_yaml(layers), file=f"layered-{layers}.yaml")


def layered_yaml(layers: int = 2500) -> str:
    """``layers`` copies of a 4-segment for_each block plus a head: 10,001 segments by default.

    Per copy: a graph segment on s0, an eager break, a graph segment on a side stream s1
    and a graph segment on s0 that joins both and all-reduces, so a picture of it has
    two lanes, event waits, eager breaks and a channel.
    """
    return f"""\
graphflow: 1
name: layered-{4 * layers + 1}
symbols: {{B: [1, 2, 4, 8]}}
for_each: {{layer: "range({layers})"}}
streams:
  s0: {{device: "cuda:0"}}
  s1: {{device: "cuda:0"}}
channels:
  ar: {{kind: all_reduce, group: tp, id: 1, family: target, warmup: real}}
buffers:
  x: {{shape: [B, 32], dtype: float32, device: "cuda:0", role: input}}
  "h{{layer}}": {{shape: [B, 32], dtype: float32, device: "cuda:0"}}
  "m{{layer}}": {{shape: [B, 32], dtype: float32, device: "cuda:0"}}
  "g{{layer}}": {{shape: [B, 32], dtype: float32, device: "cuda:0"}}
  logits: {{shape: [B, 64], dtype: float32, device: "cuda:0", role: output}}
segments:
  - {{name: "L{{layer}}.pre", kind: graph, call: "layers.{{layer}}.pre", stream: s0, reads: [x],
     writes: ["h{{layer}}"]}}
  - {{name: "L{{layer}}.mix", kind: eager, call: "layers.{{layer}}.mix", stream: s0, reads: ["h{{layer}}"],
     writes: ["m{{layer}}"], data_dependent: true}}
  - {{name: "L{{layer}}.side", kind: graph, call: "layers.{{layer}}.side", stream: s1, reads: ["h{{layer}}"],
     writes: ["g{{layer}}"]}}
  - {{name: "L{{layer}}.post", kind: graph, call: "layers.{{layer}}.post", stream: s0,
     reads: ["m{{layer}}", "g{{layer}}", x], writes: [x], channels: [ar]}}
  - {{name: head, kind: graph, call: head, stream: s0, reads: [x], writes: [logits]}}
capture:
  modes: [PIECEWISE]
  sizes: B
"""


def _letters(i: int) -> str:
    word = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        word = string.ascii_lowercase[r] + word
    return word


def chain_plan(n: int = 3000) -> Plan:
    """``n`` graph segments in a chain, every name different and free of digits: nothing to collapse."""
    names = [f"step_{_letters(i)}" for i in range(n)]
    segments = [Segment(name, SegmentKind.GRAPH, name, reads=(names[i - 1],) if i else (), writes=(name,),
                        stream="s0") for i, name in enumerate(names)]
    return Plan(name=f"chain-{n}", streams=[Stream("s0", "cuda:0")], segments=segments)
