"""The YAML loader: the BRIEF's example, every field, templating, errors, dump, schema."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import yaml

from graphflow.errors import PlanError
from graphflow.plan.loader import dump_plan, load_plan, loads_plan, plan_to_dict
from graphflow.plan import (
    DTYPE_BYTES,
    Buffer,
    BufferRole,
    CaptureSettings,
    Channel,
    ChannelKind,
    Family,
    Mode,
    Origin,
    Plan,
    Prewarm,
    Reference,
    Segment,
    SegmentKind,
    Stream,
    WarmupPolicy,
)

# The GPU machine lacks jsonschema: skip this CPU-only module there instead of failing collection.
jsonschema = pytest.importorskip("jsonschema")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MALFORMED = sorted((ROOT / "tests" / "malformed").glob("*.yaml"))
PLANS = sorted((ROOT / "plans").glob("*.yaml"))
SCHEMA = json.loads((ROOT / "graphflow" / "plan" / "schema" / "plan.schema.json").read_text())

#: The BRIEF's example plan, shared with the CLI tests.
BRIEF_EXAMPLE = (ROOT / "tests" / "data" / "brief_example.yaml").read_text()


def brief_plan() -> Plan:
    """The BRIEF's example written out by hand, element by element."""
    buffers = [Buffer("x", ("B", 1024), "bfloat16", "cuda:0", BufferRole.INPUT)]
    for prefix, shape in (("q", ("B", 8, 1, 128)), ("kv", ("B", 2, 8, 1, 128)), ("o", ("B", 8, 1, 128))):
        buffers += [Buffer(f"{prefix}{i}", shape, "bfloat16", "cuda:0") for i in range(4)]
    buffers.append(Buffer("logits", ("B", 32000), "float32", "cuda:0", BufferRole.OUTPUT))
    segments = []
    for i in range(4):
        segments += [
            Segment(f"L{i}.pre", SegmentKind.GRAPH, f"layers.{i}.pre_attention", reads=["x"],
                    writes=[f"q{i}", f"kv{i}"], stream="s0"),
            Segment(f"L{i}.attn", SegmentKind.EAGER, f"layers.{i}.attention", reads=[f"q{i}", f"kv{i}"],
                    writes=[f"o{i}"]),
            Segment(f"L{i}.post", SegmentKind.GRAPH, f"layers.{i}.post_attention", reads=[f"o{i}", "x"],
                    writes=["x"], stream="s0", channels=["tp_ar"], data_dependent=True),
        ]
    segments.append(Segment("head", SegmentKind.GRAPH, "head", reads=["x"], writes=["logits"], stream="s0"))
    return Plan(
        name="dsv4-mini-decode",
        model="graphflow.integrations.dsv4:build_model",
        buffers=buffers,
        streams=[Stream("s0", "cuda:0")],
        channels=[Channel("tp_ar", ChannelKind.ALL_REDUCE, "tp", 1, "target", WarmupPolicy.REAL)],
        segments=segments,
        families=[Family("target")],
        capture=CaptureSettings(modes=[Mode.PIECEWISE], sizes=[1, 2, 4, 8, 16, 32], size_symbol="B",
                                warmup_iters=2, atol=0.0, rtol=0.0),
    )


def plan_text(body: str) -> str:
    return "graphflow: 1\nname: t\n" + textwrap.dedent(body)


def load_error(text: str, file: str = "plans/t.yaml") -> PlanError:
    with pytest.raises(PlanError) as info:
        loads_plan(text, file)
    return info.value


class TestBriefExample:
    def test_loads_into_the_plan_written_by_hand(self):
        assert loads_plan(BRIEF_EXAMPLE) == brief_plan()

    def test_segments_expand_as_one_block_per_layer(self):
        names = [s.name for s in loads_plan(BRIEF_EXAMPLE).segments]
        assert names[:7] == ["L0.pre", "L0.attn", "L0.post", "L1.pre", "L1.attn", "L1.post", "L2.pre"]
        assert names[-1] == "head" and len(names) == 13

    def test_piecewise_regions_split_at_each_eager_attention(self):
        regions = loads_plan(BRIEF_EXAMPLE).regions(Mode.PIECEWISE)
        assert [r.segments for r in regions] == [
            ("L0.pre",), ("L0.post", "L1.pre"), ("L1.post", "L2.pre"), ("L2.post", "L3.pre"), ("L3.post", "head"),
        ]

    def test_origins_name_the_declaring_line_of_every_expanded_element(self):
        plan = loads_plan(BRIEF_EXAMPLE, "plans/mini.yaml")
        assert plan.origin("segment", "L2.attn") == Origin("plans/mini.yaml", 19)
        assert plan.origin("segment", "L0.post") == Origin("plans/mini.yaml", 21)
        assert plan.origin("segment", "head") == Origin("plans/mini.yaml", 24)
        assert plan.origin("buffer", "kv3") == Origin("plans/mini.yaml", 11)
        assert plan.origin("stream", "s0").line == 7
        assert plan.origin("channel", "tp_ar").line == 15
        assert plan.origin("family", "target").line == 15
        assert plan.origin("plan", "dsv4-mini-decode").line == 2
        assert plan.origin("capture", "sizes").line == 27
        expected = {f"segment:{s.name}" for s in plan.segments} | {f"buffer:{b.name}" for b in plan.buffers}
        assert expected <= set(plan.origins)

    def test_round_trips_through_dump(self):
        plan = loads_plan(BRIEF_EXAMPLE)
        assert loads_plan(dump_plan(plan)) == plan

    def test_validates_against_the_json_schema(self):
        jsonschema.validate(yaml.safe_load(BRIEF_EXAMPLE), SCHEMA)


