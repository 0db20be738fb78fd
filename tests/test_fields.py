"""Field kinds: what one value of a plan element may be, checked when the element is built.

One class per kind, asserting the exact error pieces (attrs' style), then the plan
classes: each value the validator used to flag as a rule (an unknown dtype, a bare
``cuda``, ``warmup_iters: 0``...) is refused when the plan is built from Python, with
the field named, and by the loader at its line.
"""

from __future__ import annotations

import enum
import pickle

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphflow.plan import fields
from graphflow.errors import FieldError, FieldTypeError, FieldValueError, PlanError
from graphflow.plan.loader import loads_plan
from graphflow.plan import (
    DTYPE_ALIASES,
    DTYPE_BYTES,
    Buffer,
    BufferRole,
    CaptureSettings,
    Channel,
    ChannelKind,
    Mode,
    Plan,
    Segment,
    SegmentKind,
    Stream,
)


def refused(kind: fields.Kind, value, error=FieldValueError) -> FieldError:
    with pytest.raises(error) as info:
        kind.check("f", value)
    return info.value


class TestFieldError:
    def test_message_follows_attrs_and_keeps_its_pieces(self):
        error = FieldValueError("warmup_iters", ">= 1", 0)
        assert str(error) == "'warmup_iters' must be >= 1 (got 0)"
        assert (error.field, error.expected, error.value) == ("warmup_iters", ">= 1", 0)
        assert isinstance(error, ValueError) and isinstance(FieldTypeError("a", "b", 1), TypeError)

    def test_survives_pickling_with_its_pieces(self):
        error = pickle.loads(pickle.dumps(FieldTypeError("id", "an integer", "1")))
        assert (type(error), str(error)) == (FieldTypeError, "'id' must be an integer (got '1')")
        error = pickle.loads(pickle.dumps(FieldValueError("dtype", "one of a, b", "A", suggestions=("a",))))
        assert (error.suggestions, str(error)) == (("a",), "'dtype' must be one of a, b (got 'A'; did you mean 'a'?)")


class TestText:
    def test_any_string_passes(self):
        fields.Text().check("f", "x{y}")

    def test_a_non_string_is_a_type_error(self):
        assert str(refused(fields.Text(), 7, FieldTypeError)) == "'f' must be a string (got 7)"

    def test_a_pattern_must_match_all_of_it(self):
        kind = fields.Text(r"cuda:\d+", "a GPU")
        kind.check("f", "cuda:1")
        assert str(refused(kind, "cuda:1x")) == "'f' must be a GPU (got 'cuda:1x')"


class TestInteger:
    def test_a_bool_is_not_an_integer(self):
        assert str(refused(fields.Integer(), True, FieldTypeError)) == "'f' must be an integer (got True)"

    def test_minimum(self):
        assert str(refused(fields.Integer(minimum=1), 0)) == "'f' must be >= 1 (got 0)"
        assert fields.Integer(minimum=1).expected == "an integer >= 1"


class TestNumber:
    def test_ints_convert_to_floats_and_bools_stay_for_the_check(self):
        kind = fields.Number()
        assert (kind.convert(2), kind.convert(True)) == (2.0, True)
        assert type(kind.convert(2)) is float
        refused(kind, True, FieldTypeError)

    def test_inclusive_and_exclusive_minimum(self):
        fields.Number(minimum=0.0).check("f", 0.0)
        assert str(refused(fields.Number(minimum=0.0), -0.5)) == "'f' must be >= 0 (got -0.5)"
        assert str(refused(fields.Number(minimum=0.0, exclusive=True), 0.0)) == "'f' must be > 0 (got 0.0)"


class TestFlag:
    def test_only_a_bool(self):
        fields.Flag().check("f", False)
        assert str(refused(fields.Flag(), 1, FieldTypeError)) == "'f' must be true or false (got 1)"


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class TestChoice:
    def test_an_enum_value_string_converts_to_the_member(self):
        kind = fields.Choice.of(Color)
        assert (kind.convert("red"), kind.convert("Red"), kind.convert(3)) == (Color.RED, "Red", 3)

    def test_a_value_outside_the_choices(self):
        assert str(refused(fields.Choice.of(Color), "Red")) == "'f' must be one of red, blue (got 'Red'; did you mean 'red'?)"
        assert isinstance(refused(fields.Choice.of(Color), 3, FieldTypeError), TypeError)
        assert str(refused(fields.Choice(("a", "b")), "c")) == "'f' must be one of a, b (got 'c')"


