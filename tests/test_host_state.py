"""Plain Python values that graph code changes are named at warmup, before anything is captured.

A graph keeps such a value as it was at capture (tests/cuda/test_cuda_host_state.py shows
the wrong replay on a GPU, and runs these cases on the CUDA backend); here, on the CPU
backend, the check itself: what it refuses (a counter in a graph segment, in a list, in a
dataclass or attrs instance, a list that grows), what it lets through (a value that
follows the batch size, a counter an eager segment or a break keeps), that its verdict
does not depend on how many warmup steps ran or which size ran before, which values it
reads and how it names them.
"""

from __future__ import annotations

import dataclasses

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from graphflow.engine import RunOptions, run_pipeline
from graphflow.engine.model.host_state import DEPTH, ITEMS, Reader, StepWatch, changes
from graphflow.errors import CaptureError
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from plans.toy_model import build_toy, toy_plan


class Counter:
    """A position kept on the host, as Hugging Face's sliding-window cache layers kept one."""

    def __init__(self):
        self.position = 0
        self.window = (4, 4)


class Stepper(torch.nn.Module):
    """One graph segment (``forward_step``) that advances positions kept in Python."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.cache = type("Cache", (), {})()
        self.cache.layers = [Counter(), Counter()]
        self.lengths = torch.zeros((), dtype=torch.int64)

    def forward_step(self, x, y):
        torch.matmul(x, self.lin.weight.t(), out=y)
        self.update(x)

    def update(self, x):
        for layer in self.cache.layers:
            layer.position += 1  # the host copy of the length: a graph would keep one value of it


def stepper_plan(sizes=(2, 1), modes=(Mode.FULL,), **capture):
    return Plan("stepper", buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                                    Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("step", SegmentKind.GRAPH, "forward_step", reads=("x",), writes=("y",),
                                  stream="s0")],
                capture=CaptureSettings(modes=modes, sizes=sizes, **capture))


class Split(torch.nn.Module):
    """A graph segment, an eager segment, a graph segment: ``pre``, ``mix`` and ``post``
    each call ``update`` when the test says so."""

    def __init__(self, updates=()):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.updates = set(updates)

    def pre(self, x, h):
        torch.matmul(x, self.lin.weight.t(), out=h)
        self._maybe("pre", x)

    def mix(self, h):
        h.mul_(0.5)
        self._maybe("mix", h)

    def post(self, h, y):
        torch.tanh(h, out=y)
        self._maybe("post", h)

    def _maybe(self, where, x):
        if where in self.updates:
            self.update(x)

    def update(self, x):
        raise NotImplementedError


def split_plan(sizes=(4, 2), **capture):
    return Plan("split", buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                                  Buffer("h", ("B", 8), "float32", "cuda:0"),
                                  Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("pre", SegmentKind.GRAPH, "pre", reads=("x",), writes=("h",), stream="s0"),
                          Segment("mix", SegmentKind.EAGER, "mix", reads=("h",), writes=("h",)),
                          Segment("post", SegmentKind.GRAPH, "post", reads=("h",), writes=("y",), stream="s0")],
                capture=CaptureSettings(modes=(Mode.PIECEWISE,), sizes=sizes, **capture))


def with_update(cls, update, *args):
    """An instance of ``cls`` whose ``update(x)`` is ``update(self, x)``."""
    return type(cls.__name__, (cls,), {"update": update})(*args)


def run(plan, model, **options):
    run_pipeline(plan, RunOptions(backend="cpu", **options), model=model).close()


def refusal(plan, model, **options) -> CaptureError:
    with pytest.raises(CaptureError) as info:
        run(plan, model, **options)
    assert info.value.phase == "warmup"
    return info.value


# -- what is refused ----------------------------------------------------------------


def test_a_counter_in_a_graph_segment_is_named_with_its_segment_and_both_steps():
    error = refusal(stepper_plan(), Stepper())
    assert error.descriptor.size == 2 and error.segment == "step"
    assert "in step, cache.layers[0].position: 0 -> 1, then 1 -> 2" in error.message
    assert "in step, cache.layers[1].position: 0 -> 1, then 1 -> 2" in error.message
    assert "2 value(s)" in error.message and "changed inside graph code" in error.message


def test_the_hint_says_what_to_do_before_turning_the_check_off():
    hint = refusal(stepper_plan(), Stepper()).hint
    assert "move its update into an eager segment or a break" in hint  # where Python state may move
    assert hint.index("tensor") < hint.index("eager segment") < hint.index("disabled_checks={'host_state'}")
    assert hint.endswith("RunOptions(disabled_checks={'host_state'})")  # the last resort, last
    assert "verify" not in hint  # never a way around it by checking less


def lens_update(self, x):
    self.lens[0] += 1


def test_a_counter_in_a_list_is_refused_by_its_index():
    model = with_update(Stepper, lens_update)
    model.lens = [3, 7]
    error = refusal(stepper_plan(), model)
    assert "lens[0]: 3 -> 4, then 4 -> 5" in error.message and "lens[1]" not in error.message


def test_a_counter_in_a_list_of_a_layer_is_named_by_the_layers_path():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lens = [3]

    model = with_update(Stepper, lambda self, x: lens_update(self.layers[0], x))
    model.layers = torch.nn.ModuleList([Layer()])
    assert "layers.0.lens[0]: 3 -> 4, then 4 -> 5" in refusal(stepper_plan(), model).message


def test_a_counter_in_a_dict_is_refused_by_its_key():
    model = with_update(Stepper, lambda self, x: self.table.__setitem__("seen", self.table["seen"] + 1))
    model.table = {"seen": 0, "tensor": torch.zeros(2)}
    assert "table['seen']: 0 -> 1, then 1 -> 2" in refusal(stepper_plan(), model).message


@dataclasses.dataclass
class Meta:
    steps: int = 0
    scale: float = 1.0


@dataclasses.dataclass(slots=True)
class SlottedMeta:
    steps: int = 0


@attrs.define
class AttrsMeta:  # slots, as attrs makes them
    steps: int = 0
    keys: torch.Tensor | None = None


@pytest.mark.parametrize("meta", [Meta, SlottedMeta, AttrsMeta])
def test_a_counter_in_a_dataclass_or_attrs_field_is_refused(meta):
    def update(self, x):
        self.meta.steps += 1

    model = with_update(Stepper, update)
    model.meta = meta()
    assert "meta.steps: 0 -> 1, then 1 -> 2" in refusal(stepper_plan(), model).message


def test_a_list_that_grows_in_a_graph_segment_is_refused_by_its_length():
    model = with_update(Stepper, lambda self, x: self.history.append(x.shape[0]))
    model.history = []
    assert "len(history): 0 -> 1, then 1 -> 2" in refusal(stepper_plan(), model).message


def test_an_object_replaced_at_every_step_is_read_through_its_new_values():
    def update(self, x):
        self.meta = Meta(steps=self.meta.steps + 1)

    model = with_update(Stepper, update)
    model.meta = Meta()
    assert "meta.steps: 0 -> 1, then 1 -> 2" in refusal(stepper_plan(), model).message


def test_a_counter_made_at_the_first_call_is_refused_at_the_next():
    def update(self, x):
        self.calls = getattr(self, "calls", 0) + 1

    assert "in step, calls: unset -> 1, then 1 -> 2" in refusal(stepper_plan(), with_update(Stepper, update)).message


def test_a_counter_in_the_graph_piece_of_a_split_plan_names_that_segment():
    def update(self, x):
        self.seen = getattr(self, "seen", 0) + 1

    error = refusal(split_plan(), with_update(Split, update, ["post"]))
    assert error.segment == "post" and "in post, seen" in error.message


# -- what passes --------------------------------------------------------------------


def batch_update(self, x):
    self.cache.batch_size = x.shape[0]  # as Hugging Face's cache layers keep it: a function of the size


def batch_model(before: int | None = 1):
    """A model whose graph segment sets a value from the batch size, run once eagerly at
    ``before`` (another size than the capture's) when given."""
    model = with_update(Stepper, batch_update)
    if before is not None:
        eagerly(model, before)
    return model


def eagerly(model, size: int) -> None:
    """The model's step once, outside graphflow, at ``size`` rows."""
    with torch.no_grad():
        model.forward_step(torch.zeros(size, 8), torch.zeros(size, 8))


@pytest.mark.parametrize("before", [None, 1, 3])
@pytest.mark.parametrize("detectors", ["first", "all"])
def test_a_value_that_follows_the_batch_size_passes_whatever_ran_before(before, detectors):
    run(stepper_plan(sizes=(8, 2)), batch_model(before), detectors=detectors)


def test_a_value_that_follows_the_batch_size_passes_in_both_modes():
    plan = split_plan(sizes=(4, 2))
    plan = attrs.evolve(plan, capture=attrs.evolve(plan.capture, modes=(Mode.PIECEWISE, Mode.FULL)),
                        segments=[*plan.segments[:1], attrs.evolve(plan.segments[1], kind=SegmentKind.GRAPH,
                                                                   stream="s0"), *plan.segments[2:]])
    model = with_update(Split, lambda self, x: setattr(self, "rows", x.shape[0]), ["pre", "post"])
    model.rows = 1
    run(plan, model, detectors="all")


def counter_update(self, x):
    self.count += 1


@pytest.mark.parametrize("sizes", [(4, 2), (2,)])
def test_a_counter_an_eager_segment_keeps_passes(sizes):
    """It runs at every replay, so its counter moves as it does eagerly."""
    model = with_update(Split, counter_update, ["mix"])
    model.count = 0
    run(split_plan(sizes=sizes), model, detectors="all")
    assert model.count > 0


class Resetting(Split):
    """The eager ``mix`` resets a count that the graph segment ``post`` then advances."""

    def mix(self, h):
        super().mix(h)
        self.count = 0

    def post(self, h, y):
        super().post(h, y)
        self.count += h.shape[0]


def test_a_count_a_graph_segment_advances_from_where_an_eager_one_reset_it_passes():
    """Every replay of ``post`` starts from the value the eager ``mix`` left, as at capture."""
    model = Resetting()
    model.count = 7
    run(split_plan(), model, detectors="all")


def test_a_value_a_graph_segment_changes_and_the_next_one_restores_passes():
    model = with_update(Split, lambda self, x: setattr(self, "inside", not self.inside), ["pre", "post"])
    model.inside = False
    run(split_plan(), model)


def test_a_value_that_appears_at_the_first_call_and_stays_passes():
    class Lazy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward_step(self, x, y):
            if not hasattr(self, "width"):
                self.width = x.shape[1]  # lazy initialization at the first call: done before capture
            torch.matmul(x, self.lin.weight.t(), out=y)
            self.lin.weight.data.mul_(1.0)  # tensors are the plan's business, not this check's

    run(stepper_plan(), Lazy())


def test_it_watches_where_the_detectors_do_and_can_be_turned_off():
    run(stepper_plan(), Stepper(), disabled_checks={"host_state"})
    run(stepper_plan(), Stepper(), detectors=False)


def test_the_toy_and_dsv4_plans_change_no_host_state_in_graph_code():
    from graphflow import load_plan
    from graphflow.integrations.dsv4 import build_model

    for plan in (toy_plan(2), toy_plan(2, full=True, modes=(Mode.FULL,))):
        run(plan, build_toy(2), detectors="all")
    for name in ("piecewise", "full"):
        plan = load_plan(f"plans/dsv4_mini_{name}.yaml")
        run(plan, build_model(**plan.model_args), sizes=(4, 2), detectors="all")


# -- one verdict, whatever ran ------------------------------------------------------


CASES = {"counter": (Stepper, None, False), "lens": (with_update, lens_update, False),
         "batch": (with_update, batch_update, True)}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("iters", [1, 2, 3])
def test_the_verdict_does_not_depend_on_the_warmup_steps_or_the_size_run_before(case, iters):
    """The CUDA backend's first descriptor of a mode runs one step more (its pool probe):
    ``warmup_iters`` 2 is that step count here."""
    for before in (None, 1, 5):
        make, update, passes = CASES[case]
        model = make(Stepper, update) if update is not None else make()
        model.lens = [3]
        if before is not None:
            eagerly(model, before)
        plan = stepper_plan(sizes=(8, 2), warmup_iters=iters)
        if passes:
            run(plan, model, verify=False)
        else:
            refusal(plan, model, verify=False)


def test_a_step_is_added_only_when_the_first_changed_graph_state():
    steps = []

    class Counting(Stepper):
        def update(self, x):
            steps.append(x.shape[0])

    run(stepper_plan(sizes=(2,)), Counting())
    plain = len(steps)
    steps.clear()
    run(stepper_plan(sizes=(2,)), with_update(Counting, lambda self, x: (steps.append(0), batch_update(self, x))))
    assert len(steps) == plain + 1


# -- breaks: eager between the graphs of one segment ---------------------------------


class Attention(torch.nn.Module):
    """A break: in PIECEWISE it runs eagerly between the segment's graphs."""

    def __init__(self):
        super().__init__()
        self.position = 0

    def forward(self, h):
        self.position += 1  # eager at every replay: it moves as it does eagerly
        return h * 0.5


class Broken(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.attn = Attention()
        self.graph_steps = 0

    def forward_step(self, x):
        h = self.attn(x @ self.lin.weight.t())
        return torch.tanh(h)


def broken_plan(mode: Mode) -> Plan:
    return Plan("broken", buffers=[Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
                                   Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)],
                streams=[Stream("s0", "cuda:0")],
                segments=[Segment("step", SegmentKind.GRAPH, "forward_step", reads=("x",), returns=("y",),
                                  stream="s0", breaks=("attn",))],
                capture=CaptureSettings(modes=(mode,), sizes=(4, 2)))


def test_a_counter_in_a_break_passes_in_piecewise_and_is_refused_in_full():
    """PIECEWISE runs the break eagerly at every replay; FULL records it in its one graph."""
    run(broken_plan(Mode.PIECEWISE), Broken(), detectors="all")
    error = refusal(broken_plan(Mode.FULL), Broken())
    assert "in step, attn.position: 0 -> 1, then 1 -> 2" in error.message


def test_a_counter_in_the_graph_piece_after_a_break_names_the_piece():
    class After(Broken):
        def forward_step(self, x):
            h = self.attn(x @ self.lin.weight.t())
            self.graph_steps += 1
            return torch.tanh(h)

    error = refusal(broken_plan(Mode.PIECEWISE), After())
    assert "in step (after its break attn), graph_steps: 0 -> 1, then 1 -> 2" in error.message


# -- what is read, and how it is named ----------------------------------------------


def test_the_reader_reads_plain_values_by_path():
    model = Stepper()
    model.scale = 0.5
    model.flags = (True, 3)
    model.name = "decode"
    model.nothing = None
    model.cache.layers.append(model.cache.layers[0])  # seen once, under its first path
    model.cache.self = model.cache  # a cycle ends
    model.big = list(range(ITEMS + 5))  # read by its length past ITEMS items
    state = Reader(model).read().by_path()
    assert state["scale"] == 0.5 and state["flags"] == (True, 3) and state["name"] == "decode"
    assert state["nothing"] is None
    assert state["cache.layers[0].position"] == 0 and state["cache.layers[1].window"] == (4, 4)
    assert state["len(cache.layers)"] == 3 and not any(p.startswith("cache.layers[2]") for p in state)
    assert state["len(big)"] == ITEMS + 5 and f"big[{ITEMS - 1}]" in state and f"big[{ITEMS}]" not in state
    assert "training" not in state and "lin.training" not in state
    assert not any("weight" in path or "lengths" in path for path in state)
    assert state["lin.in_features"] == 8


def test_an_adopted_tensors_owner_is_read_under_the_plans_path():
    holder = Counter()
    state = Reader(torch.nn.Module(), {"pool.layers.0": holder}).read().by_path()
    assert {k: v for k, v in state.items() if k.startswith("pool")} == {"pool.layers.0.position": 0,
                                                                          "pool.layers.0.window": (4, 4)}


def test_a_tensor_put_where_an_int_was_is_not_compared():
    model = Stepper()
    reader = Reader(model)
    before = reader.read()
    model.cache.layers[0].position = torch.ones(3)
    assert changes(before, reader.read()) == []


def nested():
    """Random nested lists, tuples, dicts and objects, with ints at the leaves."""
    leaves = st.integers(-3, 300)
    return st.recursive(leaves, lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.lists(inner, max_size=3).map(lambda items: (*items, [])),
        st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
        st.dictionaries(st.sampled_from("pq"), inner, max_size=2).map(lambda fields: Box(**fields))),
        max_leaves=12)


