"""Models written without graphflow in mind: outputs really written, keyword calls, adopted
state, verify against the model's own forward, submodule breaks, padding, the runner by name.

Everything runs on the CPU backend (no graph is recorded there: a region replays its
calls); ``tests/cuda/test_cuda_hf.py`` captures real graphs of Hugging Face models.
"""

from __future__ import annotations

import sys
import textwrap

import attrs
import pytest
import torch
from torch import nn

from graphflow import Reference, loads_plan
from graphflow.engine import RunOptions, run_pipeline
from graphflow.errors import CaptureError
from graphflow.plan import Buffer, BufferRole, CaptureSettings, Mode, Plan, Segment, SegmentKind, Stream
from graphflow.runtime import Runner
from graphflow.plan.rules import validate

G, E = SegmentKind.GRAPH, SegmentKind.EAGER
CPU = RunOptions(backend="cpu")


def plan_of(*segments: Segment, buffers=(), sizes=(1, 2, 4), modes=(Mode.PIECEWISE,), reference=None) -> Plan:
    base = [Buffer("x", ("B", 8), "float32", "cuda:0", role=BufferRole.INPUT),
            Buffer("y", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT)]
    return Plan("real", buffers=(*base, *buffers), streams=(Stream("s0", "cuda:0"),), segments=segments,
                capture=CaptureSettings(modes=modes, sizes=sizes, warmup_iters=1), reference=reference)