class TestDtypeSpellings:
    """The spellings people carry over from torch (``torch.half``, ``torch.long``) and from
    papers and configs (``bf16``, ``fp8``) are answered with the dtype they mean, built
    in Python and read from YAML alike: a close-but-wrong guess (``float`` -> ``float64``,
    where torch's ``float`` is float32) costs a run."""

    @staticmethod
    def spelled(alias: str, upper: bool, prefix: str) -> str:
        return prefix + (alias.upper() if upper else alias)

    @given(alias=st.sampled_from(sorted(DTYPE_ALIASES)), upper=st.booleans(), prefix=st.sampled_from(["", "torch."]))
    def test_a_common_spelling_suggests_the_dtype_it_means(self, alias, upper, prefix):
        spelled = self.spelled(alias, upper, prefix)
        meant = " or ".join(repr(d) for d in DTYPE_ALIASES[alias])
        with pytest.raises(FieldValueError) as info:
            buffer(dtype=spelled)
        assert str(info.value).endswith(f"(got {spelled!r}; did you mean {meant}?)")
        error = load_error_of(f"buffers:\n  x: {{shape: [4], dtype: {spelled!r}, device: cpu}}\n")
        assert (error.line, error.message.endswith(f"(did you mean {meant}?)")) == (4, True), error.message

    @given(name=st.sampled_from(sorted(DTYPE_BYTES)), prefix=st.sampled_from(["", "torch."]))
    def test_a_dtype_in_capitals_or_with_torch_prefixed_suggests_itself(self, name, prefix):
        with pytest.raises(FieldValueError) as info:
            buffer(dtype=prefix + name.upper())
        assert str(info.value).endswith(f"; did you mean {name!r}?)")

    @given(st.text(max_size=12))
    def test_every_suggestion_is_a_dtype(self, text):
        assert set(fields.Choice(tuple(DTYPE_BYTES), aliases=DTYPE_ALIASES).closest(text)) <= set(DTYPE_BYTES)

    def test_the_aliases_name_dtypes_and_no_dtype_is_an_alias(self):
        assert all(set(meant) <= set(DTYPE_BYTES) for meant in DTYPE_ALIASES.values())
        assert not set(DTYPE_ALIASES) & set(DTYPE_BYTES)


def load_error_of(body: str) -> PlanError:
    with pytest.raises(PlanError) as info:
        loads_plan("graphflow: 1\nname: t\n" + body, "t.yaml")
    return info.value


class TestDimension:
    KIND = fields.Dimension(r"\w+(?:\*\w+)*")

    @pytest.mark.parametrize("value", [1, "B", "2*B"])
    def test_ints_symbols_and_products_pass(self, value):
        self.KIND.check("f", value)

    def test_zero_and_bad_spellings(self):
        assert str(refused(self.KIND, 0)) == "'f' must be >= 1 (got 0)"
        assert str(refused(self.KIND, "2+B")) == "'f' must be an int >= 1, a symbol or a product like '2*B' (got '2+B')"
        refused(self.KIND, 1.5, FieldTypeError)
        refused(self.KIND, True, FieldTypeError)


class TestSequence:
    KIND = fields.Sequence(fields.Integer(minimum=0), "ranks")

    def test_any_iterable_converts_to_a_tuple_but_a_string_does_not(self):
        assert self.KIND.convert([1, 2]) == (1, 2) and self.KIND.convert(iter([3])) == (3,)
        assert fields.Sequence(fields.Text(), "names").convert("ab") == "ab"

    def test_the_list_and_each_item_are_named(self):
        assert str(refused(self.KIND, 5, FieldTypeError)) == "'f' must be a list of ranks (got 5)"
        assert str(refused(self.KIND, (0, -1))) == "'f[1]' must be >= 0 (got -1)"


