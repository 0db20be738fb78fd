"""Plain Python values a step changes are named at warmup, before anything is captured.

A graph keeps such a value as it was at capture (tests/cuda/test_cuda_host_state.py shows
the wrong replay on a GPU); here, on the CPU backend, the check itself: which values it
reads, how it names them, what it leaves alone.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.model.host_state import changes, snapshot
from graphflow.errors import CaptureError
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from plans.toy_model import build_toy, toy_plan


class Counter:
    """A position kept on the host, as Hugging Face's sliding-window cache layers kept one."""

    def __init__(self):
        self.position = 0
        self.window = (4, 4)


class Stepper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cache = type("Cache", (), {})()
        self.cache.layers = [Counter(), Counter()]
        self.lengths = torch.zeros((), dtype=torch.int64)

    def forward_step(self, x, y):
        torch.matmul(x, self.lin.weight.t(), out=y)
        for layer in self.cache.layers:
            layer.position += 1  # the host copy of the length: a graph would keep one value of it


def stepper_plan(**capture):
    return Plan("stepper", buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                                    Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("step", SegmentKind.GRAPH, "forward_step", reads=("x",), writes=("y",),
                                  stream="s0")],
                capture=CaptureSettings(modes=(Mode.FULL,), sizes=(2, 1), **capture))


def test_a_value_the_step_changes_is_named_with_both_values():
    with pytest.raises(CaptureError) as info:
        run_pipeline(stepper_plan(), RunOptions(backend="cpu"), model=Stepper())
    error = info.value
    assert error.phase == "warmup" and error.descriptor.size == 2
    assert "cache.layers.0.position: 0 -> 1" in error.message and "cache.layers.1.position: 0 -> 1" in error.message
    assert "2 value(s)" in error.message
    assert "adopt" in error.hint and "disabled_checks={'host_state'}" in error.hint
    assert "verify" not in error.hint  # never a way around it by checking less


def test_warmup_iterations_name_the_last_steps_values():
    with pytest.raises(CaptureError, match=r"cache.layers.0.position: 2 -> 3"):
        run_pipeline(stepper_plan(warmup_iters=3), RunOptions(backend="cpu", verify=False), model=Stepper())


def test_it_watches_where_the_detectors_do_and_can_be_turned_off():
    engine = run_pipeline(stepper_plan(), RunOptions(backend="cpu", disabled_checks={"host_state"}), model=Stepper())
    engine.close()
    engine = run_pipeline(stepper_plan(), RunOptions(backend="cpu", detectors=False), model=Stepper())
    engine.close()


def test_values_set_for_the_first_time_and_tensors_are_not_changes():
    class Lazy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward_step(self, x, y):
            if not hasattr(self, "width"):
                self.width = x.shape[1]  # lazy initialization at the first call: done before capture
            torch.matmul(x, self.lin.weight.t(), out=y)
            self.lin.weight.data.mul_(1.0)  # tensors are the plan's business, not this check's

    run_pipeline(stepper_plan(), RunOptions(backend="cpu"), model=Lazy()).close()


def test_the_toy_plans_change_no_host_state():
    for plan in (toy_plan(2), toy_plan(2, full=True, modes=(Mode.FULL,))):
        run_pipeline(plan, RunOptions(backend="cpu", detectors="all"), model=build_toy(2)).close()


def test_the_snapshot_reads_plain_values_by_path():
    model = Stepper()
    model.scale = 0.5
    model.flags = (True, 3)
    model.cache.layers.append(model.cache.layers[0])  # seen once, under its first path
    model.cache.self = model.cache  # a cycle ends
    state = snapshot(model)
    assert state["scale"] == 0.5 and state["flags"] == (True, 3)
    assert state["cache.layers.0.position"] == 0 and state["cache.layers.1.window"] == (4, 4)
    assert not any(path.startswith("cache.layers.2") for path in state)
    assert "training" not in state and "lin.training" not in state
    assert not any("weight" in path or "lengths" in path for path in state)
    assert state["lin.in_features"] == 8


def test_an_adopted_tensors_owner_is_read_under_its_own_path():
    holder = Counter()
    state = snapshot(object(), {"pool.layers.0": holder})
    assert state == {"pool.layers.0.position": 0, "pool.layers.0.window": (4, 4)}


scalars = st.one_of(st.integers(-3, 3), st.booleans(), st.floats(-2, 2, allow_nan=False),
                    st.tuples(st.integers(0, 3), st.integers(0, 3)))


@given(st.dictionaries(st.sampled_from("abcdef"), scalars), st.dictionaries(st.sampled_from("abcdef"), scalars))
def test_changes_are_the_paths_in_both_whose_values_differ(before, after):
    found = changes(before, after)
    assert {path for path, _, _ in found} == {p for p in before.keys() & after.keys() if before[p] != after[p]}
    assert all((before[p], after[p]) == (old, new) for p, old, new in found)


def test_a_plans_holders_are_the_adopted_tensors_owners():
    """A buffer that adopts ``pool.0.keys`` makes ``pool.0`` a holder: its plain values are
    read though the walk from the model cannot reach it (a container without attributes)."""

    class Pool:
        def __init__(self):
            self.keys = None
            self.filled = 0

    class Slots:
        __slots__ = ("items",)

        def __init__(self, *items):
            self.items = list(items)

        def __getitem__(self, index):
            return self.items[index]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.pool = Slots(Pool())

        def forward_step(self, x, y):
            torch.matmul(x, self.lin.weight.t(), out=y)
            self.pool[0].keys.add_(1.0)
            self.pool[0].filled += 1

    assert "pool.0.filled" not in snapshot(Model())

    plan = stepper_plan()
    plan = attrs.evolve(plan, buffers=[*plan.buffers, Buffer("keys", ("B", 8), "float32", "cuda:0",
                                                               role=BufferRole.STATE, adopt="pool.0.keys")],
                        segments=[attrs.evolve(plan.segments[0], reads=("x", "keys"), writes=("keys", "y"))])
    with pytest.raises(CaptureError, match=r"pool.0.filled: 0 -> 1"):
        run_pipeline(plan, RunOptions(backend="cpu", verify=False), model=Model())
