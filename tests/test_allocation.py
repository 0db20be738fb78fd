"""Static memory has one answer: what ``show`` and the validator report is what the engine allocates.

Regression tests for two bugs: a buffer's ``capacity`` capped its figures in ``show``
while the engine allocated at it (a KV cache with room for 64 sequences, reported at
the 8 that are captured), and an alias of an alias validated clean and then crashed
allocation with a bare ``KeyError``. Each runs the real pipeline on the CPU backend.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.buffers import StaticBuffers
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Plan, Segment, SegmentKind, Stream
from graphflow.render import format_summary, summarize
from graphflow.validate import validate
from strategies import valid_plans

GRAPH = SegmentKind.GRAPH
CPU = torch.device("cpu")
#: The plans are written for a GPU (streams on cuda:0, which the CPU backend maps to the CPU).
CPU_RUN = RunOptions(backend="cpu", detectors=False)


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
                        capacity={"B": 64, "S": 8}),
                 Buffer("y", ("B", 16), "float32", "cuda:0", role=BufferRole.OUTPUT)],
        streams=[Stream("s0", "cuda:0")],
        segments=[Segment("project", GRAPH, "project", reads=["x"], writes=["kv"], stream="s0"),
                  Segment("attend", GRAPH, "attend", reads=["kv", "cache"], writes=["cache", "y"], stream="s0")],
        symbols={"S": 4},
        capture=CaptureSettings(sizes=(1, 2, 8), warmup_iters=1),
    )


class TestCapacity:
    def test_show_reports_the_bytes_the_engine_allocates(self):
        plan = cache_plan()
        assert validate(plan).diagnostics == ()
        with run_pipeline(plan, CPU_RUN, model=Cache()) as engine:
            allocated = engine.buffers.nbytes()
            assert engine.buffers.tensors["cache"].shape == (64, 8, 16)
        # x, kv, y: 8 rows x 16 float32 each; cache: 64 x 8 x 16 float32
        assert allocated == 3 * 8 * 16 * 4 + 64 * 8 * 16 * 4
        assert shown_static_bytes(plan) == allocated

    def test_validate_judges_the_same_allocation(self):
        allocated = 3 * 8 * 16 * 4 + 64 * 8 * 16 * 4
        assert validate(cache_plan(), device_memory=allocated).diagnostics == ()
        [over] = validate(cache_plan(), device_memory=allocated - 1).diagnostics
        assert over.code == "GF303" and f"take 33.5 KiB ({allocated:,} bytes)" in over.message

    def test_a_view_narrows_the_size_symbol_only(self):
        plan = cache_plan()
        buffers = StaticBuffers(plan, plan.max_size, lambda device: CPU)
        assert buffers.view("cache", 2).shape == (2, 8, 16)
        assert buffers.view("cache", 2).data_ptr() == buffers.tensors["cache"].data_ptr()

    @settings(max_examples=25)
    @given(valid_plans())
    def test_every_buffer_is_allocated_at_the_shape_the_plan_gives(self, plan: Plan):
        buffers = StaticBuffers(plan, plan.max_size, lambda device: CPU)
        for buffer in plan.buffers:
            assert buffers.tensors[buffer.name].shape == plan.allocated_shape(buffer)
        assert buffers.nbytes() == sum(n for device in plan.static_memory().values() for n in device.values())


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


class TestAliasChains:
    def test_a_chain_validates_clean(self):
        assert validate(chain_plan()).diagnostics == ()

    def test_a_chain_allocates_and_writes_through_it_reach_the_root(self):
        with run_pipeline(chain_plan(), CPU_RUN, model=Chain()) as engine:
            tensors = engine.buffers.tensors
            assert tensors["c"].data_ptr() == tensors["b"].data_ptr() == tensors["a"].data_ptr()
            tensors["c"].fill_(7.0)
            assert torch.equal(tensors["a"].reshape(-1)[: tensors["c"].numel()], torch.full((8,), 7.0))
            assert engine.buffers.nbytes() == 3 * 2 * 8 * 4  # x, a, y own storage; b and c are views

    def test_a_cycle_is_refused_by_the_validator_and_by_allocation(self):
        assert "GF204" in validate(chain_plan(cycle=True)).codes()
        with pytest.raises(ValueError, match=r"buffer '\w' aliases '\w', which owns no storage"):
            StaticBuffers(chain_plan(cycle=True), 2, lambda device: CPU)

    def test_the_schedule_sees_the_chain_as_one_storage(self):
        from graphflow.engine.schedule import Hazard, dependencies

        plan = chain_plan()
        assert [(d.source, d.target, d.hazard) for d in dependencies(plan, plan.segments)] == [
            ("fill", "use", Hazard.RAW)]