class TestTable:
    KIND = fields.Table(fields.Text(r"[A-Z]", "a capital"), fields.Integer(minimum=1), "capitals to counts", sort=True)

    def test_sorted_by_key(self):
        assert list(self.KIND.convert({"B": 1, "A": 2})) == ["A", "B"]

    def test_keys_and_values_are_named(self):
        assert str(refused(self.KIND, {"a": 1})) == "'f key' must be a capital (got 'a')"
        assert str(refused(self.KIND, {"A": 0})) == "'f.A' must be >= 1 (got 0)"
        assert str(refused(self.KIND, 4, FieldTypeError)) == "'f' must be a mapping of capitals to counts (got 4)"


class TestOptionalBoundsAndData:
    def test_optional_allows_none(self):
        fields.Optional(fields.Integer()).check("f", None)
        refused(fields.Optional(fields.Integer()), "1", FieldTypeError)

    def test_bounds_are_two_ordered_numbers(self):
        fields.Bounds().check("f", (0, 1.5))
        assert str(refused(fields.Bounds(), (1, 1))) == "'f' must be [low, high) with low < high (got (1, 1))"
        assert str(refused(fields.Bounds(), (1,))) == "'f' must be two numbers [low, high) (got (1,))"
        assert str(refused(fields.Bounds(), (0, "9"), FieldTypeError)) == "'f[1]' must be a number (got '9')"

    def test_data_is_what_yaml_holds(self):
        fields.Data().check("f", {"a": [1, 2.5, None, True, {"b": "c"}]})
        assert str(refused(fields.Data(), {"a": [object]}, FieldTypeError)).startswith("'f.a[0]' must be plain data")
        refused(fields.Data(), {1: 2}, FieldTypeError)


class TestYamlFields:
    def test_keys_in_field_order_with_nested_keys(self):
        layout = fields.yaml_fields(CaptureSettings)
        assert list(layout) == ["modes", "sizes", "size_symbol", "warmup_iters", "verify", "barrier_timeout_s",
                                "compile", "warmup"]
        assert list(layout["verify"]) == ["atol", "rtol"]

    def test_skip(self):
        assert list(fields.yaml_fields(Stream, skip=("name",))) == ["device"]


# -- the plan classes: refused when built, from Python and from YAML ----------------------------


def buffer(**changes) -> Buffer:
    return Buffer(**{"name": "x", "shape": ("B", 64), "dtype": "float32", "device": "cuda:0", **changes})