class MLP(nn.Module):
    """A plain model: ``forward`` returns its result, as models do."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


# -- 1. outputs really written ----------------------------------------------------------------
class TestOutputsWritten:
    def test_a_segment_that_returns_its_result_fails_warmup_naming_the_segment_and_buffer(self):
        class Head(MLP):
            def head(self, x, y):
                return self.forward(x)  # the bug under test: y is never written

        plan = plan_of(Segment("head", G, "head", reads=("x",), writes=("y",), stream="s0"))
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, CPU, model=Head().eval())
        error = info.value
        assert (error.phase, error.segment) == ("warmup", "head")
        assert error.message == ("segment head declares it writes 'y' but left it unwritten; it returned a tensor "
                                 "of shape [4, 8] instead")
        assert error.hint.startswith("declare returns: [y] to have graphflow copy what it returns into the buffer")

    def test_returns_copies_the_result_and_replay_matches_the_model(self):
        model = MLP().eval()
        plan = plan_of(Segment("head", G, "forward", inputs={"x": "x"}, returns=("y",), stream="s0"))
        with run_pipeline(plan, CPU, model=model) as engine:
            x = torch.randn(3, 8)
            (y,) = Runner(engine).run(x=x)
            assert torch.equal(y, model(x))

    def test_rebinding_the_argument_is_named_with_how_to_write_in_place(self):
        class Rebinds(nn.Module):
            def head(self, x, y):
                y = x * 2  # noqa: F841 - the bug under test: a new tensor, not the buffer

        plan = plan_of(Segment("head", G, "head", reads=("x",), writes=("y",), stream="s0"))
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, CPU, model=Rebinds())
        assert info.value.message == "segment head declares it writes 'y' but left it unwritten"
        assert info.value.hint.startswith("write into the buffer the engine passes (out=..., .copy_(), an in-place")

    def test_an_in_place_update_returned_as_a_new_tensor_is_named(self):
        class Returns(nn.Module):
            def step(self, x, y):
                torch.mul(x, 2, out=y)

            def bump(self, y):
                return y + 1  # the update went into a new tensor

        plan = plan_of(Segment("step", G, "step", reads=("x",), writes=("y",), stream="s0"),
                       Segment("bump", G, "bump", reads=("y",), writes=("y",), stream="s0"))
        with pytest.raises(CaptureError, match=r"segment bump declares it writes 'y' but left it unwritten; it "
                                               r"returned a tensor of shape \[4, 8\] instead"):
            run_pipeline(plan, CPU, model=Returns())

    def test_a_write_torch_does_not_see_counts_through_the_sentinel(self):
        class Raw(nn.Module):  # as a Triton or CuTe kernel writes: no version counter moves
            def head(self, x, y):
                y.numpy()[:] = (x * 2).numpy()

        plan = plan_of(Segment("head", G, "head", reads=("x",), writes=("y",), stream="s0"))
        with run_pipeline(plan, RunOptions(backend="cpu", disabled_checks=["host_sync"]), model=Raw()) as engine:
            assert engine.report.verify[0].bit_exact

    def test_a_partly_written_output_passes_and_keeps_no_sentinel(self):
        class Half(nn.Module):
            def head(self, x, y):
                y[:, :4].copy_(x[:, :4])

        plan = plan_of(Segment("head", G, "head", reads=("x",), writes=("y",), stream="s0"))
        with run_pipeline(plan, CPU, model=Half()) as engine:
            assert not engine.buffers.tensors["y"].isnan().any()

    def test_state_written_only_on_some_steps_is_not_flagged(self):
        class Sometimes(nn.Module):
            def head(self, x, cache, y):
                torch.mul(x, 2, out=y)  # the cache is written only every k steps: not this one

        cache = Buffer("cache", (8,), "float32", "cuda:0", role=BufferRole.STATE)
        plan = plan_of(Segment("head", G, "head", reads=("x", "cache"), writes=("cache", "y"), stream="s0"),
                       buffers=(cache,))
        with run_pipeline(plan, CPU, model=Sometimes()):
            pass


# -- 4. keyword calls ---------------------------------------------------------------------------
class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = {"scale": torch.tensor(3.0)}

    def forward(self, *, input_ids, table, offset, use_cache):
        assert use_cache is True
        return {"logits": input_ids * table["scale"] + offset, "extra": None}


class TestKeywordCalls:
    def test_inputs_objects_constants_and_returns_by_name(self):
        plan = plan_of(Segment("step", G, "forward", inputs={"input_ids": "x"}, objects={"table": "table"},
                               constants={"offset": 1.5, "use_cache": True}, returns=("logits",), stream="s0"),
                       buffers=(Buffer("logits", ("B", 8), "float32", "cuda:0", role=BufferRole.OUTPUT),))
        model = Keywords()
        with run_pipeline(plan, CPU, model=model) as engine:
            x = torch.randn(2, 8)
            runner = Runner(engine)
            logits = runner.run(x=x)[runner.outputs.index("logits")]
            assert torch.equal(logits, x * 3.0 + 1.5)

    def test_a_returned_shape_other_than_the_buffer_is_an_error_naming_both(self):
        class Wide(nn.Module):
            def forward(self, x):
                return torch.cat((x, x), dim=-1)

        plan = plan_of(Segment("step", G, "forward", inputs={"x": "x"}, returns=("y",), stream="s0"))
        with pytest.raises(CaptureError, match=r"segment step returned 'y' of shape \[4, 16\], but buffer 'y' is "
                                               r"\[4, 8\] at this size"):
            run_pipeline(plan, CPU, model=Wide())

    def test_a_mapping_without_the_buffer_name_lists_what_it_has(self):
        plan = plan_of(Segment("step", G, "forward", inputs={"input_ids": "x"}, objects={"table": "table"},
                               constants={"offset": 0.0, "use_cache": True}, returns=("y",), stream="s0"))
        with pytest.raises(CaptureError, match=r"step returned a dict without 'y' \(it has logits, extra\)"):
            run_pipeline(plan, CPU, model=Keywords())

    def test_an_object_path_that_does_not_resolve_fails_allocate(self):
        plan = plan_of(Segment("step", G, "forward", inputs={"x": "x"}, objects={"cache": "kv.layers"},
                               returns=("y",), stream="s0"))
        with pytest.raises(CaptureError) as info:
            run_pipeline(plan, CPU, model=MLP())
        assert info.value.phase == "allocate"
        assert "objects: cache='kv.layers': the model (MLP) has no attribute 'kv'" in info.value.message


# -- 3. adopted state ---------------------------------------------------------------------------
class Counter(nn.Module):
    """Advances a position it keeps itself, as a transformers StaticCache does."""

    def __init__(self, cache=None):
        super().__init__()
        self.state = type("State", (), {})()
        self.state.position = cache
        self.register_buffer("history", torch.zeros(4, 8))

    def forward(self, x):
        self.state.position.add_(1)
        self.history[:, :].add_(x.sum())
        return x * self.state.position


class TestAdopt:
    @staticmethod
    def counter_plan(adopt: bool):
        state = (Buffer("position", (), "float32", "cuda:0", role=BufferRole.STATE, adopt="state.position"),
                 Buffer("history", (4, 8), "float32", "cuda:0", role=BufferRole.STATE, adopt="history")) if adopt \
            else ()
        return plan_of(Segment("step", G, "forward", inputs={"x": "x"}, returns=("y",), stream="s0",
                               reads=tuple(b.name for b in state), writes=tuple(b.name for b in state)),
                       buffers=state, sizes=(2,))

    def test_undeclared_state_fails_verify_naming_the_tensors_and_adopt_first(self):
        model = Counter(torch.zeros(()))
        with pytest.raises(CaptureError) as info:
            run_pipeline(self.counter_plan(adopt=False), RunOptions(backend="cpu", detectors=False), model=model)
        error = info.value
        assert error.phase == "verify"
        assert "the step changed the model's tensors history, state.position, which no plan buffer holds" \
            in error.message
        assert error.hint.startswith("make that state the plan's: declare a buffer per tensor with adopt (adopt: "
                                     "'history', role: state)")
        assert "atol" not in error.hint

    def test_an_adopted_tensor_is_the_buffer_and_verify_restores_it(self):
        model = Counter(torch.zeros(()))
        history = model.history
        with run_pipeline(self.counter_plan(adopt=True), CPU, model=model) as engine:
            assert engine.buffers.tensors["history"] is history  # the model's own storage, not a copy
            assert engine.report.verify[0].bit_exact
            assert engine.report.buffer_bytes == (2 * 8 * 2 + 1 + 4 * 8) * 4  # counted in the memory figure

    def test_an_empty_slot_gets_the_buffer_and_is_emptied_again_at_close(self):
        model = Counter(None)
        with run_pipeline(self.counter_plan(adopt=True), CPU, model=model) as engine:
            assert model.state.position is engine.buffers.tensors["position"]
        assert model.state.position is None

    def test_a_tensor_of_another_shape_fails_allocate_with_both_shapes(self):
        model = Counter(torch.zeros(3))
        with pytest.raises(CaptureError) as info:
            run_pipeline(self.counter_plan(adopt=True), CPU, model=model)
        assert info.value.phase == "allocate"
        assert info.value.message == ("buffer 'position' adopts state.position, which holds a tensor of [3] float32 "
                                      "on cpu, but the plan allocates the buffer as [] float32 on cpu")

    def test_a_batch_sized_slot_is_pointed_at_each_descriptors_rows(self):
        seen = []

        class Rows(nn.Module):
            def __init__(self):
                super().__init__()
                self.cache = None

            def forward(self, x):
                seen.append(self.cache.shape[0])
                self.cache.add_(x)
                return x * 2

        cache = Buffer("cache", ("B", 8), "float32", "cuda:0", role=BufferRole.STATE, adopt="cache", pad="keep")
        plan = plan_of(Segment("step", G, "forward", inputs={"x": "x"}, returns=("y",), reads=("cache",),
                               writes=("cache",), stream="s0"), buffers=(cache,))
        with run_pipeline(plan, CPU, model=Rows()):
            assert set(seen) == {1, 2, 4}


# -- 2. verify against the reference ------------------------------------------------------------
class Split(nn.Module):
    """The model, cut into methods by hand; ``wrong`` makes the plan's second half differ."""

    def __init__(self, wrong: bool):
        super().__init__()
        self.mlp, self.wrong = MLP().eval(), wrong

    def forward(self, x):
        return self.mlp(x)

    def first(self, x, h):
        h.copy_(torch.relu(self.mlp.fc1(x)))

    def second(self, h, y):
        y.copy_(self.mlp.fc2(h) * (2.0 if self.wrong else 1.0))


