"""Two small plans and their models, shared by the CPU and CUDA allocation tests.

``cache_plan``: a KV cache whose capacity (64 sequences, 8 positions) is above what is
captured (8, 4), so its allocation differs from its largest descriptor's view.
``chain_plan``: ``c`` aliases ``b``, which aliases ``a``, declared with ``c`` first so
allocation must follow the chain, not the list; ``cycle=True`` closes it.
"""

from __future__ import annotations

import re

import torch

from graphflow.plan import Buffer, BufferRole, CaptureSettings, Plan, Segment, SegmentKind, Stream
from graphflow.view.render import format_summary, summarize

GRAPH = SegmentKind.GRAPH
#: The cache plan's static bytes: x, kv, y at 8 rows x 16 float32, the cache at 64 x 8 x 16.
CACHE_BYTES = 3 * 8 * 16 * 4 + 64 * 8 * 16 * 4


def shown_static_bytes(plan: Plan) -> int:
    """The byte count ``graphflow show`` prints in its memory section."""
    text = format_summary(summarize(plan))
    return int(re.search(r"^static memory, allocated once .*\(([\d,]+) bytes\)", text, re.M).group(1).replace(",", ""))


class Cache:
    """A model whose step appends to a KV cache sized for more sequences than are captured."""

    def project(self, x, kv):
        kv.copy_(x)

    def attend(self, kv, cache, y):
        cache.add_(kv.unsqueeze(1))  # cache: [B, S, 16], narrowed to the descriptor's B
        torch.mul(kv, 2.0, out=y)


def cache_plan() -> Plan:
    return Plan(
        "kv-cache",
        buffers=[Buffer("x", ("B", 16), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("kv", ("B", 16), "float32", "cuda:0"),
                 Buffer("cache", ("B", "S", 16), "float32", "cuda:0", role=BufferRole.STATE,
                        capacity={"B": 64, "S": 8}, pad="keep"),
                 Buffer("y", ("B", 16), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        streams=[Stream("s0", "cuda:0")],
        segments=[Segment("project", GRAPH, "project", reads=["x"], writes=["kv"], stream="s0"),
                  Segment("attend", GRAPH, "attend", reads=["kv", "cache"], writes=["cache", "y"], stream="s0")],
        symbols={"S": 4},
        capture=CaptureSettings(sizes=(1, 2, 8), warmup_iters=1),
    )


class Chain:
    """Writes through ``c`` (a view of ``b``, itself a view of ``a``) and reads ``a``."""

    def fill(self, x, c):
        c.copy_(x[:, : c.shape[1]])

    def use(self, a, y):
        y.copy_(a)


def chain_plan(*, cycle: bool = False) -> Plan:
    # ``c`` is declared before ``b``: allocation must order by the chain, not the list.
    return Plan(
        "chain",
        buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("a", ("B", 8), "float32", "cuda:0", alias_of="c" if cycle else None),
                 Buffer("c", ("B", 4), "float32", "cuda:0", alias_of="b"),
                 Buffer("b", ("B", 8), "float32", "cuda:0", alias_of="a"),
                 Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        streams=[Stream("s0", "cuda:0")],
        segments=[Segment("fill", GRAPH, "fill", reads=["x"], writes=["c"], stream="s0"),
                  Segment("use", GRAPH, "use", reads=["a"], writes=["y"], stream="s0")],
        capture=CaptureSettings(sizes=(1, 2), warmup_iters=1),
    )