class TestBuiltFromPython:
    """Values the validator used to flag as rules (GF106, GF111, GF112, GF113, GF301, GF605,
    GF606) are refused at construction, naming the field."""

    @pytest.mark.parametrize("changes, message", [
        ({"dtype": "bf16"}, "'dtype' must be one of float64, float32, float16, bfloat16, float8_e4m3fn, "
                            "float8_e5m2, int64, int32, int16, int8, uint8, bool (got 'bf16'; did you mean "
                            "'bfloat16'?)"),
        ({"device": "cuda"}, "'device' must be 'cpu' or 'cuda:N' with the GPU's index (a bare 'cuda' is whichever "
                             "GPU is current) (got 'cuda')"),
        ({"shape": ("B", 0)}, "'shape[1]' must be >= 1 (got 0)"),
        ({"shape": ("B", "2+B")}, "'shape[1]' must be an int >= 1, a symbol or a product like '2*B' (got '2+B')"),
        ({"capacity": {"B": 0}}, "'capacity.B' must be >= 1 (got 0)"),
        ({"role": "inputs"}, "'role' must be one of input, output, state, internal (got 'inputs'; did you "
                            "mean 'input'?)"),
        ({"values": (5, 1)}, "'values' must be [low, high) with low < high (got (5, 1))"),
    ])
    def test_a_buffer(self, changes, message):
        with pytest.raises(FieldError) as info:
            buffer(**changes)
        assert str(info.value) == message

    def test_a_non_number_dimension_is_a_type_error(self):
        with pytest.raises(TypeError, match=r"^'shape\[1\]' must be an int >= 1, a symbol or a product like "):
            buffer(shape=("B", 1.5))

    @pytest.mark.parametrize("changes, message", [
        ({"warmup_iters": 0}, "'warmup_iters' must be >= 1 (got 0)"),
        ({"atol": -1e-3}, "'atol' must be >= 0 (got -0.001)"),
        ({"rtol": "0"}, "'rtol' must be a number (got '0')"),
        ({"barrier_timeout_s": 0}, "'barrier_timeout_s' must be > 0 (got 0.0)"),
        ({"sizes": (0, 1)}, "'sizes[0]' must be >= 1 (got 0)"),
        ({"mode_sizes": {"FULL": (0,)}}, "'mode_sizes.FULL[0]' must be >= 1 (got 0)"),
        ({"modes": ("full",)}, "'modes[0]' must be one of PIECEWISE, FULL (got 'full'; did you mean 'FULL'?)"),
        ({"size_symbol": "2B"}, "'size_symbol' must be a symbol name (letters, digits and _) (got '2B')"),
    ])
    def test_capture_settings(self, changes, message):
        with pytest.raises(FieldError) as info:
            CaptureSettings(**changes)
        assert str(info.value) == message

    @pytest.mark.parametrize("changes, message", [
        ({"world_size": 0}, "'world_size' must be >= 1 (got 0)"),
        ({"symbols": {"H": 0}}, "'symbols.H' must be >= 1 (got 0)"),
        ({"model": "pkg.mod"}, "'model' must be a factory 'package.module:function' (got 'pkg.mod')"),
        ({"buffers": ["x"]}, "'buffers[0]' must be a Buffer (got 'x')"),
        ({"model_args": {"f": object}}, "'model_args.f' must be plain data (strings, numbers, bools, null, lists "
                                        "and mappings) (got <class 'object'>)"),
    ])
    def test_a_plan(self, changes, message):
        with pytest.raises(FieldError) as info:
            Plan("p", **changes)
        assert str(info.value) == message

    def test_segments_and_channels(self):
        with pytest.raises(FieldValueError, match=r"^'ranks\[0\]' must be >= 0 \(got -1\)$"):
            Segment("a", SegmentKind.GRAPH, "a", ranks=[-1])
        with pytest.raises(FieldTypeError, match=r"^'reads' must be a list of buffer names \(got 'x'\)$"):
            Segment("a", SegmentKind.GRAPH, "a", reads="x")
        with pytest.raises(FieldTypeError, match=r"^'id' must be an integer \(got '1'\)$"):
            Channel("c", ChannelKind.P2P, "pp", "1", "target")

    def test_enum_values_and_lists_convert(self):
        segment = Segment("a", "graph", "a", reads=["x"], ranks=iter([1]))
        assert (segment.kind, segment.reads, segment.ranks) == (SegmentKind.GRAPH, ("x",), (1,))
        assert buffer(role="state").role is BufferRole.STATE
        assert CaptureSettings(modes=["FULL"], atol=1).modes == (Mode.FULL,)

    def test_evolve_checks_too(self):
        with pytest.raises(FieldValueError):
            attrs.evolve(CaptureSettings(), warmup_iters=0)


class TestReadFromYaml:
    """The loader reads each value by the same kind, so the same values fail at their line."""

    @pytest.mark.parametrize("body, line, element, message", [
        ("capture: {warmup_iters: 0}\n", 3, "capture.warmup_iters", "expected an integer >= 1, got 0"),
        ("symbols: {H: 0}\n", 3, "symbols.H", "expected an integer >= 1, got 0"),
        ("streams:\n  s0: {device: cuda}\n", 4, "streams 's0'.device",
         "expected 'cpu' or 'cuda:N' with the GPU's index (a bare 'cuda' is whichever GPU is current), got 'cuda'"),
        ("buffers:\n  x: {shape: [B], dtype: int8, device: cpu, values: [5, 1]}\n", 4, "buffers 'x'.values",
         "expected two numbers [low, high) with low < high, got [5, 1]"),
        ("buffers:\n  x: {shape: [B], dtype: int8, device: cpu, capacity: {2B: 4}}\n", 4, "buffers 'x'.capacity",
         "expected a symbol name (letters, digits and _) as a key, got '2B'"),
        ("capture: {verify: {rtol: -1}}\n", 3, "capture.verify.rtol", "expected a number >= 0, got -1"),
    ])
    def test_refused_at_its_line(self, body, line, element, message):
        with pytest.raises(PlanError) as info:
            loads_plan("graphflow: 1\nname: t\n" + body, "t.yaml")
        assert (info.value.line, info.value.element, info.value.message) == (line, element, message)