class TestFields:
    def test_every_buffer_field(self):
        plan = loads_plan(plan_text("""
            symbols: {B: [1, 2], H: 8}
            buffers:
              tok: {shape: [B], dtype: int64, device: "cuda:1", role: input, values: [0, 32000]}
              kv: {shape: [B, 2*H, 64], dtype: float8_e4m3fn, device: cuda:1, role: state, capacity: {B: 64}}
              kv_view: {shape: [B], dtype: uint8, device: cuda:1, alias_of: kv}
        """))
        assert plan.buffers == (
            Buffer("tok", ("B",), "int64", "cuda:1", BufferRole.INPUT, values=(0, 32000)),
            Buffer("kv", ("B", "2*H", 64), "float8_e4m3fn", "cuda:1", BufferRole.STATE, capacity={"B": 64}),
            Buffer("kv_view", ("B",), "uint8", "cuda:1", BufferRole.INTERNAL, alias_of="kv"),
        )
        assert plan.symbols == {"H": 8}
        assert plan.capture.sizes == (1, 2) and plan.capture.size_symbol == "B"

    def test_every_channel_and_prewarm_field(self):
        plan = loads_plan(plan_text("""
            prewarm:
              tiles: {call: layers.0.moe.prewarm}
              once: {call: warm, per_size: false}
            channels:
              ep: {kind: all_to_all, group: ep, id: 7, family: draft, warmup: prepare, prewarm: tiles, jit: true}
              pp: {kind: p2p, group: pp, id: -1, family: target, warmup: placeholder}
        """))
        assert plan.prewarm == (Prewarm("tiles", "layers.0.moe.prewarm", True), Prewarm("once", "warm", False))
        assert plan.channels == (
            Channel("ep", ChannelKind.ALL_TO_ALL, "ep", 7, "draft", WarmupPolicy.PREPARE, "tiles", True),
            Channel("pp", ChannelKind.P2P, "pp", -1, "target", WarmupPolicy.PLACEHOLDER, None, False),
        )

    def test_every_segment_field(self):
        plan = loads_plan(plan_text("""
            segments:
              - {name: a, kind: graph, call: m.a}
              - name: b
                kind: eager
                call: m.b
                reads: [x]
                writes: [y, z]
                stream: s1
                channels: [c]
                family: draft
                data_dependent: true
                device: cuda:1
                ranks: [0, 2]
                after: [a]
                kernels: [dsv4.rms_norm, moe.grouped_gemm]
        """))
        assert plan.segments == (
            Segment("a", SegmentKind.GRAPH, "m.a"),
            Segment("b", SegmentKind.EAGER, "m.b", ("x",), ("y", "z"), "s1", ("c",), "draft", True, "cuda:1",
                    (0, 2), ("a",), ("dsv4.rms_norm", "moe.grouped_gemm")),
        )
        assert loads_plan(dump_plan(plan)) == plan

    def test_top_level_fields_and_every_capture_field(self):
        plan = loads_plan(plan_text("""
            model: pkg.models:build
            model_args: {layers: 4, dims: [1, 2], opts: {fast: true}}
            world_size: 4
            families: [draft, target]
            capture:
              modes: [FULL, PIECEWISE]
              sizes: [8, 1, 4]
              size_symbol: N
              warmup_iters: 1
              verify: {atol: 0.001, rtol: 1}
              barrier_timeout_s: 5
        """))
        assert plan.model == "pkg.models:build"
        assert plan.model_args == {"layers": 4, "dims": [1, 2], "opts": {"fast": True}}
        assert plan.world_size == 4
        assert plan.families == (Family("draft"), Family("target"))
        assert plan.capture == CaptureSettings((Mode.FULL, Mode.PIECEWISE), (8, 1, 4), "N", 1, 0.001, 1.0, 5.0)

    def test_defaults_when_keys_are_absent(self):
        plan = loads_plan("graphflow: 1\nname: bare\n")
        assert plan == Plan("bare")
        assert plan.families == (Family("target"),)

    def test_explicit_sizes_keep_their_order_and_duplicates_for_the_validator(self):
        plan = loads_plan(plan_text("symbols: {B: [1, 2]}\ncapture: {sizes: [4, 2, 2]}\n"))
        assert plan.capture.sizes == (4, 2, 2) and plan.capture.size_symbol == "B"

    def test_families_default_to_those_named_in_file_order(self):
        plan = loads_plan(plan_text("""
            channels:
              d: {kind: all_reduce, group: tp, id: 2, family: draft}
            segments:
              - {name: a, kind: graph, call: a, family: ctx}
              - {name: b, kind: graph, call: b}
              - {name: c, kind: graph, call: c, family: draft}
        """))
        assert plan.families == (Family("draft"), Family("ctx"), Family("target"))
        assert plan.origin("family", "ctx").line == 7

    def test_loading_never_imports_the_model_factory(self):
        plan = loads_plan(plan_text("model: graphflow_no_such_package.deep:build\n"))
        assert plan.model == "graphflow_no_such_package.deep:build"
        assert "graphflow_no_such_package" not in sys.modules

    def test_loader_imports_no_torch(self):
        code = f"import sys, graphflow.plan.loader as l; l.loads_plan({BRIEF_EXAMPLE!r}); sys.exit('torch' in sys.modules)"
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={"PYTHONPATH": str(ROOT)},
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stderr


