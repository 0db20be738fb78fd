"""The decorator API: a model declares its plan on its own methods and classes.

One class per rule: what the decorators leave on the class, the plan a model
declares (equal to the YAML one), templates, steps, each misuse with its exact
element and message, the normalization used for equality, and the CLI.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import subprocess
import sys
import types

import attrs
import pytest
import torch
from torch import nn

import graphflow
from graphflow.cli import main
from graphflow.cli.source import add_plan_source_arguments, plan_source
from graphflow.plan.decorators import normalized, plan_from_module
from graphflow.errors import PlanError
from graphflow.plan.loader import dump_plan, load_plan, loads_plan
from graphflow.plan import Buffer, BufferRole, Mode, SegmentKind
from graphflow.plan.rules import validate
from tests.tiny_decorated import TINY_PLAN_YAML, DecoderLayer, TinyDecoder, build_model

DEV = "cuda:0"
PLANS = pathlib.Path(__file__).resolve().parents[1] / "plans"


def _buffers(model: TinyDecoder, batch: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    bufs = {"x": torch.randn(batch, model.hidden), "logits": torch.zeros(batch, model.vocab)}
    for i in range(len(model.layers)):
        bufs[f"q{i}"] = torch.zeros(batch, model.hidden)
        bufs[f"o{i}"] = torch.zeros(batch, model.hidden)
    return bufs


def _error(model, **kwargs) -> PlanError:
    with pytest.raises(PlanError) as info:
        plan_from_module(model, **kwargs)
    return info.value


# -- small models for the misuse cases --------------------------------------------------------
class Leaf(nn.Module):
    layer = graphflow.position()
    h = graphflow.buffer("h{layer}", shape=("B", 4), dtype="float32", device=DEV)

    @graphflow.segment("L{layer}", reads=["x"], writes=["h{layer}"], stream="s0")
    def work(self, x, h):
        h.copy_(x)


class Root(nn.Module):
    """Two Leaf layers and a head; a well-formed base the misuse cases change one thing of."""

    x = graphflow.buffer(shape=("B", 4), dtype="float32", device=DEV, role="input")
    y = graphflow.buffer(shape=("B", 4), dtype="float32", device=DEV, role="output")
    s0 = graphflow.stream(device=DEV)

    def __init__(self, leaf=Leaf, layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(leaf() for _ in range(layers))

    @graphflow.step(name="root")
    def step(self, bufs):
        for layer in self.layers:
            layer.work(bufs, bufs)
        self.head(bufs["h1"], bufs["y"])

    @graphflow.segment(reads=["h1"], writes=["y"], stream="s0")
    def head(self, h, y):
        y.copy_(h)


class TestDecoratorsLeaveTheMethod:
    def test_a_decorated_method_is_the_original_plain_function(self):
        method = DecoderLayer.__dict__["pre_attention"]
        assert type(method) is types.FunctionType
        assert method.__qualname__ == "DecoderLayer.pre_attention"

    def test_the_declaration_rides_on_the_function(self):
        (decl,) = DecoderLayer.pre_attention.__graphflow__
        assert decl.kind is SegmentKind.GRAPH
        assert decl.name == "L{layer}.pre"
        assert decl.reads == ("x",) and decl.writes == ("q{layer}",)

    def test_class_level_declarations_are_taken_off_the_class(self):
        assert not hasattr(DecoderLayer, "q") and not hasattr(TinyDecoder, "x")
        assert set(DecoderLayer.__dict__["__graphflow_declarations__"]) == {"layer", "q", "o"}

    def test_a_declaration_does_not_shadow_a_submodule_of_the_same_name(self):
        class Shadowed(nn.Module):
            proj = graphflow.buffer(shape=("B",), dtype="float32", device=DEV)

            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(2, 2)

        assert isinstance(Shadowed().proj, nn.Linear)

    def test_the_eager_step_computes_what_the_undecorated_code_computes(self):
        model = build_model()
        bufs = _buffers(model, 2)
        x = bufs["x"].clone()
        with torch.no_grad():
            model.step(bufs)
            for layer in model.layers:
                q = x @ layer.wq.weight.t()
                x = x + layer.wo(torch.softmax(q, -1) * q)
            expected = x @ model.proj.weight.t()
        assert torch.equal(bufs["logits"], expected)


class TestPlanFromModule:
    def test_the_tiny_model_declares_the_hand_written_yaml_plan(self):
        assert normalized(plan_from_module(build_model())) == normalized(loads_plan(TINY_PLAN_YAML))

    def test_segments_follow_the_step_with_call_paths_from_the_module_tree(self):
        plan = plan_from_module(build_model(layers=2))
        assert [(s.name, s.call) for s in plan.segments] == [
            ("L0.pre", "layers.0.pre_attention"), ("L0.attn", "layers.0.attention"),
            ("L0.post", "layers.0.post_attention"), ("L1.pre", "layers.1.pre_attention"),
            ("L1.attn", "layers.1.attention"), ("L1.post", "layers.1.post_attention"), ("head", "head"),
        ]

    def test_one_declaration_on_the_layer_class_gives_a_buffer_per_layer(self):
        plan = plan_from_module(build_model(layers=5))
        assert sorted(b.name for b in plan.buffers if b.name[0] in "qo") == [
            "o0", "o1", "o2", "o3", "o4", "q0", "q1", "q2", "q3", "q4"]

    def test_callable_fields_read_the_module_configuration(self):
        plan = plan_from_module(build_model(hidden=8, vocab=10))
        assert plan.buffer("q0").shape == ("B", 8)
        assert plan.buffer("logits") == Buffer("logits", ("B", 10), "float32", DEV, BufferRole.OUTPUT)

    def test_step_settings_are_defaults_that_arguments_override(self):
        plan = plan_from_module(build_model(), name="other", sizes=(8, 16), modes=("PIECEWISE", Mode.FULL),
                                factory="tests.tiny_decorated:build_model", model_args={"layers": 3})
        assert (plan.name, plan.capture.sizes, plan.capture.modes) == ("other", (8, 16), (Mode.PIECEWISE, Mode.FULL))
        assert (plan.model, plan.model_args) == ("tests.tiny_decorated:build_model", {"layers": 3})
        assert plan_from_module(build_model()).capture.sizes == (1, 2, 4)

    def test_origins_point_at_the_declaring_lines(self):
        plan = plan_from_module(build_model())
        source = (pathlib.Path(__file__).parent / "tiny_decorated.py").read_text().splitlines()
        assert source[plan.origin("segment", "L1.post").line - 1].lstrip().startswith("@graphflow.segment(\"L{layer}.post\"")
        assert source[plan.origin("buffer", "q2").line - 1].lstrip().startswith("q = graphflow.buffer(")
        assert plan.origin("segment", "head").file == "tests/tiny_decorated.py"

    def test_the_declared_plan_validates_clean(self):
        assert validate(plan_from_module(build_model())).diagnostics == ()

    def test_channels_and_families_come_from_the_declarations(self):
        class Reduce(nn.Module):
            x = graphflow.buffer(shape=("B", 4), dtype="float32", device=DEV, role="input")
            s0 = graphflow.stream(device=DEV)
            ar = graphflow.channel(kind="all_reduce", group="tp", id=7, family="draft", warmup="prepare",
                                   prewarm="warm")

            @graphflow.step
            def step(self, x):
                self.reduce(x)

            @graphflow.segment(reads=["x"], writes=["x"], stream="s0", channels=["ar"], family="draft")
            def reduce(self, x):
                pass

            @graphflow.prewarm(name="warm")
            def warm_kernels(self, size):
                pass

        plan = plan_from_module(Reduce())
        assert [f.name for f in plan.families] == ["draft"]
        assert plan.channel("ar").id == 7 and plan.channel("ar").prewarm == "warm"
        assert plan.hook("warm").call == "warm_kernels"
        assert plan.name == "Reduce"

    def test_kernels_expand_with_the_positions(self):
        class Layer(torch.nn.Module):
            layer = graphflow.position()

            @graphflow.segment("L{layer}.norm", reads=["x"], writes=["x"], stream="s0",
                               kernels=["rms_n{layer}", "shared.gemm"])
            def norm(self, x):
                pass

        class Model(torch.nn.Module):
            x = graphflow.buffer(shape=["B", 8], dtype="float32", device="cuda:0")
            s0 = graphflow.stream(device="cuda:0")

            def __init__(self):
                super().__init__()
                self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

            @graphflow.step(sizes=[1])
            def step(self, bufs):
                for layer in self.layers:
                    layer.norm(bufs["x"])

        plan = plan_from_module(Model())
        assert [s.kernels for s in plan.segments] == [("rms_n0", "shared.gemm"), ("rms_n1", "shared.gemm")]
        assert loads_plan(dump_plan(plan)) == plan

    def test_the_model_is_not_run_while_recording(self):
        model = build_model()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        plan_from_module(model)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class TestTemplates:
    def test_offsets_and_literal_braces_expand_as_in_yaml(self):
        class Chain(nn.Module):
            layer = graphflow.position()
            out = graphflow.buffer("x{layer+1}", shape=("B",), dtype="float32", device=DEV)

            @graphflow.segment("step{{{layer}}}", reads=["x{layer}"], writes=["x{layer+1}"], stream="s0")
            def work(self, x, y):
                pass

        class Model(nn.Module):
            x0 = graphflow.buffer(shape=("B",), dtype="float32", device=DEV, role="input")
            s0 = graphflow.stream(device=DEV)

            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([Chain(), Chain()])

            @graphflow.step
            def step(self):
                for layer in self.layers:
                    layer.work()

        plan = plan_from_module(Model())
        assert [(s.name, s.reads, s.writes) for s in plan.segments] == [
            ("step{0}", ("x0",), ("x1",)), ("step{1}", ("x1",), ("x2",))]

    def test_a_position_binds_for_submodules_too(self):
        class Inner(nn.Module):
            @graphflow.segment("L{layer}.inner", reads=["x"], writes=["x"], stream="s0")
            def work(self, x):
                pass

        class Layer(nn.Module):
            layer = graphflow.position()

            def __init__(self):
                super().__init__()
                self.inner = Inner()

            def forward(self, x):
                self.inner.work(x)

        class Model(nn.Module):
            x = graphflow.buffer(shape=("B",), dtype="float32", device=DEV, role="input")
            s0 = graphflow.stream(device=DEV)

            def __init__(self):
                super().__init__()
                self.blocks = nn.Sequential(Layer(), Layer())

            @graphflow.step
            def step(self, x):
                for block in self.blocks:
                    block(x)

        plan = plan_from_module(Model())
        assert [(s.name, s.call) for s in plan.segments] == [
            ("L0.inner", "blocks.0.inner.work"), ("L1.inner", "blocks.1.inner.work")]

    def test_an_unbound_variable_names_the_method(self):
        class Bad(Leaf):
            @graphflow.segment("L{block}", reads=["x"], writes=["h{layer}"], stream="s0")
            def work(self, x, h):
                pass

        err = _error(Root(Bad))
        assert err.element == "layers.0 (Bad.work)"
        assert err.message == ("'L{block}' uses {block}, but neither this module nor a parent declares "
                               "block = graphflow.position() (bound here: layer)")


class TestSteps:
    class TwoSteps(nn.Module):
        x = graphflow.buffer(shape=("B",), dtype="float32", device=DEV, role="input")
        host = graphflow.buffer(shape=("B",), dtype="int64", device="cpu")
        s0 = graphflow.stream(device=DEV)

        @graphflow.step(name="two-piecewise", modes=["PIECEWISE"])
        def piecewise(self, x):
            self.metadata(x, x)
            self.eager(x)

        @graphflow.step(name="two-full", modes=["FULL"])
        def full(self, x):
            self.static(x)

        @graphflow.eager_break(reads=["x"], writes=["host"])
        def metadata(self, x, host):
            pass

        @graphflow.eager_break(reads=["x", "host"], writes=["x"], stream="s0")
        def eager(self, x, host):
            pass

        @graphflow.segment(reads=["x"], writes=["x"], stream="s0")
        def static(self, x):
            pass

    def test_each_step_gives_its_own_plan_with_only_what_it_uses(self):
        piecewise = plan_from_module(self.TwoSteps(), step="piecewise")
        full = plan_from_module(self.TwoSteps(), step="full")
        assert (piecewise.name, [s.name for s in piecewise.segments]) == ("two-piecewise", ["metadata", "eager"])
        assert (full.name, [s.name for s in full.segments], full.capture.modes) == ("two-full", ["static"],
                                                                                    (Mode.FULL,))
        assert [b.name for b in piecewise.buffers] == ["x", "host"]
        assert [b.name for b in full.buffers] == ["x"]

    def test_two_steps_need_a_choice(self):
        err = _error(self.TwoSteps())
        assert (err.element, err.message) == ("TwoSteps", "declares 2 @graphflow.step methods (piecewise, full): "
                                                          "choose one with step= (graphflow CLI: --step)")

    def test_an_unknown_step_lists_the_steps(self):
        err = _error(self.TwoSteps(), step="decode")
        assert err.message == "has no @graphflow.step method 'decode'; its steps: piecewise, full"

    def test_a_model_without_a_step_is_an_error(self):
        class NoStep(nn.Module):
            pass

        err = _error(NoStep())
        assert (err.element, err.message) == (
            "NoStep", "declares no @graphflow.step method: mark the method that calls the segments in order")

    def test_a_step_that_calls_a_prewarm_hook(self):
        class CallsHook(Root):
            @graphflow.step
            def step(self, bufs):
                self.warm()

            @graphflow.prewarm
            def warm(self):
                pass

        err = _error(CallsHook())
        assert (err.element, err.message) == (
            "CallsHook.warm", "the step calls a method marked @graphflow.prewarm: a step may call only "
                              "@graphflow.segment and @graphflow.eager_break methods (and plain methods that "
                              "call them)")

    def test_a_step_that_computes_fails_with_the_cause(self):
        class Computes(Root):
            @graphflow.step
            def step(self, bufs):
                for layer in self.layers:
                    layer.work(bufs, bufs)
                self.head(bufs["h1"] * 2, bufs["y"])

        err = _error(Computes())
        assert err.element == "Computes.step"
        assert err.message.startswith("the step raised TypeError: unsupported operand type(s) for *")
        assert isinstance(err.__cause__, TypeError)


class TestMisuse:
    def test_an_undeclared_buffer_names_module_and_method(self):
        class Post(Leaf):
            @graphflow.segment("L{layer}", reads=["o{layer}"], writes=["h{layer}"], stream="s0")
            def work(self, o, h):
                pass

        err = _error(Root(Post))
        assert err.element == "layers.0 (Post.work)"
        assert err.message == ("reads buffer 'o0', which no module declares — add o0 = graphflow.buffer(...) "
                               "to a module class")
        assert err.file == "tests/test_decorators.py" and err.line is not None

    def test_an_undeclared_stream_or_channel(self):
        class OtherStream(Leaf):
            @graphflow.segment("L{layer}", reads=["x"], writes=["h{layer}"], stream="s1")
            def work(self, x, h):
                pass

        class WithChannel(Leaf):
            @graphflow.segment("L{layer}", reads=["x"], writes=["h{layer}"], stream="s0", channels=["tp"])
            def work(self, x, h):
                pass

        assert _error(Root(OtherStream)).message.startswith("runs on stream 's1', which no module declares")
        assert _error(Root(WithChannel)).message.startswith("uses channel 'tp', which no module declares")

    def test_a_method_declared_but_never_reached(self):
        class Extra(Leaf):
            @graphflow.segment("L{layer}.extra", reads=["x"], writes=["x"], stream="s0")
            def extra(self, x):
                pass

        err = _error(Root(Extra))
        assert err.element == "layers.0 (Extra.extra)"
        assert err.message == ("declared with @graphflow.segment but never reached by a step: call it from a "
                               "@graphflow.step method of Root, or remove the decorator")

    def test_a_field_value_the_plan_refuses_names_the_declaration(self):
        class Typo(Leaf):
            wrong = graphflow.buffer("wrong{layer}", shape=("B",), dtype="bf16", device=DEV)

        err = _error(Root(Typo))
        assert err.element == "layers.0 (Typo.wrong)"
        assert err.message.startswith("bad buffer declaration: 'dtype' must be one of float64, float32, ")
        assert err.message.endswith(" (got 'bf16'; did you mean 'bfloat16'?)")

    def test_a_segment_field_the_plan_refuses_names_the_method(self):
        class Negative(Leaf):
            @graphflow.segment("L{layer}", reads=["x"], writes=["h{layer}"], stream="s0", ranks=[-1])
            def work(self, x, h):
                pass

        err = _error(Root(Negative))
        assert (err.element, err.message) == ("layers.0 (Negative.work)",
                                              "bad @graphflow.segment declaration: 'ranks[0]' must be >= 0 (got -1)")

    def test_a_step_setting_the_plan_refuses_names_the_step(self):
        err = _error(Root(), warmup_iters=0)
        assert (err.element, err.message) == ("Root.step", "bad @graphflow.step settings: 'warmup_iters' must be "
                                                           ">= 1 (got 0)")


class TestJudgedLikeYaml:
    """What no step uses is kept for the validator, which judges it as it judges YAML."""

    class Spare(Leaf):
        spare = graphflow.buffer("spare{layer}", shape=("B",), dtype="float32", device=DEV)
        idle = graphflow.stream("idle{layer}", device=DEV)
        ep = graphflow.channel("ep{layer}", kind="all_to_all", group="ep", id=7)

    def test_unused_declarations_are_warnings_not_errors(self):
        plan = plan_from_module(Root(self.Spare))
        report = validate(plan)
        assert report.ok
        unused = {(d.code, d.severity.value, d.element) for d in report.warnings if d.code in ("GF205", "GF404",
                                                                                              "GF506")}
        assert unused == {(code, "warning", f"{kind} {name}{i}") for i in range(2)
                          for code, kind, name in (("GF205", "buffer", "spare"), ("GF404", "stream", "idle"),
                                                   ("GF506", "channel", "ep"))}

    def test_the_warning_points_at_the_declaration(self):
        plan = plan_from_module(Root(self.Spare))
        [spare] = [d for d in validate(plan).diagnostics if d.element == "buffer spare0"]
        line = (pathlib.Path(__file__).read_text().splitlines()[spare.origin.line - 1]).strip()
        assert spare.origin.file == "tests/test_decorators.py" and line.startswith("spare = graphflow.buffer(")

    def test_the_same_plan_written_as_yaml_gets_the_same_diagnostics(self):
        from graphflow.plan.loader import dump_plan

        plan = plan_from_module(Root(self.Spare))
        as_yaml = loads_plan(dump_plan(plan))

        def judged(p):
            return sorted((d.code, d.severity, d.element, d.message) for d in validate(p).diagnostics)

        assert judged(as_yaml) == judged(plan)

    def test_another_steps_declarations_stay_out(self):
        assert [b.name for b in plan_from_module(TestSteps.TwoSteps(), step="full").buffers] == ["x"]


    def test_two_declarations_of_one_buffer_that_disagree(self):
        class Wider(Leaf):
            wide = graphflow.buffer("x", shape=("B", 8), dtype="float32", device=DEV, role="input")

        err = _error(Root(Wider))
        assert err.element == "layers.0 (Wider.wide)"
        assert err.message == ("buffer 'x' is declared differently by Root.x (shape ('B', 4) there, ('B', 8) "
                               "here) — declare it once, or make the declarations agree")

    def test_identical_declarations_of_one_buffer_are_one_buffer(self):
        class Same(Leaf):
            again = graphflow.buffer("x", shape=("B", 4), dtype="float32", device=DEV, role="input")

        assert [b.name for b in plan_from_module(Root(Same)).buffers].count("x") == 1

    def test_two_decorators_on_one_method(self):
        class Twice(Leaf):
            @graphflow.eager_break("L{layer}.e", reads=["x"], writes=["h{layer}"])
            @graphflow.segment("L{layer}", reads=["x"], writes=["h{layer}"], stream="s0")
            def work(self, x, h):
                pass

        err = _error(Root(Twice))
        assert (err.element, err.message) == (
            "layers.0 (Twice.work)",
            "declared twice (@graphflow.segment and @graphflow.eager_break): keep one declaration per method")

    def test_two_calls_that_give_one_segment_name(self):
        class Unnamed(Leaf):
            @graphflow.segment("work", reads=["x"], writes=["h{layer}"], stream="s0")
            def work(self, x, h):
                pass

        err = _error(Root(Unnamed))
        assert err.element == "layers.1 (Unnamed.work)"
        assert err.message.startswith("segment 'work' is also declared by layers.0 (Unnamed.work)")

    def test_a_decorated_free_function_reached_by_the_step(self):
        @graphflow.segment(reads=["x"], writes=["x"])
        def helper(x):
            pass

        class CallsHelper(Root):
            @graphflow.step
            def step(self, bufs):
                helper(bufs["x"])

        err = _error(CallsHelper())
        assert err.element.endswith("helper")
        assert "helper, which is not a method, which the step reached" in err.message
        helper(1)  # eagerly, it still runs

    def test_a_decorated_method_of_a_class_that_is_not_a_module(self):
        class Helper:
            @graphflow.segment(reads=["x"], writes=["x"])
            def run(self, x):
                return x

        class UsesHelper(Root):
            @graphflow.step
            def step(self, bufs):
                Helper().run(bufs["x"])

        err = _error(UsesHelper())
        assert "a method of Helper, which is not an nn.Module" in err.message
        assert Helper().run(3) == 3

    def test_a_decorated_staticmethod(self):
        class Static(Root):
            @staticmethod
            @graphflow.segment(reads=["x"], writes=["x"])
            def norm(x):
                pass

        err = _error(Static())
        assert err.element == "Static.norm"
        assert err.message.startswith("@graphflow.segment decorates a staticmethod ")

    def test_a_graphflow_decorator_under_another_decorator(self):
        def logged(fn):
            def wrapper(*args):
                return fn(*args)

            wrapper.__wrapped__ = fn
            return wrapper

        class Wrapped(Root):
            @logged
            @graphflow.segment(reads=["h1"], writes=["y"], stream="s0")
            def head(self, h, y):
                pass

        err = _error(Wrapped())
        assert err.element == "Wrapped.head"
        assert "under another decorator" in err.message and "outermost" in err.message

    def test_a_signature_the_engine_cannot_call(self):
        class Short(Leaf):
            @graphflow.segment("L{layer}", reads=["x"], writes=["h{layer}"], stream="s0")
            def work(self, x):
                pass

        err = _error(Root(Short))
        assert err.element == "layers.0 (Short.work)"
        assert err.message.startswith("the engine calls it with 2 buffer arguments "
                                      "(fn(*reads, *writes_not_in_reads): x, h0), which its signature cannot take")

    def test_a_position_outside_a_container(self):
        class Alone(Root):
            def __init__(self):
                super().__init__()
                self.single = Leaf()

        err = _error(Alone())
        assert err.element == "single (Leaf.layer)"
        assert err.message == ("declares position 'layer', but it is not an item of a ModuleList or Sequential "
                               "(its path is 'single')")

    def test_a_position_bound_twice(self):
        class Outer(nn.Module):
            layer = graphflow.position()

            def __init__(self):
                super().__init__()
                self.inner = nn.ModuleList([Leaf()])

        class Model(Root):
            def __init__(self):
                super().__init__()
                self.outer = nn.ModuleList([Outer()])

        err = _error(Model())
        assert err.element == "outer.0.inner.0 (Leaf.layer)"
        assert err.message.startswith("position 'layer' is already bound to 0 by a parent module")

    def test_a_segment_decorator_without_its_call_is_refused_at_once(self):
        with pytest.raises(TypeError) as info:
            class Bare(nn.Module):
                @graphflow.segment
                def work(self, x):
                    pass

        assert str(info.value).startswith("@graphflow.segment takes the segment's name (a string) and its reads "
                                          "and writes: write @graphflow.segment(\"name\", reads=[...], writes=[...]), "
                                          "got <function")

    def test_not_a_module(self):
        err = _error(object())
        assert err.message == "expected an nn.Module, got object"


class TestNormalized:
    def test_declaration_order_of_named_elements_does_not_matter(self):
        plan = plan_from_module(build_model())
        reordered = attrs.evolve(plan, buffers=plan.buffers[::-1])
        assert reordered != plan
        assert normalized(reordered) == normalized(plan)

    def test_a_different_buffer_is_still_a_difference(self):
        plan = plan_from_module(build_model())
        wider = attrs.evolve(plan, buffers=[attrs.evolve(b, shape=("B", 99)) if b.name == "x" else b
                                            for b in plan.buffers])
        assert normalized(wider) != normalized(plan)

    def test_segment_order_matters(self):
        plan = plan_from_module(build_model())
        swapped = attrs.evolve(plan, segments=(plan.segments[1], plan.segments[0], *plan.segments[2:]))
        assert normalized(swapped) != normalized(plan)


class TestCommandLine:
    ARGS = ["--module", "tests.tiny_decorated:build_model", "--model-arg", "layers=2"]

    def test_export_writes_yaml_that_loads_back_equal(self, capsys):
        assert main(["export", *self.ARGS]) == 0
        exported = loads_plan(capsys.readouterr().out)
        expected = plan_from_module(build_model(layers=2), factory="tests.tiny_decorated:build_model",
                                    model_args={"layers": 2})
        assert exported == expected
        assert [s.name for s in exported.segments][-1] == "head" and len(exported.segments) == 7

    def test_export_options_override_the_step(self, tmp_path):
        out = tmp_path / "plan.yaml"
        assert main(["export", *self.ARGS, "--sizes", "2,8", "--modes", "FULL", "--name", "t", "-o", str(out)]) == 0
        plan = loads_plan(out.read_text())
        assert (plan.name, plan.capture.sizes, plan.capture.modes) == ("t", (2, 8), (Mode.FULL,))

    def test_export_of_a_plan_file_writes_it_expanded(self, tmp_path, capsys):
        path = tmp_path / "tiny.yaml"
        path.write_text(TINY_PLAN_YAML)
        assert main(["export", str(path)]) == 0
        assert loads_plan(capsys.readouterr().out) == loads_plan(TINY_PLAN_YAML)

    def test_a_misdeclared_model_exits_2_naming_file_line_module_and_method(self, capsys):
        assert main(["export", "--module", "tests.test_decorators:_misdeclared"]) == 2
        err = capsys.readouterr().err
        assert re.match(r"graphflow: tests/test_decorators.py:\d+: layers.0 \(Post.work\): reads buffer 'o0', "
                        r"which no module declares", err), err

    def test_plan_and_module_together_exit_2(self, capsys):
        assert main(["export", "plans/toy.yaml", *self.ARGS]) == 2
        assert capsys.readouterr().err == ("graphflow: arguments: give a plan file or --module PKG.MOD:FACTORY "
                                           "(exactly one)\n")

    def test_a_bad_model_arg_exits_2(self, capsys):
        assert main(["export", "--module", "tests.tiny_decorated:build_model", "--model-arg", "layers"]) == 2
        assert capsys.readouterr().err == "graphflow: --model-arg: expected KEY=VALUE, got 'layers'\n"

    def test_a_factory_that_raises_exits_2(self, capsys):
        assert main(["export", "--module", "tests.tiny_decorated:build_model", "--model-arg", "depth=2"]) == 2
        assert capsys.readouterr().err.startswith(
            "graphflow: tests.tiny_decorated:build_model: the factory raised TypeError: ")


class TestPlanSource:
    """What show and run call: one function for 'a plan file, or a decorated model'."""

    @staticmethod
    def _parse(argv):
        parser = argparse.ArgumentParser()
        add_plan_source_arguments(parser)
        return parser.parse_args(argv)

    def test_a_plan_file_is_loaded(self):
        assert plan_source(self._parse([str(PLANS / "toy.yaml")])) == load_plan(PLANS / "toy.yaml")

    def test_a_module_is_built_on_the_cpu_and_recorded(self):
        plan = plan_source(self._parse(["--module", "tests.tiny_decorated:build_model", "--model-arg", "layers=4"]))
        assert (plan.model, plan.model_args, len(plan.segments)) == ("tests.tiny_decorated:build_model",
                                                                      {"layers": 4}, 13)

    def test_without_settings_options_a_subcommand_keeps_its_own(self):
        parser = argparse.ArgumentParser()
        add_plan_source_arguments(parser, settings=False)
        parser.add_argument("--sizes", help="the subcommand's own: capture only these sizes")
        args = parser.parse_args(["--module", "tests.tiny_decorated:build_model", "--sizes", "1"])
        assert plan_source(args).capture.sizes == (1, 2, 4)

    def test_neither_is_an_error(self):
        with pytest.raises(PlanError) as info:
            plan_source(self._parse([]))
        assert (info.value.element, info.value.message) == (
            "arguments", "give a plan file or --module PKG.MOD:FACTORY (exactly one)")


def _misdeclared():
    class Post(Leaf):
        @graphflow.segment("L{layer}", reads=["o{layer}"], writes=["h{layer}"], stream="s0")
        def work(self, o, h):
            pass

    return Root(Post)


class TestImport:
    def test_import_graphflow_imports_no_torch(self):
        code = "import sys, graphflow; assert 'torch' not in sys.modules, 'torch imported'; print(graphflow.segment)"
        root = pathlib.Path(__file__).resolve().parents[1]
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                                env={**os.environ, "PYTHONPATH": str(root)})
        assert result.returncode == 0, result.stderr


class TestDsv4DeclaresItsPlans:
    """The dsv4 model's decorators declare exactly the bundled mini plans."""

    CASES = [("piecewise_step", "dsv4_mini_piecewise.yaml"), ("full_step", "dsv4_mini_full.yaml")]

    @staticmethod
    def _declared(step: str, yaml_name: str):
        from graphflow.integrations.dsv4 import build_model as build_dsv4

        expected = load_plan(PLANS / yaml_name)
        model = build_dsv4(**expected.model_args)
        return plan_from_module(model, step=step, factory=expected.model, model_args=expected.model_args), expected

    @pytest.mark.parametrize(("step", "yaml_name"), CASES)
    def test_the_declared_plan_equals_the_yaml_plan(self, step, yaml_name):
        declared, expected = self._declared(step, yaml_name)
        assert normalized(declared) == normalized(expected)

    @pytest.mark.parametrize(("step", "yaml_name"), CASES)
    def test_the_exported_yaml_loads_back_equal_to_the_file(self, step, yaml_name, capsys):
        expected = load_plan(PLANS / yaml_name)
        args = [f"--model-arg={key}={value}" for key, value in expected.model_args.items()]
        assert main(["export", "--module", expected.model, "--step", step, *args]) == 0
        assert normalized(loads_plan(capsys.readouterr().out)) == normalized(expected)

    def test_a_smaller_model_declares_a_smaller_plan(self):
        from graphflow.integrations.dsv4 import build_model as build_dsv4

        plan = plan_from_module(build_dsv4(n_layers=2, hidden_size=32), step="full_step")
        layer = ["pre", "attn", "res", "mix", "ffn_res", "shared", "moe", "ffn_out"]
        assert [s.name for s in plan.segments] == ["embed", *(f"L{i}.{part}" for i in (0, 1) for part in layer),
                                                   "head"]
        assert plan.buffer("x").shape == ("B", 4, 32) and plan.buffer("expert_load").shape == (2, 8)

    def test_the_step_run_eagerly_equals_the_plan_segments_run_in_order(self):
        from graphflow.engine.model.binding import resolve
        from graphflow.integrations.dsv4 import build_model as build_dsv4

        declared, _ = self._declared(*self.CASES[0])
        model = build_dsv4(**declared.model_args)
        generator = torch.Generator().manual_seed(0)
        sizes = declared.symbol_values(2)
        bufs = {}
        for b in declared.buffers:
            shape = [sizes[d] if isinstance(d, str) else d for d in b.shape]
            if b.values is not None:
                bufs[b.name] = torch.randint(int(b.values[0]), int(b.values[1]), shape, generator=generator)
            else:
                bufs[b.name] = torch.zeros(shape, dtype=getattr(torch, b.dtype))
        by_segments = {name: t.clone() for name, t in bufs.items()}
        with torch.no_grad():
            model.piecewise_step(bufs)
            for seg in declared.segments:
                writes = [w for w in dict.fromkeys(seg.writes) if w not in seg.reads]
                resolve(model, seg.call, kind="segment", name=seg.name)(
                    *(by_segments[n] for n in (*seg.reads, *writes)))
        assert torch.equal(bufs["logits"], by_segments["logits"])
        assert bool(bufs["logits"].abs().sum() > 0)