class TestReference:
    @staticmethod
    def split_plan():
        return plan_of(Segment("first", G, "first", reads=("x",), writes=("h",), stream="s0"),
                       Segment("second", G, "second", reads=("h",), writes=("y",), stream="s0"),
                       buffers=(Buffer("h", ("B", 8), "float32", "cuda:0"),),
                       reference=Reference("forward", inputs={"x": "x"}, returns=("y",)))

    def test_a_plan_wrong_in_the_same_way_twice_fails_against_the_model(self):
        with pytest.raises(CaptureError) as info:
            run_pipeline(self.split_plan(), CPU, model=Split(wrong=True))
        error = info.value
        assert error.phase == "verify"
        assert error.message.startswith("graph replay of PIECEWISE(B=4) differs from the reference forward in 'y': ")
        assert "the plan's own eager step gave what the replay gave, so the plan computes something other than " \
               "the model" in error.message
        assert "atol" not in error.hint

    def test_a_right_plan_says_it_was_compared_with_the_reference(self):
        with run_pipeline(self.split_plan(), CPU, model=Split(wrong=False)) as engine:
            assert {r.against for r in engine.report.verify} == {("the reference forward", "the eager step")}

    def test_the_cli_result_line_names_the_reference(self, tmp_path, capsys, monkeypatch):
        from graphflow import dump_plan
        from graphflow.cli import main

        (tmp_path / "splitmodel.py").write_text(textwrap.dedent("""
            import sys
            sys.path.insert(0, %r)
            from test_real_models import Split

            def build():
                return Split(wrong=False)
        """ % str(__import__("pathlib").Path(__file__).parent)))
        plan = self.split_plan()
        (tmp_path / "plan.yaml").write_text(dump_plan(attrs.evolve(plan, model="splitmodel:build")))
        monkeypatch.chdir("/")
        assert main(["run", str(tmp_path / "plan.yaml"), "--quiet", "--steps", "0"]) == 0
        assert capsys.readouterr().out.strip().endswith(
            "verify 3/3 bit-exact against the reference forward and the eager step")
        sys.modules.pop("splitmodel", None)