class TestTemplates:
    @pytest.mark.parametrize("spec, values", [
        ('"range(3)"', [0, 1, 2]),
        ('"range(2, 5)"', [2, 3, 4]),
        ('"range(10, 0, -4)"', [10, 6, 2]),
        ("[3, 7]", [3, 7]),
        ("[up, down]", ["up", "down"]),
    ])
    def test_for_each_forms(self, spec, values):
        plan = loads_plan(plan_text(f"""
            for_each: {{v: {spec}}}
            prewarm: {{"p{{v}}": {{call: "warm.{{v}}"}}}}
        """))
        assert plan.prewarm == tuple(Prewarm(f"p{v}", f"warm.{v}") for v in values)

    def test_a_templated_device_is_checked_once_expanded(self):
        plan = loads_plan(plan_text("""
            for_each: {v: "range(2)"}
            streams: {"s{v}": {device: "cuda:{v}"}}
        """))
        assert plan.streams == (Stream("s0", "cuda:0"), Stream("s1", "cuda:1"))
        error = load_error(plan_text('for_each: {v: [up]}\nstreams: {"s{v}": {device: "cuda:{v}"}}\n'))
        assert (error.line, error.element) == (4, "streams 's{v}'.device")
        assert error.message.startswith("expected 'cpu' or 'cuda:N' with the GPU's index")

    def test_arithmetic_offsets(self):
        plan = loads_plan(plan_text("""
            for_each: {layer: "range(1, 3)"}
            segments:
              - {name: "L{layer}", kind: graph, call: "layers.{layer}", reads: ["h{layer-1}"], writes: ["h{layer}"],
                 after: ["L{layer - 1}"], device: "cuda:{layer+10}"}
        """))
        assert plan.segments == (
            Segment("L1", SegmentKind.GRAPH, "layers.1", ("h0",), ("h1",), after=("L0",), device="cuda:11"),
            Segment("L2", SegmentKind.GRAPH, "layers.2", ("h1",), ("h2",), after=("L1",), device="cuda:12"),
        )

    def test_two_variables_expand_as_a_cartesian_product_in_declaration_order(self):
        plan = loads_plan(plan_text("""
            for_each: {layer: "range(2)", part: [a, b]}
            buffers:
              "x{part}{layer}": {shape: [1], dtype: int8, device: cpu}
            segments:
              - {name: "L{layer}{part}", kind: graph, call: "m.{part}"}
              - {name: "L{layer}{part}.tail", kind: eager, call: "m.t"}
        """))
        assert [b.name for b in plan.buffers] == ["xa0", "xb0", "xa1", "xb1"]
        assert [s.name for s in plan.segments] == ["L0a", "L0a.tail", "L0b", "L0b.tail", "L1a", "L1a.tail",
                                                   "L1b", "L1b.tail"]

    def test_blocks_split_where_the_variables_change(self):
        plan = loads_plan(plan_text("""
            for_each: {i: "range(2)", j: "range(2)"}
            segments:
              - {name: "a{i}", kind: graph, call: a}
              - {name: "b{i}", kind: graph, call: b}
              - {name: mid, kind: eager, call: m}
              - {name: "c{j}", kind: graph, call: c}
              - {name: "d{i}", kind: graph, call: d}
        """))
        assert [s.name for s in plan.segments] == ["a0", "b0", "a1", "b1", "mid", "c0", "c1", "d0", "d1"]

    def test_every_kind_of_named_element_expands(self):
        plan = loads_plan(plan_text("""
            for_each: {r: "range(2)"}
            streams: {"s{r}": {device: "cuda:{r}"}}
            channels: {"ar{r}": {kind: all_reduce, group: "tp{r}", id: 1, family: target, prewarm: "p{r}"}}
            prewarm: {"p{r}": {call: "warm.{r}"}}
        """))
        assert [c.group for c in plan.channels] == ["tp0", "tp1"]
        assert [c.prewarm for c in plan.channels] == ["p0", "p1"]
        assert [p.call for p in plan.prewarm] == ["warm.0", "warm.1"]
        assert plan.origin("channel", "ar1").line == 6

    def test_doubled_braces_are_literal(self):
        plan = loads_plan(plan_text("""
            for_each: {i: [1]}
            segments: [{name: "{{raw}}{i}", kind: graph, call: "f{{}}"}]
        """))
        assert (plan.segments[0].name, plan.segments[0].call) == ("{raw}1", "f{}")

    def test_61_layer_template_is_compact(self):
        sizes = [1, 2, 4, *range(8, 513, 8)]
        text = plan_text(f"""
            symbols: {{B: {sizes}}}
            for_each: {{layer: "range(61)"}}
            streams: {{s0: {{device: cuda:0}}}}
            buffers:
              x: {{shape: [B, 7168], dtype: bfloat16, device: cuda:0, role: input}}
              "q{{layer}}": {{shape: [B, 128, 192], dtype: bfloat16, device: cuda:0}}
              "kv{{layer}}": {{shape: [B, 512], dtype: bfloat16, device: cuda:0}}
              "o{{layer}}": {{shape: [B, 128, 128], dtype: bfloat16, device: cuda:0}}
              logits: {{shape: [B, 129280], dtype: float32, device: cuda:0, role: output}}
            channels: {{tp_ar: {{kind: all_reduce, group: tp, id: 1, family: target}}}}
            segments:
              - {{name: "L{{layer}}.pre", kind: graph, call: "layers.{{layer}}.pre_attention", reads: [x],
                 writes: ["q{{layer}}", "kv{{layer}}"], stream: s0}}
              - {{name: "L{{layer}}.attn", kind: eager, call: "layers.{{layer}}.attention",
                 reads: ["q{{layer}}", "kv{{layer}}"], writes: ["o{{layer}}"]}}
              - {{name: "L{{layer}}.post", kind: graph, call: "layers.{{layer}}.post_attention",
                 reads: ["o{{layer}}", x], writes: [x], stream: s0, channels: [tp_ar], data_dependent: true}}
              - {{name: head, kind: graph, call: head, reads: [x], writes: [logits], stream: s0}}
            capture: {{modes: [PIECEWISE, FULL], sizes: B, warmup_iters: 1}}
        """)
        plan = loads_plan(text)
        assert len(text.splitlines()) <= 40
        assert len(plan.segments) == 61 * 3 + 1
        assert len(plan.buffers) == 61 * 3 + 2
        assert len(plan.capture.sizes) == 67 and len(plan.descriptors()) == 134
        assert [s.name for s in plan.segments[-4:]] == ["L60.pre", "L60.attn", "L60.post", "head"]
        assert len(plan.regions(Mode.PIECEWISE)) == 62


