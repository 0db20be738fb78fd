"""Outputs kept where the graph returns them (``graphflow.engine.model.returned``): which
buffers qualify, what a capture keeps, and how the runner and verify find them.

Only the bookkeeping runs here: the CPU backend records no graph, so it keeps nothing
and copies as before; ``tests/cuda/test_cuda_returned.py`` captures real graphs.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import given, settings
from torch.multiprocessing.reductions import StorageWeakRef

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.buffers import StaticBuffers
from graphflow.engine.execute import SegmentCall
from graphflow.engine.model.returned import Placed, placeable, unowned
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Descriptor, Mode, Plan, Segment, SegmentKind, Stream
from graphflow.runtime import Runner
from tests.strategies import valid_plans
from tests.test_real_models import MLP

G, E = SegmentKind.GRAPH, SegmentKind.EAGER


def plan_of(*segments: Segment, extra=()) -> Plan:
    buffers = [Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
               Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT), *extra]
    return Plan("returned", buffers=buffers, streams=(Stream("s0", "cuda:0"),), segments=segments,
                capture=CaptureSettings(modes=(Mode.FULL,), sizes=(1, 2), warmup_iters=1))


HEAD = Segment("head", G, "forward", inputs={"x": "x"}, returns=("y",), stream="s0")


class TestPlaceable:
    def test_an_output_a_graph_segment_returns_and_nothing_reads(self):
        plan = plan_of(HEAD)
        assert placeable(plan, plan.segments) == {"y"}

    def test_not_an_output_a_later_segment_reads(self):
        plan = plan_of(HEAD, Segment("after", G, "after", reads=("y",), writes=("z",), stream="s0"),
                       extra=[Buffer("z", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)])
        assert placeable(plan, plan.segments) == frozenset()

    def test_not_one_an_eager_segment_returns(self):
        plan = plan_of(attrs.evolve(HEAD, kind=E))
        assert placeable(plan, plan.segments) == frozenset()

    def test_not_a_state_buffer_nor_one_another_buffer_aliases(self):
        state = plan_of(Segment("head", G, "forward", inputs={"x": "x"}, returns=("s",), stream="s0"),
                        extra=[Buffer("s", ("B", 8), "float32", "cuda:0", role=BufferRole.STATE)])
        assert placeable(state, state.segments) == frozenset()
        aliased = plan_of(HEAD, extra=[Buffer("view", ("B", 8), "float32", "cuda:0", role=BufferRole.INTERNAL,
                                              alias_of="y")])
        assert placeable(aliased, aliased.segments) == frozenset()

    @settings(max_examples=60, deadline=None)
    @given(valid_plans())
    def test_every_buffer_it_names_is_an_unread_output_one_graph_segment_returns(self, plan):
        segments = plan.segments
        for name in placeable(plan, segments):
            assert plan.buffer(name).role is BufferRole.OUTPUT
            assert [s.name for s in segments if name in s.writes] == [
                s.name for s in segments if s.is_graph and name in s.returns]
            assert not any(name in s.reads for s in segments)


class TestPlaced:
    def test_keeps_a_tensor_of_its_buffers_dtype_and_device_and_nothing_else(self):
        views = {"y": torch.zeros(2, 8), "z": torch.zeros(2, 8)}
        known = []

        class Detectors:
            def add_known(self, tensors):
                known.extend(tensors)

        placed = Placed(frozenset({"y"}), views, Detectors())
        value = torch.ones(2, 8)
        assert placed("y", value) and placed.tensors == {"y": value} and known == [value]
        assert not placed("z", torch.ones(2, 8)), "not placeable: copied"
        assert not placed("y", torch.ones(2, 8, dtype=torch.float64)), "another dtype: the copy converts it"

    def test_hands_its_tensors_over_as_aliases_that_keep_no_memory(self):
        placed = Placed(frozenset({"y"}), {"y": torch.zeros(2, 8)})
        value = torch.arange(24.0).reshape(3, 8)[1:]
        placed("y", value)
        weak = StorageWeakRef(value.untyped_storage())
        (alias,) = placed.unowned().values()
        assert alias.data_ptr() == value.data_ptr() and torch.equal(alias, value) and alias.stride() == value.stride()
        assert placed.tensors == {}
        del value
        assert weak.expired(), "the alias does not keep the returned tensor's memory"

    def test_unowned_views_the_same_memory(self):
        base = torch.zeros(4, 8)
        alias = unowned(base[1:3])
        base[1:3] = 5.0
        assert bool((alias == 5.0).all())


class TestViewsOf:
    def test_a_descriptors_placed_outputs_replace_only_its_own_views(self):
        plan = plan_of(HEAD)
        buffers = StaticBuffers(plan, 2, lambda _: torch.device("cpu"))
        full, piecewise = Descriptor(Mode.FULL, 2), Descriptor(Mode.PIECEWISE, 2)
        assert buffers.views_of(full) is buffers.views(2)
        kept = torch.ones(2, 8)
        buffers.place(full, {"y": kept})
        assert buffers.views_of(full)["y"] is kept and buffers.views_of(full)["x"] is buffers.views(2)["x"]
        assert buffers.views_of(piecewise)["y"] is buffers.views(2)["y"]
        buffers.unplace(full)
        assert buffers.views_of(full) is buffers.views(2)


class TestBind:
    def test_a_kept_return_is_not_copied_and_one_not_kept_is(self):
        call = SegmentCall("head", lambda x: x * 2, keywords=(("x", "x"),), returns=("y",))
        views = {"x": torch.ones(2, 8), "y": torch.zeros(2, 8)}
        call.bind(views, lambda buffer, value: True)()
        assert bool((views["y"] == 0).all())
        call.bind(views, lambda buffer, value: False)()
        assert bool((views["y"] == 2).all())


def test_on_the_cpu_backend_nothing_is_kept_and_the_runner_reads_the_buffer():
    plan = plan_of(HEAD)
    model = MLP().eval()
    with run_pipeline(plan, RunOptions(backend="cpu"), model=model) as engine:
        x = torch.randn(2, 8)
        (y,) = Runner(engine).run(x)
        assert y.data_ptr() == engine.buffers.tensors["y"].data_ptr()
        assert torch.equal(y, model(x))