# -- 4. breaks at submodules ----------------------------------------------------------------------
class TestBreaks:
    @staticmethod
    def broken_plan(*patterns):
        return plan_of(Segment("step", G, "forward", inputs={"x": "x"}, returns=("y",), stream="s0",
                               breaks=patterns), modes=(Mode.PIECEWISE, Mode.FULL))

    def test_breaks_wrap_the_submodules_for_the_run_and_unwrap_at_close(self):
        model = MLP().eval()
        with run_pipeline(self.broken_plan("act", "fc2"), CPU, model=model) as engine:
            assert "forward" in vars(model.act)
            x = torch.randn(4, 8)
            assert torch.equal(Runner(engine).run(x=x)[0], model(x))  # the model used directly: unchanged
        assert "forward" not in vars(model.act)

    def test_a_pattern_matching_no_submodule_fails_allocate_naming_the_paths_near_it(self):
        with pytest.raises(CaptureError) as info:
            run_pipeline(self.broken_plan("layers.*.self_attn"), CPU, model=MLP())
        assert info.value.phase == "allocate"
        assert ("breaks pattern 'layers.*.self_attn' of segment step matches no submodule of the model — write a "
                "path such as model.layers.*.self_attn") in info.value.message

    def test_show_says_where_a_segment_is_cut(self):
        from graphflow.view.render import format_summary, summarize

        text = format_summary(summarize(self.broken_plan("act")))
        assert "  step breaks at act: one more graph per call, the call eager between" in text

    def test_a_rollback_unwraps_too(self):
        class Off(MLP):
            def reference(self, x):
                return self.forward(x) + 1

        model = Off().eval()
        plan = attrs.evolve(self.broken_plan("act"), reference=Reference("reference", inputs={"x": "x"},
                                                                          returns=("y",)))
        with pytest.raises(CaptureError, match="differs from the reference reference"):
            run_pipeline(plan, CPU, model=model)
        assert "forward" not in vars(model.act)


# -- 5. padding ---------------------------------------------------------------------------------
class Slots(nn.Module):
    """Writes each row's value into the cache row its slot input names."""

    def forward(self, x, slots, cache, y):
        cache.index_copy_(0, slots, x)
        torch.mul(x, 2, out=y)