class TestErrors:
    """Each error names file, line and element; asserted exactly."""

    @pytest.mark.parametrize("body, line, element, message", [
        ("segments:\n  - {name: a, kind: graph, call: a,\n     reeds: [x]}\n", 5, "segments[0] 'a'",
         "unknown key 'reeds' (did you mean 'reads'?); known keys: name, kind, call, reads, writes, stream, "
         "channels, family, data_dependent, device, ranks, after, kernels, inputs, objects, constants, returns, "
         "breaks, compile"),
        ("segments:\n  - {name: a, kind: graph, call: a, writes: 5}\n", 4, "segments[0] 'a'.writes",
         "expected a list of buffer names, got int 5"),
        ("segments:\n  - {name: a, kind: graph, call: a, reads: [x, 3]}\n", 4, "segments[0] 'a'.reads",
         "expected a list of buffer names, got int 3 at [1]"),
        ("segments:\n  - {name: a, kind: graph, call: 7}\n", 4, "segments[0] 'a'.call", "expected a string, got int 7"),
        ("segments:\n  - {name: a, kind: graph, call: a, data_dependent: 1}\n", 4,
         "segments[0] 'a'.data_dependent", "expected true or false, got int 1"),
        ("segments:\n  - {name: a, kind: graph}\n", 4, "segments[0] 'a'", "missing required key 'call'"),
        ("segments:\n  - {name: a, kind: Graph, call: a}\n", 4, "segments[0] 'a'.kind",
         "expected one of graph, eager, got str 'Graph' (did you mean 'graph'?)"),
        ("world_size: true\n", 3, "world_size", "expected an integer, got bool true"),
        ("capture: {verify: {atol: -1}}\n", 3, "capture.verify.atol", "expected a number >= 0, got -1"),
        ("capture: {barrier_timeout_s: 0}\n", 3, "capture.barrier_timeout_s", "expected a number > 0, got 0"),
        ("capture: {sizes: [1, 2.5]}\n", 3, "capture.sizes[1]", "expected an integer, got float 2.5"),
        ("symbols: {B: [1], H: 2}\ncapture: {sizes: H}\n", 4, "capture.sizes",
         "symbol 'H' is a constant; give it a list of sizes under symbols"),
        ("symbols: {B: [1]}\ncapture: {size_symbol: N}\n", 4, "capture.size_symbol",
         "size_symbol 'N' differs from 'B', the symbol listing the sizes"),
        ("symbols: {2B: 3}\n", 3, "symbols", "symbol names are identifiers (letters, digits and _), got '2B'"),
        ("buffers:\n  x: {shape: [B], dtype: f32, device: cpu}\n", 4, "buffers 'x'.dtype",
         "expected one of " + ", ".join(DTYPE_BYTES) + ", got str 'f32' (did you mean 'float32'?)"),
        ("buffers:\n  x: {shape: [-1], dtype: int8, device: cpu}\n", 4, "buffers 'x'.shape[0]",
         "expected an integer >= 1, got -1"),
        ("buffers:\n  x: {shape: [B], dtype: int8, device: cpu, values: [0]}\n", 4, "buffers 'x'.values",
         "expected two numbers [low, high), got 1 items"),
        ("buffers:\n  x: [1]\n", 4, "buffers 'x'",
         "expected a mapping with keys shape, dtype, device, role, capacity, alias_of, values, adopt, pad, got a list"),
        ("streams: [s0]\n", 3, "streams", "expected a mapping of stream names to their fields, got a list"),
        ("families: [a, a]\n", 3, "families", "duplicate family name 'a' (first declared at line 3)"),
        ("for_each: {i: [1, 1]}\n", 3, "for_each.i", "values repeat: the elements using it would be declared twice"),
        ("for_each: {i: \"range(0, 4, 0)\"}\n", 3, "for_each.i", "range() step must not be zero"),
        ("for_each: {i: [1.5]}\n", 3, "for_each.i", "template values are ints or strings, got float 1.5"),
        ("for_each: {i: [1]}\nstreams: {\"s{i}\": {device: \"cuda:{j}\"}}\n", 4, "streams 's{i}'.device",
         "unknown template variable 'j' in 'cuda:{j}' (declare it under for_each, or write {{ }} for literal braces)"),
        ("for_each: {i: [1], j: [2]}\nstreams: {\"s{i}\": {device: \"cuda:{j}\"}}\n", 4, "streams 's{i}'.device",
         "template variable 'j' used outside a templated element: 'cuda:{j}' is in 's{i}', whose name does not use {j}"),
        ("segments:\n  - {name: \"a}\", kind: graph, call: a}\n", 4, "segments[0] 'a}'.name",
         "unbalanced '}' in 'a}': write '}}' for a literal brace"),
        ("for_each: {i: \"range(10**9)\"}\n", 3, "for_each.i",
         "expected 'range(n)', 'range(a, b)', 'range(a, b, step)' or a list, got 'range(10**9)'"),
        ("for_each: {i: \"range(1000000)\"}\n", 3, "for_each.i", "range(1000000) has more than 100000 values"),
        ("for_each: {i: \"range(1000)\", j: \"range(1000)\"}\nsegments:\n  - {name: \"a{i}{j}\", kind: graph, call: a}\n",
         5, "segments[0] 'a{i}{j}'", "i x j expand to more than 100000 copies"),
        ("graphflow_unused: 0\n", 3, None, "unknown key 'graphflow_unused' (did you mean 'graphflow'?); known keys: "
         "graphflow, name, model, model_args, world_size, symbols, for_each, families, streams, buffers, channels, "
         "prewarm, segments, reference, capture"),
        ("symbols: [B]\n", 3, "symbols", "expected a mapping, got a list"),
        ("buffers:\n  x: {shape: [B], dtype: int8, device: cpu, capacity: 4}\n", 4, "buffers 'x'.capacity",
         "expected a mapping of symbols to the rows the buffer holds, got int 4"),
        ("model_args: [1]\n", 3, "model_args", "expected a mapping of factory arguments, got a list"),
        ("capture: {modes: [PIECEWISE], when: now}\n", 3, "capture",
         "unknown key 'when'; known keys: modes, sizes, size_symbol, warmup_iters, verify, barrier_timeout_s, compile, "
         "warmup"),
    ])
    def test_bad_field(self, body, line, element, message):
        error = load_error(plan_text(body))
        assert (error.file, error.line, error.element, error.message) == ("plans/t.yaml", line, element, message)

    def test_str_is_file_line_element_message(self):
        error = load_error(plan_text("segments:\n  - {name: \"L{i}.post\", kind: graph, call: a, writes: 5}\n"
                                     ).replace("name: t\n", "name: t\nfor_each: {i: [3]}\n"))
        assert str(error) == "plans/t.yaml:5: segments[0] 'L{i}.post'.writes: expected a list of buffer names, got int 5"

    def test_float_version_is_not_version_1(self):
        error = load_error("graphflow: 1.0\nname: t\n")
        assert (error.line, error.element, error.message) == (
            1, "graphflow", "unsupported format version 1.0: this graphflow reads version 1")

    @pytest.mark.parametrize(("text", "line", "message"), [
        ("graphflow: 1\nname: t\nstreams: {s0: {device: cpu}\nbuffers: {}\n", 3,
         "YAML syntax error in the flow mapping that starts on this line: did not find expected ',' or '}'"),
        ("graphflow: 1\nname: t\nsymbols: {B: [1, 2}\nbuffers: {}\n", 3,
         "YAML syntax error in the flow sequence that starts on this line: did not find expected ',' or ']'"),
        ("graphflow: 1\nname\nsymbols: {}\n", 2,
         "YAML syntax error in the simple key that starts on this line: could not find expected ':'"),
        ("graphflow: 1\nname: \"t\nsymbols: {}\n", 2,
         "YAML syntax error in the quoted scalar that starts on this line: found unexpected end of stream"),
        ("graphflow: 1\nname: t\nstreams:\n  s0: {device: cpu}\n s1: {device: cpu}\n", 5,
         "YAML syntax error: did not find expected key (while parsing a block mapping)"),
    ], ids=["flow mapping", "flow sequence", "key without colon", "quote", "indentation"])
    def test_a_yaml_syntax_error_names_one_line_the_one_to_fix(self, text, line, message):
        """The line of the mistake: where an unclosed bracket or quote, or a key missing
        its colon, starts (the parser notices only at the next line), else where it stopped
        (a block's indentation); the message names no other line."""
        error = load_error(text)
        assert (error.line, error.message) == (line, message)

    def test_duplicate_keys_are_rejected_at_every_level(self):
        error = load_error(plan_text("streams:\n  s0: {device: cpu, device: cuda:0}\n"))
        assert (error.line, error.message) == (4, "duplicate key 'device' (first at line 4)")

    def test_duplicate_names_after_expansion(self):
        error = load_error(plan_text("for_each: {i: [0, 1]}\nstreams:\n  s1: {device: cpu}\n  \"s{i}\": {device: cpu}\n"))
        assert (error.line, error.element, error.message) == (
            6, "streams 's{i}'", "duplicate stream name 's1' (first declared at line 5)")

    def test_no_code_is_evaluated_from_for_each(self, tmp_path):
        marker = tmp_path / "pwned"
        error = load_error(plan_text(f"for_each: {{i: \"__import__('os').mkdir('{marker}')\"}}\n"))
        assert error.element == "for_each.i" and not marker.exists()

    def test_python_tags_are_never_constructed(self):
        error = load_error(plan_text("model_args: {x: !!python/object/apply:os.getcwd []}\n"))
        assert (error.line, error.message) == (
            3, "unsupported YAML collection tagged tag:yaml.org,2002:python/object/apply:os.getcwd")

    def test_exponential_aliases_are_refused(self):
        lines = ["graphflow: 1", "name: t", "model_args:", "  a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
        lines += [f"  a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 8)]
        error = load_error("\n".join(lines) + "\n")
        assert error.message == "YAML aliases expand too far (recursive or exponential anchors)"

    def test_missing_file_names_the_file(self, tmp_path):
        path = tmp_path / "absent.yaml"
        with pytest.raises(PlanError) as info:
            load_plan(path)
        assert (info.value.file, info.value.line) == (str(path), None)
        assert info.value.message == "cannot read plan file: No such file or directory"

    def test_non_utf8_names_the_line(self, tmp_path):
        path = tmp_path / "latin1.yaml"
        path.write_bytes("graphflow: 1\nname: caf\xe9\n".encode("latin-1"))
        with pytest.raises(PlanError) as info:
            load_plan(path)
        assert (info.value.line, info.value.message) == (2, "not UTF-8: byte 0xe9 cannot be decoded")

    def test_control_characters_name_the_line(self):
        error = load_error("graphflow: 1\nname: a\x07\n")
        assert error.line == 2 and error.message.startswith("unacceptable character U+0007: ")


class TestDump:
    def test_writes_the_expanded_plan_in_the_documented_layout(self):
        text = dump_plan(loads_plan(BRIEF_EXAMPLE))
        lines = text.splitlines()
        assert "for_each" not in text and "{layer}" not in text
        assert lines[:6] == ["graphflow: 1", "name: dsv4-mini-decode", "model: graphflow.integrations.dsv4:build_model",
                             "symbols: {B: [1, 2, 4, 8, 16, 32]}", "families: [target]", "streams:"]
        assert "- {name: L0.pre, kind: graph, call: layers.0.pre_attention, reads: [x], writes: [q0, kv0], " \
               "stream: s0}" in lines
        assert lines[-6:] == ["capture:", "  modes: [PIECEWISE]", "  sizes: B", "  warmup_iters: 2",
                              "  verify: {atol: 0.0, rtol: 0.0}", "  barrier_timeout_s: 60.0"]
        assert [k for k in plan_to_dict(loads_plan(BRIEF_EXAMPLE))] == [
            "graphflow", "name", "model", "symbols", "families", "streams", "buffers", "channels", "segments",
            "capture"]

    @pytest.mark.parametrize("name", ["a{b}", "{{x}}", "{", "}", "null", "1", "", "true", "x: y", "- a", "#c",
                                      "it's", "é\u2028ü", "a\nb", " sp ", "*a", "&b", "!t", "%", "@", '"q"',
                                      "0x10", "~", "yes", "<<", "1e3", ".inf"])
    def test_round_trips_names_that_need_quoting_or_escaping(self, name):
        # Every free string field holds the name; devices must be spelled as devices.
        plan = Plan(
            name=name,
            buffers=[Buffer(name, ("B", "2*B", 3), "float32", "cuda:3", BufferRole.STATE, {"B": 4}, name, (0, 1.5))],
            streams=[Stream(name, "cpu")],
            channels=[Channel(name, ChannelKind.P2P, name, -3, name, WarmupPolicy.PREPARE, name, True)],
            segments=[Segment(name, SegmentKind.EAGER, name, (name,), (name,), name, (name,), name, True, "cuda:1",
                              (), (name,))],
            families=[Family(name)],
            prewarm=[Prewarm(name, name, False)],
            symbols={"H": 3},
            capture=CaptureSettings((), (), "C", 1, 1e-5, 0.5, 1e300),
            model_args={"k{": [1, {"n": None, "s": name}]},
            world_size=3,
        )
        assert loads_plan(dump_plan(plan)) == plan

    def test_size_symbol_that_is_also_a_constant_dumps_explicit_sizes(self):
        plan = Plan("p", symbols={"N": 3}, capture=CaptureSettings(sizes=(4, 2), size_symbol="N"))
        data = plan_to_dict(plan)
        assert data["symbols"] == {"N": 3}
        assert (data["capture"]["sizes"], data["capture"]["size_symbol"]) == ([4, 2], "N")
        assert loads_plan(dump_plan(plan)) == plan

    def test_empty_families_and_empty_tuples_round_trip(self):
        plan = Plan("p", families=(), segments=[Segment("s", SegmentKind.GRAPH, "f", ranks=())],
                    capture=CaptureSettings(modes=(), sizes=()))
        assert loads_plan(dump_plan(plan)) == plan


class TestModeSizes:
    """``capture.sizes`` as a mapping: each mode captures its own sizes (vLLM's FULL decode cap)."""

    TEXT = plan_text("""\
        symbols: {B: [1, 2, 4, 8]}
        capture:
          modes: [PIECEWISE, FULL]
          sizes: {PIECEWISE: B, FULL: [1, 2]}
        """)

    def test_each_mode_gets_its_own_sizes_and_buffers_the_largest(self):
        plan = loads_plan(self.TEXT)
        assert plan.capture.sizes_for(Mode.PIECEWISE) == (1, 2, 4, 8)
        assert plan.capture.sizes_for(Mode.FULL) == (1, 2)
        assert plan.capture.all_sizes == (1, 2, 4, 8) and plan.max_size == 8
        assert [str(d) for d in plan.descriptors()] == [
            "PIECEWISE(B=8)", "PIECEWISE(B=4)", "PIECEWISE(B=2)", "PIECEWISE(B=1)", "FULL(B=2)", "FULL(B=1)"]

    def test_round_trips_and_writes_the_mapping(self):
        plan = loads_plan(self.TEXT)
        assert plan_to_dict(plan)["capture"]["sizes"] == {"PIECEWISE": "B", "FULL": [1, 2]}
        assert loads_plan(dump_plan(plan)) == plan

    def test_an_override_from_python_round_trips(self):
        settings = CaptureSettings(modes=(Mode.PIECEWISE, Mode.FULL), sizes=(1, 2, 4), mode_sizes={Mode.FULL: (1,)})
        plan = Plan("p", capture=settings)
        assert loads_plan(dump_plan(plan)) == plan
        assert CaptureSettings(sizes=(1, 2), mode_sizes={Mode.PIECEWISE: (1, 2)}) == CaptureSettings(sizes=(1, 2))

    def test_a_captured_mode_without_sizes_is_an_error_at_its_line(self):
        err = load_error(self.TEXT.replace(", FULL: [1, 2]", ""))
        assert (err.line, err.element) == (6, "capture.sizes")
        assert "capture.modes lists FULL but capture.sizes gives it no sizes" in err.message

    def test_an_unknown_mode_is_named_with_a_suggestion(self):
        err = load_error(self.TEXT.replace("FULL: [1, 2]", "FUL: [1, 2]"))
        assert err.line == 6 and "unknown key 'FUL' (did you mean 'FULL'?)" in err.message

    def test_the_schema_accepts_the_mapping(self):
        jsonschema.validate(yaml.safe_load(self.TEXT), SCHEMA)


def _expectation(path: pathlib.Path) -> tuple[int, str, bool]:
    header = path.read_bytes().split(b"\n", 2)
    match = re.fullmatch(r"# expect: line (\d+): (.+)", header[0].decode())
    assert match, f"{path.name}: first line must be '# expect: line N: message fragment'"
    return int(match.group(1)), match.group(2), header[1] == b"# schema: invalid"


class TestMalformedCorpus:
    def test_corpus_has_at_least_twenty_files(self):
        assert len(MALFORMED) >= 20

    @pytest.mark.parametrize("path", MALFORMED, ids=lambda p: p.stem)
    def test_raises_plan_error_at_the_expected_line(self, path):
        line, fragment, _ = _expectation(path)
        with pytest.raises(PlanError) as info:
            load_plan(path)
        assert (info.value.file, info.value.line) == (str(path), line)
        assert fragment in str(info.value)

    def test_cli_validate_prints_one_line_each_and_exits_2(self):
        """One process for the whole corpus, as ``graphflow validate plans/*.yaml`` runs:
        a line per file, each naming its file and line, and nothing else."""
        result = subprocess.run([sys.executable, "-m", "graphflow", "validate", *map(str, MALFORMED)], cwd=ROOT,
                                env={"PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2, result.stderr
        assert "Traceback" not in result.stderr and result.stdout == ""
        lines = result.stderr.splitlines()
        assert len(lines) == len(MALFORMED), result.stderr
        for path, said in zip(MALFORMED, lines):
            line, fragment, _ = _expectation(path)
            assert said.startswith(f"graphflow: {path}:{line}:") and fragment in said, said

    @pytest.mark.parametrize("path", [p for p in MALFORMED if _expectation(p)[2]], ids=lambda p: p.stem)
    def test_schema_rejects_what_it_can_express(self, path):
        data = yaml.safe_load(path.read_text())
        assert list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(data))


class TestSchema:
    def test_is_a_valid_draft_2020_12_schema(self):
        jsonschema.Draft202012Validator.check_schema(SCHEMA)

    def test_the_committed_file_is_generated_from_the_plan_classes(self):
        from graphflow.plan.schema import schema_json

        committed = (ROOT / "graphflow" / "plan" / "schema" / "plan.schema.json").read_text()
        assert committed == schema_json(), "regenerate: python -m graphflow.plan.schema > graphflow/schema/plan.schema.json"

    def test_python_m_graphflow_schema_prints_it(self):
        result = subprocess.run([sys.executable, "-m", "graphflow.plan.schema"], cwd=ROOT, env={"PYTHONPATH": str(ROOT)},
                                capture_output=True, text=True, check=True)
        assert json.loads(result.stdout) == SCHEMA

    @pytest.mark.parametrize("path", PLANS, ids=lambda p: p.stem)
    def test_bundled_plans_validate_and_load(self, path):
        jsonschema.validate(yaml.safe_load(path.read_text()), SCHEMA)
        assert load_plan(path).name

    def test_keys_match_the_loader(self):
        from graphflow.plan import loader

        defs = SCHEMA["$defs"]
        assert tuple(SCHEMA["properties"]) == loader._TOP_KEYS
        for key, names in (("buffer", "shape dtype device role capacity alias_of values adopt pad"), ("stream", "device"),
                           ("channel", "kind group id family warmup prewarm jit"), ("prewarm", "call per_size"),
                           ("segment", "name kind call reads writes stream channels family data_dependent device "
                                       "ranks after kernels inputs objects constants returns breaks compile"),
                           ("reference", "call inputs objects constants returns"),
                           ("capture", "modes sizes size_symbol warmup_iters verify barrier_timeout_s compile warmup"),
                           ("compile", "enabled backend mode dynamic fullgraph strict options")):
            assert tuple(defs[key]["properties"]) == tuple(names.split()), key
        assert defs["buffer"]["required"] == ["shape", "dtype", "device"]
        assert defs["channel"]["required"] == ["kind", "group", "id", "family"]
        assert defs["segment"]["required"] == ["name", "kind", "call"]

    def test_enums_match_the_plan_model(self):
        defs = SCHEMA["$defs"]

        def choices(schema):
            return next(option["enum"] for option in schema["anyOf"] if "enum" in option)

        assert choices(defs["buffer"]["properties"]["dtype"]) == list(DTYPE_BYTES)
        assert choices(defs["buffer"]["properties"]["role"]) == [r.value for r in BufferRole]
        assert choices(defs["channel"]["properties"]["kind"]) == [k.value for k in ChannelKind]
        assert choices(defs["channel"]["properties"]["warmup"]) == [w.value for w in WarmupPolicy]
        assert choices(defs["segment"]["properties"]["kind"]) == [k.value for k in SegmentKind]
        assert defs["capture"]["properties"]["modes"]["items"]["enum"] == [m.value for m in Mode]

    @pytest.mark.parametrize("body, fragment", [
        ("capture: {warmup_iters: 0}\n", "0 is less than the minimum of 1"),
        ("buffers:\n  x: {shape: [B, 0], dtype: int8, device: cpu}\n", "0 is not valid under any"),
        ("buffers:\n  x: {shape: [B], dtype: int8, device: cuda}\n", "'cuda' is not valid under any"),
        ("symbols: {H: 0}\n", "0 is not valid under any"),
    ])
    def test_ranges_the_classes_enforce_are_in_the_schema(self, body, fragment):
        errors = list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(yaml.safe_load(plan_text(body))))
        assert errors and any(fragment in e.message for e in errors), [e.message for e in errors]

    def test_a_templated_device_or_dtype_is_left_to_the_loader(self):
        text = plan_text("""
            for_each: {i: "range(2)"}
            buffers:
              "x{i}": {shape: [B], dtype: "{i}", device: "cuda:{i}"}
        """)
        jsonschema.validate(yaml.safe_load(text), SCHEMA)

    def test_dumped_plans_validate(self):
        jsonschema.validate(yaml.safe_load(dump_plan(loads_plan(BRIEF_EXAMPLE))), SCHEMA)


class TestDocs:
    def test_the_documented_example_loads_and_validates_against_the_schema(self):
        text = (ROOT / "docs" / "plan-format.md").read_text()
        example = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
        jsonschema.validate(yaml.safe_load(example), SCHEMA)
        plan = loads_plan(example)
        assert [s.name for s in plan.segments] == [
            "L0.pre", "L0.attn", "L1.pre", "L1.attn", "L2.pre", "L2.attn", "L3.pre", "L3.attn", "head"]
        assert (plan.symbols, plan.capture.sizes) == ({"H": 8}, (1, 2, 4, 8))


class TestRealModelFields:
    """Keyword calls, breaks, adopted and padded buffers, the reference, and ``{*var}`` items."""

    HF = """
        symbols: {B: [1, 2]}
        for_each: {layer: "range(2)"}
        buffers:
          tokens: {shape: [B, 1], dtype: int64, device: "cuda:0", role: input, values: [0, 9], pad: 3}
          logits: {shape: [B, 9], dtype: float32, device: "cuda:0", role: output}
          "k{layer}": {shape: [B, 4], dtype: float32, device: "cuda:0", role: state, pad: keep,
                       adopt: "cache.layers.{layer}.keys"}
        segments:
          - {name: decode, kind: graph, call: forward, inputs: {input_ids: tokens},
             objects: {past_key_values: cache}, constants: {use_cache: true, window: [1, 2]},
             returns: [logits], reads: ["k{*layer}"], writes: ["k{*layer}"], breaks: [model.layers.*.self_attn]}
        reference: {call: forward, inputs: {input_ids: tokens}, returns: [logits]}
    """

    def test_every_field_reads_into_the_plan(self):
        plan = loads_plan(plan_text(self.HF))
        decode = plan.segment("decode")
        assert decode.reads == ("k0", "k1", "tokens")  # an input passed by keyword is a read
        assert decode.writes == ("k0", "k1", "logits")  # a returned buffer is a write
        assert (decode.inputs, decode.objects) == ({"input_ids": "tokens"}, {"past_key_values": "cache"})
        assert decode.constants == {"use_cache": True, "window": [1, 2]}
        assert (decode.returns, decode.breaks) == (("logits",), ("model.layers.*.self_attn",))
        assert plan.buffer("k1").adopt == "cache.layers.1.keys" and plan.buffer("k1").pad == "keep"
        assert plan.buffer("tokens").pad == 3.0
        assert plan.reference == Reference("forward", inputs={"input_ids": "tokens"}, returns=("logits",))

    def test_they_round_trip_and_match_the_schema(self):
        plan = loads_plan(plan_text(self.HF))
        assert loads_plan(dump_plan(plan)) == plan
        jsonschema.validate(yaml.safe_load(plan_text(self.HF)), SCHEMA)

    @pytest.mark.parametrize("body, line, element, message", [
        ('buffers: {x: {shape: [B], dtype: int8, device: cpu, pad: kept}}\n', 3, "buffers 'x'.pad",
         "expected a number or one of keep, got str 'kept'"),
        ('segments:\n  - {name: a, kind: graph, call: a, inputs: {1x: y}}\n', 4, "segments[0] 'a'.inputs",
         "expected a keyword argument name as a key, got '1x'"),
        ('segments:\n  - {name: a, kind: graph, call: a, breaks: ["layers[0]"]}\n', 4, "segments[0] 'a'.breaks[0]",
         "expected a submodule path such as model.layers.*.self_attn, got 'layers[0]'"),
        ('for_each: {i: "range(2)"}\nsegments:\n  - {name: a, kind: graph, call: "f{*i}"}\n', 5,
         "segments[0] 'a'.call", "'f{*i}' uses {*var}, which makes one list item per value: use it as an item of a "
                                "list (reads, writes, returns...)"),
        ('for_each: {i: "range(2)"}\nsegments:\n  - {name: "a{i}", kind: graph, call: a, reads: ["x{*i}"]}\n', 5,
         "segments[0] 'a{i}'.reads", "'x{*i}' uses {*i} in an element that i already expands: write {i} for this "
                                     "element's own value"),
        ('segments:\n  - {name: a, kind: graph, call: a, reads: ["x{*j}"]}\n', 4, "segments[0] 'a'.reads",
         "unknown template variable 'j' in 'x{*j}' (declare it under for_each, or write {{ }} for literal braces)"),
        ('reference: {inputs: {x: x}}\n', 3, "reference", "missing required key 'call'"),
    ])
    def test_bad_values_name_their_line(self, body, line, element, message):
        error = load_error(plan_text(body))
        assert (error.line, error.element, error.message) == (line, element, message)

    def test_each_item_expands_in_for_each_order_beside_the_elements_own_value(self):
        plan = loads_plan(plan_text("""
            for_each: {i: "range(2)", j: [a, b]}
            segments:
              - {name: "s{i}", kind: graph, call: f, reads: ["x{i}{*j}", "y"]}
              - {name: head, kind: graph, call: h, reads: ["x{*i}{*j}"]}
        """))
        assert plan.segment("s1").reads == ("x1a", "x1b", "y")
        assert plan.segment("head").reads == ("x0a", "x0b", "x1a", "x1b")
