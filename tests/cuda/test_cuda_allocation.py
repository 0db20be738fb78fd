"""On a GPU: what ``show`` and the validator report is what the engine allocates there, and
an alias of an alias captures, replays and verifies as views of one storage.

The CPU twins are in ``tests/test_allocation.py``; these run the CUDA backend, so the
buffers are real device allocations and the regions real graphs.
"""

from __future__ import annotations

import re

import pytest
import torch

from graphflow.engine import RunOptions, run_pipeline
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Plan, Segment, SegmentKind, Stream
from graphflow.render import format_summary, summarize
from graphflow.validate import validate

pytestmark = pytest.mark.cuda

GRAPH = SegmentKind.GRAPH
CUDA_RUN = RunOptions(backend="cuda")


class Cache:
    def project(self, x, kv):
        kv.copy_(x)

    def attend(self, kv, cache, y):
        cache.add_(kv.unsqueeze(1))  # cache: [B, S, 16], narrowed to the descriptor's B
        torch.mul(kv, 2.0, out=y)


class Chain:
    def fill(self, x, c):
        c.copy_(x[:, : c.shape[1]])

    def use(self, a, y):
        torch.add(a, 1.0, out=y)


def test_show_reports_the_bytes_the_gpu_allocates_for_a_capacity():
    plan = Plan(
        "kv-cache",
        buffers=[Buffer("x", ("B", 16), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("kv", ("B", 16), "float32", "cuda:0"),
                 Buffer("cache", ("B", "S", 16), "float32", "cuda:0", role=BufferRole.STATE,
                        capacity={"B": 64, "S": 8}),
                 Buffer("y", ("B", 16), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        streams=[Stream("s0", "cuda:0")],
        segments=[Segment("project", GRAPH, "project", reads=["x"], writes=["kv"], stream="s0"),
                  Segment("attend", GRAPH, "attend", reads=["kv", "cache"], writes=["cache", "y"], stream="s0")],
        symbols={"S": 4},
        capture=CaptureSettings(sizes=(1, 2, 8), warmup_iters=1),
    )
    shown = re.search(r"^static memory, allocated once .*\(([\d,]+) bytes\)", format_summary(summarize(plan)), re.M)
    with run_pipeline(plan, CUDA_RUN, model=Cache()) as engine:
        assert engine.report.captures_graphs
        assert engine.buffers.tensors["cache"].shape == (64, 8, 16) and engine.buffers.tensors["cache"].is_cuda
        assert engine.buffers.nbytes() == int(shown.group(1).replace(",", "")) == 3 * 8 * 16 * 4 + 64 * 8 * 16 * 4


def test_an_alias_chain_captures_and_verifies_as_one_storage():
    plan = Plan(
        "chain",
        buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                 Buffer("a", ("B", 8), "float32", "cuda:0"),
                 Buffer("c", ("B", 4), "float32", "cuda:0", alias_of="b"),
                 Buffer("b", ("B", 8), "float32", "cuda:0", alias_of="a"),
                 Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        streams=[Stream("s0", "cuda:0")],
        segments=[Segment("fill", GRAPH, "fill", reads=["x"], writes=["c"], stream="s0"),
                  Segment("use", GRAPH, "use", reads=["a"], writes=["y"], stream="s0")],
        capture=CaptureSettings(sizes=(1, 2), warmup_iters=1),
    )
    assert validate(plan).diagnostics == ()
    with run_pipeline(plan, CUDA_RUN, model=Chain()) as engine:
        tensors = engine.buffers.tensors
        assert tensors["c"].data_ptr() == tensors["b"].data_ptr() == tensors["a"].data_ptr()
        assert engine.report.verify and all(r.bit_exact for r in engine.report.verify)
