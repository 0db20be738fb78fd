"""Static memory has one answer: what ``show`` and the validator report is what the engine allocates.

Regression tests for two bugs: a buffer's ``capacity`` capped its figures in ``show``
while the engine allocated at it (a KV cache with room for 64 sequences, reported at
the 8 that are captured), and an alias of an alias validated clean and then crashed
allocation with a bare ``KeyError``. Each runs the real pipeline on the CPU backend.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.buffers import StaticBuffers
from graphflow.plan import Buffer, CaptureSettings, Plan, eval_dim
from graphflow.plan.rules import validate
from strategies import valid_plans
from tests.allocation_plans import CACHE_BYTES, Cache, Chain, cache_plan, chain_plan, shown_static_bytes

CPU = torch.device("cpu")
#: The plans are written for a GPU (streams on cuda:0, which the CPU backend maps to the CPU).
CPU_RUN = RunOptions(backend="cpu", detectors=False)


class TestCapacity:
    def test_show_reports_the_bytes_the_engine_allocates(self):
        plan = cache_plan()
        assert validate(plan).diagnostics == ()
        with run_pipeline(plan, CPU_RUN, model=Cache()) as engine:
            allocated = engine.buffers.nbytes()
            assert engine.buffers.tensors["cache"].shape == (64, 8, 16)
        assert allocated == CACHE_BYTES
        assert shown_static_bytes(plan) == allocated

    def test_validate_judges_the_same_allocation(self):
        assert validate(cache_plan(), device_memory=CACHE_BYTES).diagnostics == ()
        [over] = validate(cache_plan(), device_memory=CACHE_BYTES - 1).diagnostics
        assert over.code == "GF303" and f"take 33.5 KiB ({CACHE_BYTES:,} bytes)" in over.message

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


#: Dimensions as a plan spells them: ints, the size symbol, another symbol, products of them.
_DIMS = st.sampled_from([3, "B", "H", "2*B", "B*H", "B*B", "4*H", "2*B*H"])


class TestViews:
    @settings(max_examples=60)
    @given(shapes=st.lists(st.lists(_DIMS, min_size=0, max_size=4), min_size=1, max_size=4),
           sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3, unique=True),
           capacity=st.one_of(st.none(), st.integers(1, 9)), size=st.integers(1, 6))
    def test_a_view_at_any_size_has_the_shape_the_plan_gives_and_shares_the_storage(self, shapes, sizes, capacity,
                                                                                       size):
        buffers = [Buffer(f"b{i}", tuple(shape), "float32", "cpu", capacity={"B": capacity} if capacity else {})
                   for i, shape in enumerate(shapes)]
        plan = Plan("views", buffers=buffers, symbols={"H": 2}, capture=CaptureSettings(sizes=tuple(sizes)))
        static = StaticBuffers(plan, plan.max_size, lambda device: CPU)
        if any("B" in str(d) for b in buffers for d in b.shape) and size > min(static.capacity(b.name) for b in buffers):
            size = 1  # a view larger than its allocation is the runtime's fallback, not a view
        views = static.views(size)
        for buffer in buffers:
            want = tuple(eval_dim(d, plan.buffer_values(buffer, size)) for d in buffer.shape)
            for view in (views[buffer.name], static.view(buffer.name, size),
                         static.narrow(buffer.name, torch.empty_like(static.tensors[buffer.name]), size)):
                assert tuple(view.shape) == want, (buffer.shape, size)
            assert views[buffer.name].data_ptr() == static.tensors[buffer.name].data_ptr()


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
        from graphflow.plan.schedule import Hazard, dependencies

        plan = chain_plan()
        assert [(d.source, d.target, d.hazard) for d in dependencies(plan, plan.segments)] == [
            ("fill", "use", Hazard.RAW)]