class TestPadding:
    @staticmethod
    def slot_plan(pad):
        buffers = (Buffer("slots", ("B",), "int64", "cuda:0", role=BufferRole.INPUT, values=(0, 4), pad=pad),
                   Buffer("cache", (5, 8), "float32", "cuda:0", role=BufferRole.STATE))
        return plan_of(Segment("step", G, "forward", reads=("x", "slots", "cache"), writes=("cache", "y"),
                               stream="s0"), buffers=buffers, sizes=(4,))

    def test_padded_rows_of_an_input_hold_its_pad_value(self):
        with run_pipeline(self.slot_plan(4), CPU, model=Slots()) as engine:
            runner = Runner(engine)
            runner.clear_state()
            cache = engine.buffers.tensors["cache"]
            runner.run(torch.ones(2, 8), torch.tensor([0, 1]))
            assert cache[2:4].abs().sum() == 0 and cache[4].abs().sum() == 0  # padded rows wrote slot 4 (x=0)
            assert engine.buffers.tensors["slots"].tolist() == [0, 1, 4, 4]

    def test_pad_keep_puts_the_padded_rows_of_state_back(self):
        class Rows(nn.Module):
            def forward(self, x, cache, y):
                cache.add_(1)
                torch.mul(x, 2, out=y)

        cache = Buffer("cache", ("B", 8), "float32", "cuda:0", role=BufferRole.STATE, pad="keep")
        plan = plan_of(Segment("step", G, "forward", reads=("x", "cache"), writes=("cache", "y"), stream="s0"),
                       buffers=(cache,), sizes=(4,))
        with run_pipeline(plan, CPU, model=Rows()) as engine:
            runner = Runner(engine)
            runner.clear_state()
            runner.run(torch.ones(3, 8))
            assert engine.buffers.tensors["cache"][:, 0].tolist() == [1, 1, 1, 0]

    def test_validation_flags_batch_indexed_state_without_a_rule_only_when_batches_pad(self):
        cache = Buffer("cache", ("B", 8), "float32", "cuda:0", role=BufferRole.STATE)
        segment = Segment("step", G, "forward", reads=("x", "cache"), writes=("cache", "y"), stream="s0")
        found = validate(plan_of(segment, buffers=(cache,), sizes=(1, 4)))
        [d] = [d for d in found.diagnostics if d.code == "GF206"]
        assert d.message == ("state buffer 'cache' has a row per batch row, and batches of 2, 3 run padded: the "
                             "padded rows write its rows")
        assert "GF206" not in validate(plan_of(segment, buffers=(cache,), sizes=(1, 2, 3, 4))).codes()

    @pytest.mark.parametrize("buffer, message", [
        (Buffer("cache", ("B", 8), "float32", "cuda:0", role=BufferRole.INTERNAL, pad="keep"),
         "pad: keep on internal buffer 'cache': only state persists across steps"),
        (Buffer("cache", ("B", 8), "float32", "cuda:0", role=BufferRole.STATE, pad=3),
         "pad: 3 on state buffer 'cache': only inputs are filled by the runtime"),
        (Buffer("cache", (5, 8), "float32", "cuda:0", role=BufferRole.STATE, pad="keep"),
         "buffer 'cache' declares pad: keep but its shape [5, 8] has no B dimension, so no padded rows"),
    ])
    def test_a_rule_that_does_not_apply_is_an_error(self, buffer, message):
        segment = Segment("step", G, "forward", reads=("x", "cache"), writes=("cache", "y"), stream="s0")
        [d] = [d for d in validate(plan_of(segment, buffers=(buffer,))).diagnostics if d.code == "GF207"]
        assert d.message == message