class Box:
    def __init__(self, **fields):
        self.__dict__.update(fields)


def leaves(value, path, depth):
    """(container, key, path) of every int a walk reaches in ``value`` with ``depth`` left
    (a container or object it goes into takes one), except a tuple's (they cannot change)."""
    if isinstance(value, Box):
        owner, items, name = vars(value), vars(value).items(), lambda key: f"{path}.{key}"
    else:
        owner, items = value, value.items() if isinstance(value, dict) else enumerate(value)
        name = lambda key: f"{path}[{key!r}]"  # noqa: E731
    for key, item in items:
        if isinstance(item, int):
            if not isinstance(value, tuple):
                yield owner, key, name(key)
        elif depth > 0:
            yield from leaves(item, name(key), depth - 1)


@given(nested(), st.data())
def test_the_reader_sees_exactly_the_ints_changed_in_nested_containers(tree, data):
    model = torch.nn.Module()
    model.state = Box(tree=tree)
    reader = Reader(model)
    before = reader.read()
    found = list(leaves(model.state, "state", DEPTH - 1))
    chosen = data.draw(st.lists(st.sampled_from(found), unique_by=lambda leaf: leaf[2]) if found else st.just([]))
    for owner, key, _ in chosen:
        owner[key] += 1
    after = reader.read()
    assert sorted(path for path, _, _ in changes(before, after)) == sorted(path for *_, path in chosen)
    assert all(new == old + 1 for _, old, new in changes(before, after))


def test_ranks_that_pair_up_read_the_second_step_whatever_the_first_showed():
    segment = Segment("g", SegmentKind.GRAPH, "forward_step", stream="s0")
    for paired in (False, True):
        watch = StepWatch(Stepper(), {}, paired=paired)
        with watch.stepping():
            watch.runner(lambda segment, call: call())(segment, lambda: None)
        assert watch.wants_step() is paired