class TestRealModelArguments:
    """Keyword calls, breaks, adoption, padding and the reference, declared on the model."""

    class Cached(nn.Module):
        tokens = graphflow.buffer(shape=("B", 1), dtype="int64", device=DEV, role="input", values=(0, 9), pad=0)
        logits = graphflow.buffer(shape=("B", 9), dtype="float32", device=DEV, role="output")
        keys = graphflow.buffer(shape=("B", 4), dtype="float32", device=DEV, role="state", adopt="cache.keys",
                                pad="keep")
        s0 = graphflow.stream(device=DEV)

        def __init__(self):
            super().__init__()
            self.attn = nn.Identity()

        @graphflow.segment("decode", inputs={"input_ids": "tokens"}, objects={"cache": "cache"},
                           constants={"use_cache": True}, returns=["logits"], reads=["keys"], writes=["keys"],
                           stream="s0", breaks=["attn"])
        def forward(self, *, input_ids, cache, use_cache):
            return input_ids

        @graphflow.step(sizes=(1, 2), reference={"call": "forward", "inputs": {"input_ids": "tokens"},
                                                 "returns": ["logits"]})
        def step(self, bufs):
            self.forward(bufs)

    YAML = """
        graphflow: 1
        name: Cached
        symbols: {B: [1, 2]}
        streams: {s0: {device: "cuda:0"}}
        buffers:
          tokens: {shape: [B, 1], dtype: int64, device: "cuda:0", role: input, values: [0, 9], pad: 0}
          logits: {shape: [B, 9], dtype: float32, device: "cuda:0", role: output}
          keys: {shape: [B, 4], dtype: float32, device: "cuda:0", role: state, adopt: cache.keys, pad: keep}
        segments:
          - {name: decode, kind: graph, call: forward, inputs: {input_ids: tokens}, objects: {cache: cache},
             constants: {use_cache: true}, returns: [logits], reads: [keys], writes: [keys], stream: s0,
             breaks: [attn]}
        reference: {call: forward, inputs: {input_ids: tokens}, returns: [logits]}
    """

    def test_the_declarations_equal_the_yaml(self):
        import textwrap

        assert normalized(plan_from_module(self.Cached())) == normalized(loads_plan(textwrap.dedent(self.YAML)))

    def test_the_signature_check_counts_keywords_and_skips_adopted_and_returned_buffers(self):
        class Wrong(nn.Module):
            x = graphflow.buffer(shape=("B",), dtype="float32", device=DEV, role="input")
            y = graphflow.buffer(shape=("B",), dtype="float32", device=DEV, role="output")

            @graphflow.segment("s", inputs={"value": "x"}, returns=["y"])
            def forward(self, x):
                return x

            @graphflow.step
            def step(self, bufs):
                self.forward(bufs)

        error = _error(Wrong())
        assert "the engine calls it with 0 buffer arguments (fn(*reads, *writes_not_in_reads): none) and keywords " \
               "value, which its signature cannot take" in error.message

    def test_a_reference_that_is_no_mapping_is_a_settings_error(self):
        class Bad(self.Cached):
            @graphflow.step(reference="forward")
            def step(self, bufs):
                self.forward(bufs)

        assert "bad @graphflow.step settings: 'reference' must be a graphflow.Reference or a mapping of its " \
               "fields (got 'forward')" in _error(Bad()).message