# -- the runner by name, modes, factory import ---------------------------------------------------
class TestRunnerAndCli:
    def test_inputs_by_name_and_the_errors_that_name_them(self):
        class Double(nn.Module):
            def forward(self, x, y):
                torch.mul(x, 2, out=y)

        plan = plan_of(Segment("step", G, "forward", reads=("x",), writes=("y",), stream="s0"))
        with run_pipeline(plan, CPU, model=Double()) as engine:
            runner = Runner(engine)
            assert torch.equal(runner.run(x=torch.ones(2, 8))[0], torch.full((2, 8), 2.0))
            with pytest.raises(TypeError, match="no input named z; missing x: the inputs are x"):
                runner.run(z=torch.ones(2, 8))
            with pytest.raises(TypeError, match="give the inputs in order or by name, not both"):
                runner.run(torch.ones(2, 8), x=torch.ones(2, 8))

    def test_a_factory_beside_the_plan_imports_without_pythonpath(self, tmp_path, capsys, monkeypatch):
        from graphflow.cli import main

        home = tmp_path / "mine"
        home.mkdir()
        (home / "beside_plan_model.py").write_text(textwrap.dedent("""
            import torch
            from torch import nn

            class Double(nn.Module):
                def forward(self, x, y):
                    torch.mul(x, 2, out=y)

            def build():
                return Double()
        """))
        (home / "plan.yaml").write_text(textwrap.dedent("""
            graphflow: 1
            name: beside
            model: beside_plan_model:build
            symbols: {B: [1, 2]}
            streams: {s0: {device: "cuda:0"}}
            buffers:
              x: {shape: [B, 8], dtype: float32, device: "cuda:0", role: input}
              y: {shape: [B, 8], dtype: float32, device: "cuda:0", role: output}
            segments:
              - {name: step, kind: graph, call: forward, reads: [x], writes: [y], stream: s0}
        """))
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(sys, "path", list(sys.path))
        assert main(["run", str(home / "plan.yaml"), "--quiet", "--steps", "0"]) == 0
        assert capsys.readouterr().out.startswith("ok: beside: 2 descriptors")
        sys.modules.pop("beside_plan_model", None)
        (home / "plan.yaml").write_text((home / "plan.yaml").read_text().replace("beside_plan_model", "elsewhere"))
        assert main(["run", str(home / "plan.yaml"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert f"plan.yaml:4: model: cannot find module 'elsewhere' for model 'elsewhere:build' in the import path, " \
               f"{home} or {tmp_path}" in err
        assert "put the module beside the plan or in the current directory" in err

    @pytest.mark.parametrize("how", ["option", "environment"])
    def test_modes_switch_without_editing_the_plan(self, how, capsys, monkeypatch):
        from graphflow.cli import main

        argv = ["run", "plans/toy_full.yaml", "--quiet", "--steps", "0", "--sizes", "1"]
        if how == "option":
            argv += ["--modes", "full"]
        else:
            monkeypatch.setenv("GRAPHFLOW_MODES", "FULL")
        assert main(argv) == 0
        assert capsys.readouterr().out.startswith("ok: toy-full: 1 descriptors")

    def test_a_mode_the_plan_cannot_capture_is_its_validation_error(self, capsys):
        from graphflow.cli import main

        assert main(["run", "plans/toy.yaml", "--modes", "FULL", "--quiet"]) == 1
        assert "GF601 error segment L0.mix: FULL region of family target contains eager segment(s)" in \
            capsys.readouterr().err

    def test_an_unknown_mode_is_a_bad_argument(self, capsys):
        from graphflow.cli import main

        assert main(["run", "plans/toy.yaml", "--modes", "FUL"]) == 2
        assert "--modes: expected modes among PIECEWISE, FULL, comma-separated (got 'FUL')" in capsys.readouterr().err


def test_with_modes_drops_the_sizes_of_modes_no_longer_captured():
    plan = loads_plan(textwrap.dedent("""
        graphflow: 1
        name: m
        symbols: {B: [1, 2, 4, 8]}
        capture: {modes: [PIECEWISE, FULL], sizes: {PIECEWISE: B, FULL: [1, 2]}}
    """))
    assert plan.with_modes(["FULL"]).capture.sizes_for(Mode.FULL) == (1, 2)
    assert plan.with_modes(["PIECEWISE"]).capture.sizes_for(Mode.PIECEWISE) == (1, 2, 4, 8)
    assert plan.with_modes(["PIECEWISE"]).capture.mode_sizes == {}


class Routed(nn.Module):
    """A model with a part no graph can hold: it reads a value on the host."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)
        self.route = Roll()

    def forward(self, x):
        return self.route(torch.tanh(self.fc(x)))


class Roll(nn.Module):
    def forward(self, h):
        return h.roll(int(h.abs().argmax()) % h.shape[-1], dims=-1)  # a value read on the host


class TestDataDependentBreaks:
    @staticmethod
    def routed_plan(mode):
        return plan_of(Segment("step", G, "forward", inputs={"x": "x"}, returns=("y",), stream="s0",
                               breaks=("route",)), modes=(mode,))

    def test_piecewise_runs_the_break_eagerly_and_replays_what_the_model_computes(self):
        model = Routed().eval()
        with run_pipeline(self.routed_plan(Mode.PIECEWISE), CPU, model=model) as engine:
            assert all(r.bit_exact for r in engine.report.verify)
            x = torch.randn(3, 8)
            assert torch.equal(Runner(engine).run(x=x)[0], model(x))

    def test_full_captures_the_break_and_the_detectors_name_its_host_read(self):
        with pytest.raises(CaptureError) as info:
            run_pipeline(self.routed_plan(Mode.FULL), CPU, model=Routed().eval())
        assert info.value.phase == "warmup"
        assert "[host_sync] step: aten._local_scalar_dense" in info.value.message


class TestToleranceAdvice:
    def test_float_noise_gets_the_tolerance_advice_last_and_a_real_difference_none(self):
        class Noisy(nn.Module):
            def __init__(self, scale):
                super().__init__()
                self.scale = scale

            def head(self, x, y):  # a different rounding at each run, of the size the scale says
                y.copy_(x + self.scale * torch.rand_like(x))

        plan = plan_of(Segment("head", G, "head", reads=("x",), writes=("y",), stream="s0"))
        with pytest.raises(CaptureError) as noise:
            run_pipeline(plan, CPU, model=Noisy(1e-6))
        assert noise.value.segment == "head"
        assert noise.value.hint.split("; ")[-1].startswith("only if differences of ")
        assert noise.value.hint.endswith("are float rounding you accept, set capture.verify atol/rtol")
        with pytest.raises(CaptureError) as real:
            run_pipeline(plan, CPU, model=Noisy(1.0))
        assert "atol" not in real.value.hint
