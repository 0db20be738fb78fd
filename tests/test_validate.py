"""The validator's rules, one class per rule: a plan each must flag, and a near-identical
plan it must not.

Plans are built with the attrs classes directly. ``base()`` is the BRIEF's example step
for two layers (pre graph, eager attention, post graph with a TP all-reduce and MoE
routing, head); it validates clean, and each test changes one thing.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from graphflow.plan.loader import loads_plan
from graphflow.plan import (
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
from graphflow.plan.rules import RETIRED, RULES, Diagnostic, Report, Severity, rules_markdown, validate

ROOT = Path(__file__).resolve().parent.parent


def buf(name, shape=("B", 64), *, role=BufferRole.INTERNAL, device="cuda:0", dtype="bfloat16", **kw) -> Buffer:
    return Buffer(name, shape, dtype, device, role=role, **kw)


def graph(name, reads=(), writes=(), *, stream="s0", **kw) -> Segment:
    return Segment(name, SegmentKind.GRAPH, f"model.{name}", reads=reads, writes=writes, stream=stream, **kw)


def eager(name, reads=(), writes=(), **kw) -> Segment:
    return Segment(name, SegmentKind.EAGER, f"model.{name}", reads=reads, writes=writes, **kw)


TP_AR = Channel("tp_ar", ChannelKind.ALL_REDUCE, "tp", 1, "target")


def base(**changes) -> Plan:
    segments = []
    for layer in range(2):
        segments += [
            graph(f"L{layer}.pre", reads=["x"], writes=[f"q{layer}"]),
            eager(f"L{layer}.attn", reads=[f"q{layer}"], writes=[f"o{layer}"]),
            graph(f"L{layer}.post", reads=[f"o{layer}", "x"], writes=["x"], channels=["tp_ar"], data_dependent=True),
        ]
    segments.append(graph("head", reads=["x"], writes=["logits"]))
    plan = Plan(
        name="mini",
        buffers=[buf("x", role=BufferRole.INPUT), *(buf(f"{k}{i}") for i in range(2) for k in "qo"),
                 buf("logits", ("B", 100), role=BufferRole.OUTPUT, dtype="float32")],
        streams=[Stream("s0", "cuda:0")],
        channels=[TP_AR],
        segments=segments,
        capture=CaptureSettings(modes=[Mode.PIECEWISE], sizes=[1, 2, 4]),
        world_size=2,
    )
    return attrs.evolve(plan, **changes)


def replace_segment(plan: Plan, name: str, **changes) -> Plan:
    return attrs.evolve(plan, segments=[attrs.evolve(s, **changes) if s.name == name else s for s in plan.segments])


def replace_buffer(plan: Plan, name: str, **changes) -> Plan:
    return attrs.evolve(plan, buffers=[attrs.evolve(b, **changes) if b.name == name else b for b in plan.buffers])


def replace_capture(plan: Plan, **changes) -> Plan:
    return attrs.evolve(plan, capture=attrs.evolve(plan.capture, **changes))


def insert_after(plan: Plan, name: str, *segments: Segment) -> Plan:
    index = [s.name for s in plan.segments].index(name) + 1
    return attrs.evolve(plan, segments=[*plan.segments[:index], *segments, *plan.segments[index:]])


def found(plan: Plan, code: str) -> list[Diagnostic]:
    return [d for d in validate(plan).diagnostics if d.code == code]


def only(plan: Plan, code: str) -> Diagnostic:
    diagnostics = found(plan, code)
    assert len(diagnostics) == 1, diagnostics
    return diagnostics[0]


def test_base_plan_is_clean():
    assert validate(base()).diagnostics == ()


# -- the table and the report ------------------------------------------------------------------


class TestRuleTable:
    def test_codes_are_unique_and_ordered(self):
        codes = [rule.code for rule in RULES]
        assert codes == sorted(set(codes))

    def test_every_rule_documents_what_it_prevents_and_the_fix(self):
        for rule in RULES:
            assert rule.prevents and rule.how_to_fix, rule.code
            assert rule.doc == rule.check.__doc__.strip().replace("\n    ", "\n"), rule.code

    def test_docs_rules_md_is_generated_from_the_table(self):
        assert (ROOT / "docs" / "rules.md").read_text() == rules_markdown()

    def test_markdown_has_one_row_per_rule(self):
        rows = [line for line in rules_markdown().splitlines() if line.startswith("| GF")]
        assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [rule.code for rule in RULES]

    def test_rule_check_yields_diagnostics_with_its_code_and_severity(self):
        rule = next(r for r in RULES if r.code == "GF401")
        [diagnostic] = rule.check(replace_segment(base(), "head", stream=None))
        assert (diagnostic.code, diagnostic.severity, diagnostic.element) == ("GF401", Severity.ERROR, "segment head")


class TestReport:
    def test_diagnostic_str_names_code_severity_element_message_and_fix(self):
        d = Diagnostic("GF201", Severity.ERROR, "segment L3.pre", "'q' is read early", "declare it")
        assert str(d) == "GF201 error segment L3.pre: 'q' is read early — declare it"

    def test_diagnostic_str_starts_with_file_and_line_when_known(self):
        d = Diagnostic("GF602", Severity.WARNING, "capture", "sizes unsorted", None, Origin("p.yaml", 7))
        assert str(d) == "p.yaml:7: GF602 warning capture: sizes unsorted"

    def test_diagnostics_are_sorted_by_origin_line_then_code(self):
        plan = replace_segment(base(), "head", stream=None, reads=["x", "nope"])
        plan = attrs.evolve(plan, origins={"segment:head": Origin("p.yaml", 3), "segment:L0.pre": Origin("p.yaml", 9)})
        plan = replace_segment(plan, "L0.pre", stream="ghost")
        report = validate(plan)
        assert [(d.origin.line, d.code) for d in report.diagnostics] == [(3, "GF101"), (3, "GF401"), (9, "GF102")]

    def test_errors_warnings_and_ok(self):
        plan = replace_capture(base(), sizes=[4, 2, 1])
        report = validate(plan)
        assert report.ok and [d.code for d in report.warnings] == ["GF602"] and report.errors == ()
        broken = validate(replace_segment(plan, "head", stream=None))
        assert not broken.ok and [d.code for d in broken.errors] == ["GF401"]

    def test_to_json(self):
        plan = attrs.evolve(replace_segment(base(), "head", stream=None), origins={"segment:head": Origin("p.yaml", 4)})
        assert validate(plan).to_json() == {
            "plan": "mini", "ok": False, "errors": 1, "warnings": 0,
            "diagnostics": [{"code": "GF401", "severity": "error", "element": "segment head",
                             "message": "graph segment head has no stream", "fix": "add `stream: s0`",
                             "file": "p.yaml", "line": 4}],
        }

    def test_disable_skips_a_rule(self):
        plan = replace_segment(base(), "head", stream=None)
        assert validate(plan, disable=["GF401"]).diagnostics == ()

    def test_disable_rejects_an_unknown_code(self):
        with pytest.raises(ValueError, match="unknown rule code.*GF999"):
            validate(base(), disable=["GF999"])

    def test_report_is_frozen(self):
        assert isinstance(validate(base()), Report)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            validate(base()).plan_name = "other"

    def test_origin_comes_from_the_loaded_yaml(self):
        text = (
            "graphflow: 1\nname: tiny\nsymbols: {B: [1, 2]}\nstreams:\n  s0: {device: cuda:0}\n"
            "buffers:\n  x: {shape: [B, 8], dtype: float32, device: cuda:0, role: input}\n"
            "  y: {shape: [B, 8], dtype: float32, device: cuda:0, role: output}\n"
            "segments:\n  - {name: a, kind: graph, call: a, reads: [x], writes: [y]}\n"
            "capture:\n  modes: [PIECEWISE]\n  sizes: B\n"
        )
        unused, missing = validate(loads_plan(text, file="tiny.yaml")).diagnostics  # sorted by line
        assert str(unused) == "tiny.yaml:5: GF404 warning stream s0: stream s0 is used by no segment — name it in a " \
                              "segment's stream, or remove it"
        assert str(missing) == "tiny.yaml:10: GF401 error segment a: graph segment a has no stream — add `stream: s0`"


# -- structure ---------------------------------------------------------------------------------


class TestUndeclaredBuffer:
    def test_flags_a_read_of_an_undeclared_buffer(self):
        d = only(replace_segment(base(), "L1.pre", reads=["x1"]), "GF101")
        assert d.element == "segment L1.pre"
        assert d.message == "'x1' is read by graph segment L1.pre but no buffer 'x1' is declared"

    def test_flags_an_alias_of_an_undeclared_buffer(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("v", alias_of="ghost")])
        d = only(plan, "GF101")
        assert d.element == "buffer v" and "alias of 'ghost'" in d.message

    def test_declared_names_pass(self):
        assert found(base(), "GF101") == []


class TestUndeclaredStream:
    def test_flags_an_undeclared_stream(self):
        d = only(replace_segment(base(), "head", stream="s9"), "GF102")
        assert d.element == "segment head" and "stream 's9', which is not declared" in d.message

    def test_declared_stream_passes(self):
        plan = replace_segment(base(), "head", stream="s9")
        plan = attrs.evolve(plan, streams=[Stream("s0", "cuda:0"), Stream("s9", "cuda:0")])
        assert validate(plan).diagnostics == ()


class TestUndeclaredChannel:
    def test_flags_an_undeclared_channel(self):
        d = only(replace_segment(base(), "L0.post", channels=["tp_arr"]), "GF103")
        assert d.element == "segment L0.post" and "channel 'tp_arr', which is not declared" in d.message

    def test_declared_channel_passes(self):
        assert found(base(), "GF103") == []


class TestDuplicateNames:
    def test_flags_a_duplicate_segment(self):
        plan = attrs.evolve(base(), segments=[*base().segments, graph("head", reads=["x"], writes=["logits"])])
        d = only(plan, "GF104")
        assert d.element == "segment head" and d.message == "segment 'head' is declared 2 times"

    def test_flags_a_duplicate_buffer(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("q0")])
        assert only(plan, "GF104").element == "buffer q0"

    def test_distinct_names_pass(self):
        assert found(base(), "GF104") == []


class TestCycle:
    def test_flags_an_after_edge_that_closes_a_data_cycle(self):
        d = only(replace_segment(base(), "L0.pre", after=["L0.post"]), "GF105")
        assert d.element == "segment L0.pre"
        assert d.message.startswith("segments L0.pre -> ") and d.message.endswith(" -> L0.pre form a cycle")
        assert found(replace_segment(base(), "L0.pre", after=["L0.post"]), "GF110") == []

    def test_flags_a_segment_after_itself(self):
        d = only(replace_segment(base(), "head", after=["head"]), "GF105")
        assert d.message == "graph segment head is declared after itself"

    def test_after_an_earlier_segment_passes(self):
        assert validate(replace_segment(base(), "head", after=["L0.pre"])).diagnostics == ()


class TestBadShape:
    def test_flags_an_unknown_symbol(self):
        d = only(replace_buffer(base(), "q0", shape=("B", "2*H")), "GF106")
        assert d.element == "buffer q0"
        assert d.message == "buffer 'q0' shape ['B', '2*H']: dimension 1 ('2*H') uses unknown symbol H"
        assert d.fix == "declare it under symbols, or use a declared symbol (B)"

    def test_declared_symbols_and_products_pass(self):
        plan = attrs.evolve(replace_buffer(base(), "q0", shape=("2*B", "H")), symbols={"H": 8})
        assert validate(plan).diagnostics == ()


class TestUndeclaredFamily:
    def test_flags_a_segment_of_an_undeclared_family(self):
        plan = replace_segment(base(), "head", family="draft")
        d = only(plan, "GF107")
        assert d.element == "segment head" and "family 'draft', which is not declared" in d.message

    def test_flags_a_channel_of_an_undeclared_family(self):
        plan = attrs.evolve(base(), channels=[attrs.evolve(TP_AR, family="draft")])
        assert only(plan, "GF107").element == "channel tp_ar"

    def test_declared_family_passes(self):
        plan = replace_segment(base(), "head", family="draft")
        plan = attrs.evolve(plan, families=[Family("target"), Family("draft")])
        assert found(plan, "GF107") == []


class TestUndeclaredPrewarm:
    def test_flags_an_undeclared_hook(self):
        plan = attrs.evolve(base(), channels=[attrs.evolve(TP_AR, prewarm="warm_ar")])
        d = only(plan, "GF108")
        assert d.element == "channel tp_ar" and "prewarm hook 'warm_ar', which is not declared" in d.message

    def test_declared_hook_passes(self):
        plan = attrs.evolve(base(), channels=[attrs.evolve(TP_AR, prewarm="warm_ar")],
                            prewarm=[Prewarm("warm_ar", "ar.prepare")])
        assert validate(plan).diagnostics == ()


class TestUnknownAfter:
    def test_flags_after_naming_no_segment(self):
        d = only(replace_segment(base(), "head", after=["L9.post"]), "GF109")
        assert d.element == "segment head" and "after 'L9.post', which is not a segment" in d.message

    def test_after_naming_a_segment_passes(self):
        assert found(replace_segment(base(), "head", after=["L1.post"]), "GF109") == []


class TestAfterOrder:
    def test_flags_after_naming_a_later_independent_segment(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("z", role=BufferRole.OUTPUT)],
                            segments=[*base().segments, graph("tail", writes=["z"])])
        d = only(replace_segment(plan, "L0.attn", after=["tail"]), "GF110")
        assert d.element == "segment L0.attn"
        assert d.message == "eager segment L0.attn is declared after tail, which is listed below it"

    def test_after_naming_an_earlier_segment_passes(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("z", role=BufferRole.OUTPUT)],
                            segments=[*base().segments, graph("tail", writes=["z"], after=["L0.attn"])])
        assert validate(plan).diagnostics == ()


class TestStreamOnTheCpu:
    def test_flags_a_stream_on_the_cpu(self):
        plan = attrs.evolve(base(), streams=[Stream("s0", "cpu")])
        d = only(plan, "GF112")
        assert (d.element, d.message) == ("stream s0", "stream s0 has device 'cpu'")

    def test_a_stream_on_a_gpu_passes(self):
        assert validate(replace_segment(base(), "head", device="cuda:0")).diagnostics == ()


class TestBadRanks:
    def test_flags_a_rank_outside_the_world(self):
        d = only(replace_segment(base(), "head", ranks=[2]), "GF113")
        assert d.element == "segment head" and "runs on rank(s) 2 but world_size is 2" in d.message

    def test_flags_an_empty_rank_list(self):
        assert "runs on no rank" in only(replace_segment(base(), "head", ranks=[]), "GF113").message

    def test_ranks_inside_the_world_pass(self):
        assert found(replace_segment(base(), "head", ranks=[0, 1]), "GF113") == []


# -- dataflow ----------------------------------------------------------------------------------


class TestReadBeforeWrite:
    def test_flags_a_read_of_an_internal_buffer_nothing_wrote(self):
        plan = replace_segment(base(), "L0.pre", reads=["x", "o1"])
        d = only(plan, "GF201")
        assert d.element == "segment L0.pre"
        assert d.message == "'o1' is read by graph segment L0.pre before any segment writes it"
        assert d.fix == "write it in an earlier segment or declare role: input (or state)"

    def test_flags_a_read_of_a_buffer_written_only_on_another_rank(self):
        d = only(replace_segment(base(), "L0.pre", ranks=[0]), "GF201")
        assert d.element == "segment L0.attn" and d.message.endswith("before any segment writes it on rank(s) 1")

    def test_state_buffer_may_be_read_first(self):
        plan = replace_buffer(replace_segment(base(), "L0.pre", reads=["x", "o1"]), "o1", role=BufferRole.STATE)
        assert found(plan, "GF201") == []

    def test_read_through_an_alias_of_a_written_buffer_passes(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("q0v", alias_of="q0")])
        plan = replace_segment(plan, "L0.attn", reads=["q0v"])
        assert validate(plan).diagnostics == ()


class TestUnorderedWriters:
    def test_flags_two_writers_with_no_path_between_them(self):
        plan = insert_after(base(), "head", graph("tail", reads=["q1"], writes=["logits"]))
        d = only(plan, "GF202")
        assert d.element == "segment tail"
        assert d.message == ("'logits' is written by graph segment head and graph segment tail "
                             "with no order between them")
        assert d.fix == "make tail read 'logits', add `after: [head]`, or write separate buffers"

    def test_in_place_update_orders_writers(self):
        assert found(insert_after(base(), "head", graph("tail", reads=["logits"], writes=["logits"])), "GF202") == []

    def test_write_after_read_orders_writers(self):
        plan = replace_segment(base(), "L1.post", reads=["o1"])  # L1.pre read x after L0.post wrote it
        assert found(plan, "GF202") == []

    def test_after_orders_writers(self):
        plan = insert_after(base(), "head", graph("tail", reads=["q1"], writes=["logits"], after=["head"]))
        assert validate(plan).diagnostics == ()

    def test_writers_on_disjoint_ranks_pass(self):
        plan = insert_after(replace_segment(base(), "head", ranks=[0]), "head",
                            graph("tail", reads=["q1"], writes=["logits"], ranks=[1]))
        assert validate(plan).diagnostics == ()


class TestUnreadOutputs:
    def test_warns_on_a_graph_output_nothing_reads(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("stats")])
        plan = replace_segment(plan, "head", writes=["logits", "stats"])
        d = only(plan, "GF203")
        assert d.severity is Severity.WARNING and d.element == "segment head"
        assert d.message == "'stats' written by graph segment head is not read before the step ends"

    def test_warns_on_a_version_overwritten_before_it_is_read(self):
        plan = replace_segment(base(), "L1.attn", writes=["o0"])
        plan = replace_segment(plan, "L0.pre", writes=["q0", "o0"])
        d = only(plan, "GF203")
        assert d.message == "'o0' written by graph segment L0.pre is not read before overwritten"

    def test_output_role_passes(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("stats", role=BufferRole.OUTPUT)])
        assert validate(replace_segment(plan, "head", writes=["logits", "stats"])).diagnostics == ()

    def test_eager_output_nothing_reads_passes(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("stats")])
        assert found(replace_segment(plan, "L0.attn", writes=["o0", "stats"]), "GF203") == []


class TestBadAlias:
    def test_flags_an_alias_larger_than_its_target(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("wide", ("B", 128), alias_of="q0")])
        d = only(plan, "GF204")
        assert d.element == "buffer wide"
        assert d.message == "alias 'wide' (1024 bytes) is larger than its target 'q0' (512 bytes)"

    def test_flags_writes_through_two_names(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("q0v", alias_of="q0")])
        plan = replace_segment(plan, "L0.attn", reads=["q0"], writes=["o0", "q0v"])
        d = only(plan, "GF204")
        assert d.element == "buffer q0" and "written through 'q0' (by L0.pre), 'q0v' (by L0.attn)" in d.message

    def test_flags_an_alias_cycle(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("a", alias_of="b"), buf("b", alias_of="a")])
        assert [d.message for d in found(plan, "GF204")] == ["buffer 'a' is an alias of itself: a -> b -> a",
                                                             "buffer 'b' is an alias of itself: b -> a -> b"]

    def test_smaller_alias_read_through_its_name_passes(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("half", ("B", 32), alias_of="q0")])
        assert validate(replace_segment(plan, "L0.attn", reads=["q0", "half"])).diagnostics == ()


# -- allocation --------------------------------------------------------------------------------


class TestUncoveredShapes:
    def test_flags_a_capacity_on_a_symbol_the_shape_does_not_use(self):
        plan = replace_buffer(base(), "q0", shape=(4, 64), capacity={"B": 8})
        assert "caps 'B' but its shape [4, 64] does not use it" in only(plan, "GF301").message

    def test_positive_symbols_pass(self):
        plan = attrs.evolve(replace_buffer(base(), "q0", shape=("B", "H"), capacity={"B": 4}), symbols={"H": 2})
        assert validate(plan).diagnostics == ()


class TestBufferDevices:
    def test_flags_a_graph_reading_a_buffer_on_another_gpu(self):
        plan = replace_buffer(base(), "o1", device="cuda:1")
        plan = replace_segment(plan, "L1.attn", device="cuda:1")
        d = only(plan, "GF302")
        assert d.element == "segment L1.post"
        assert d.message == "'o1' on cuda:1 is read by graph segment L1.post on cuda:0"
        assert d.fix == "move the buffer to cuda:0 or add an eager copy segment"

    def test_eager_segment_touching_two_gpus_passes(self):
        plan = replace_buffer(base(), "o1", device="cuda:1")  # L1.attn reads q1 on cuda:0, writes o1 on cuda:1
        assert [d.element for d in found(plan, "GF302")] == ["segment L1.post"]


class TestMissingStream:
    def test_flags_a_graph_segment_without_stream(self):
        d = only(replace_segment(base(), "L1.pre", stream=None), "GF401")
        assert d.element == "segment L1.pre"
        assert (d.message, d.fix) == ("graph segment L1.pre has no stream", "add `stream: s0`")

    def test_eager_segment_without_stream_passes(self):
        assert found(base(), "GF401") == []


class TestStreamDevices:
    def test_flags_a_stream_on_another_gpu_than_the_buffers(self):
        plan = attrs.evolve(base(), streams=[Stream("s0", "cuda:0"), Stream("s1", "cuda:1")])
        d = only(replace_segment(plan, "head", stream="s1"), "GF402")
        assert d.element == "segment head"
        assert (d.message, d.fix) == ("graph segment head on cuda:0 runs on stream s1 on cuda:1", "use stream s0")
        assert found(replace_segment(plan, "head", stream="s1"), "GF302") == []

    def test_flags_a_stream_on_another_gpu_than_the_declared_device(self):
        d = only(replace_segment(base(), "L0.attn", device="cuda:1", stream="s0"), "GF402")
        assert d.message == "eager segment L0.attn on cuda:1 runs on stream s0 on cuda:0"

    def test_stream_on_the_buffers_gpu_passes(self):
        assert found(replace_segment(base(), "L0.attn", stream="s0"), "GF402") == []


def two_gpu_plan(*, copy: bool) -> Plan:
    """Layer 0 on cuda:0, layer 1 on cuda:1, with or without an eager copy between."""
    plan = base()
    buffers = [*plan.buffers, buf("x1", role=BufferRole.OUTPUT, device="cuda:1"), buf("h1", device="cuda:1")]
    buffers = [attrs.evolve(b, device="cuda:1") if b.name in ("q1", "o1") else b for b in buffers]
    layer1 = [
        graph("L1.pre", reads=["x1"], writes=["q1"], stream="s1"),
        eager("L1.attn", reads=["q1"], writes=["o1"]),
        graph("L1.post", reads=["o1", "x1"], writes=["x1"], stream="s1"),
    ]
    if copy:
        bridge = eager("copy", reads=["h1"], writes=["x1"])
    else:
        bridge = graph("move", reads=["h1"], writes=["x1"], stream="s1")
    out = graph("L0.out", reads=["x"], writes=["h1"], stream="s1", device="cuda:1")
    streams = [Stream("s0", "cuda:0"), Stream("s1", "cuda:1")]
    return attrs.evolve(plan, buffers=buffers, segments=[*plan.segments[:3], out, bridge, *layer1], streams=streams)


class TestRegionDevices:
    def test_flags_a_piecewise_region_spanning_two_gpus(self):
        plan = two_gpu_plan(copy=False)
        d = only(plan, "GF403")
        assert d.element == "segment L0.out"
        assert d.message == "PIECEWISE region target:L0.post..L1.pre runs L0.post on cuda:0 then L0.out on cuda:1"
        assert d.fix == "insert an eager copy segment between L0.post and L0.out"

    def test_eager_copy_between_gpus_passes(self):
        plan = two_gpu_plan(copy=True)
        plan = replace_segment(plan, "L0.out", device=None, stream="s0", writes=["h0"])
        plan = replace_segment(plan, "copy", reads=["h0"])
        # h0 replaces h1 as the copy's source, and this step has no head writing logits
        plan = attrs.evolve(plan, buffers=[*(b for b in plan.buffers if b.name not in ("h1", "logits")), buf("h0")])
        assert [d.code for d in validate(plan).diagnostics] == []


# -- channels ----------------------------------------------------------------------------------


DRAFT = Family("draft")


def with_draft(channel: Channel) -> Plan:
    """The base plan plus a draft family step that uses ``channel``."""
    plan = base(families=[Family("target"), DRAFT])
    return attrs.evolve(
        plan,
        buffers=[*plan.buffers, buf("d", role=BufferRole.OUTPUT)],
        channels=[*plan.channels, channel],
        segments=[*plan.segments, graph("D.step", reads=["x"], writes=["d"], family="draft", channels=[channel.name])],
    )


class TestSharedChannelIds:
    def test_flags_one_id_owned_by_two_families(self):
        d = only(with_draft(Channel("draft_ar", ChannelKind.ALL_REDUCE, "tp", 1, "draft")), "GF501")
        assert d.element == "channel draft_ar"
        assert d.message == "channel id 1 is owned by several families: tp_ar (target), draft_ar (draft)"

    def test_own_id_per_family_passes(self):
        assert validate(with_draft(Channel("draft_ar", ChannelKind.ALL_REDUCE, "tp", 2, "draft"))).diagnostics == ()


class TestForeignChannels:
    def test_flags_a_segment_using_another_familys_channel(self):
        plan = with_draft(Channel("draft_ar", ChannelKind.ALL_REDUCE, "tp", 2, "draft"))
        plan = replace_segment(plan, "D.step", channels=["tp_ar"])
        d = only(plan, "GF502")
        assert d.element == "segment D.step"
        assert d.message == "graph segment D.step of family draft uses channel tp_ar owned by family target"

    def test_own_channel_passes(self):
        assert found(with_draft(Channel("draft_ar", ChannelKind.ALL_REDUCE, "tp", 2, "draft")), "GF502") == []


class TestPlaceholderReachesRouting:
    def test_flags_placeholder_output_feeding_data_dependent_routing(self):
        plan = attrs.evolve(base(), channels=[attrs.evolve(TP_AR, warmup=WarmupPolicy.PLACEHOLDER)])
        diagnostics = found(plan, "GF503")
        assert [d.element for d in diagnostics] == ["segment L0.post", "segment L1.post"]
        assert diagnostics[0].message == ("channel tp_ar warms up with a placeholder output "
                                          "that reaches data-dependent segment L0.post")

    def test_flags_a_data_dependent_descendant(self):
        plan = attrs.evolve(base(), channels=[attrs.evolve(TP_AR, warmup=WarmupPolicy.PLACEHOLDER)])
        plan = replace_segment(replace_segment(plan, "L0.post", data_dependent=False), "L1.post", data_dependent=False)
        plan = replace_segment(plan, "head", data_dependent=True)
        d = found(plan, "GF503")[0]
        assert d.message == ("channel tp_ar warms up with a placeholder output "
                             "that reaches data-dependent segment head after L0.post")

    def test_placeholder_feeding_only_dense_work_passes(self):
        plan = attrs.evolve(base(), channels=[attrs.evolve(TP_AR, warmup=WarmupPolicy.PLACEHOLDER)])
        plan = replace_segment(replace_segment(plan, "L0.post", data_dependent=False), "L1.post", data_dependent=False)
        assert validate(plan).diagnostics == ()


class TestColdJitChannels:
    def test_flags_a_jit_channel_with_placeholder_warmup_and_no_prewarm(self):
        channel = attrs.evolve(TP_AR, jit=True, warmup=WarmupPolicy.PLACEHOLDER)
        d = only(attrs.evolve(base(), channels=[channel]), "GF504")
        assert d.element == "channel tp_ar"
        assert d.message == "channel tp_ar is a JIT kernel with warmup: placeholder and no prewarm hook"

    def test_flags_prepare_warmup_without_prewarm(self):
        channel = attrs.evolve(TP_AR, warmup=WarmupPolicy.PREPARE)
        assert "is prepared with warmup: prepare" in only(attrs.evolve(base(), channels=[channel]), "GF504").message

    def test_jit_channel_with_a_prewarm_hook_passes(self):
        channel = attrs.evolve(TP_AR, jit=True, warmup=WarmupPolicy.PLACEHOLDER, prewarm="warm")
        assert found(attrs.evolve(base(), channels=[channel], prewarm=[Prewarm("warm", "ar.prepare")]), "GF504") == []

    def test_jit_channel_with_real_warmup_passes(self):
        assert validate(attrs.evolve(base(), channels=[attrs.evolve(TP_AR, jit=True)])).diagnostics == ()


EP_A2A = Channel("ep_a2a", ChannelKind.ALL_TO_ALL, "ep", 2, "target")


class TestRankCollectiveOrder:
    def test_flags_a_collective_only_some_ranks_call(self):
        d = only(replace_segment(base(), "L0.post", ranks=[0]), "GF505")
        assert d.element == "segment L0.post"
        assert d.message == ("family target collective #2 differs across ranks: "
                             "rank 0 calls tp_ar in L1.post; rank 1 calls nothing")

    def test_flags_collectives_in_different_orders(self):
        plan = attrs.evolve(base(world_size=3), channels=[TP_AR, EP_A2A])
        early = graph("L0.early", reads=["x"], writes=["x"], channels=["ep_a2a"], ranks=[0])
        late = graph("L0.late", reads=["x"], writes=["x"], channels=["ep_a2a"], ranks=[1, 2])
        plan = insert_after(insert_after(plan, "L0.attn", early), "L0.post", late)
        d = only(plan, "GF505")
        assert d.element == "segment L0.early"
        assert d.message == ("family target collective #1 differs across ranks: rank 0 calls ep_a2a in L0.early; "
                             "ranks 1, 2 call tp_ar in L0.post")

    def test_per_rank_segments_with_the_same_collective_order_pass(self):
        plan = attrs.evolve(base(), channels=[TP_AR, EP_A2A])
        plan = insert_after(plan, "L0.attn", graph("L0.r0", reads=["x"], writes=["x"], channels=["ep_a2a"], ranks=[0]),
                            graph("L0.r1", reads=["x"], writes=["x"], channels=["ep_a2a"], ranks=[1]))
        assert validate(plan).diagnostics == ()

    def test_per_rank_segments_without_collectives_pass(self):
        plan = insert_after(base(), "L0.pre", graph("probe", reads=["q0"], writes=["q0"], ranks=[0]))
        assert validate(plan).diagnostics == ()


class TestUnusedChannels:
    def test_warns_on_a_channel_no_segment_uses(self):
        plan = attrs.evolve(base(), channels=[TP_AR, Channel("ep_a2a", ChannelKind.ALL_TO_ALL, "ep", 2, "target")])
        d = only(plan, "GF506")
        assert (d.severity, d.element) == (Severity.WARNING, "channel ep_a2a")
        assert d.message == "channel ep_a2a is used by no segment"

    def test_used_channels_pass(self):
        assert found(base(), "GF506") == []


# -- modes -------------------------------------------------------------------------------------


class TestEagerInFull:
    def test_flags_an_eager_segment_under_full(self):
        d = only(replace_capture(base(), modes=[Mode.PIECEWISE, Mode.FULL]), "GF601")
        assert d.element == "segment L0.attn"
        assert d.message == "FULL region of family target contains eager segment(s) L0.attn, L1.attn"

    def test_all_graph_step_under_full_passes(self):
        plan = replace_capture(base(), modes=[Mode.PIECEWISE, Mode.FULL])
        segments = [attrs.evolve(s, kind=SegmentKind.GRAPH, stream="s0") for s in plan.segments]
        assert validate(attrs.evolve(plan, segments=segments)).diagnostics == ()


class TestUnsortedSizes:
    def test_warns_on_unsorted_sizes(self):
        d = only(replace_capture(base(), sizes=[1, 4, 2]), "GF602")
        assert (d.severity, d.element) == (Severity.WARNING, "capture")
        assert d.message == "capture.sizes [1, 4, 2] are not in increasing order"
        assert d.fix == "list them sorted: [1, 2, 4]"

    def test_sorted_sizes_pass(self):
        assert found(base(), "GF602") == []


class TestDuplicatedSizes:
    def test_flags_a_repeated_size(self):
        d = only(replace_capture(base(), sizes=[1, 2, 2, 4]), "GF603")
        assert d.message == "capture.sizes lists 2 more than once"

    def test_flags_a_repeated_mode(self):
        d = only(replace_capture(base(), modes=[Mode.PIECEWISE, Mode.PIECEWISE]), "GF603")
        assert d.message == "capture.modes lists 'PIECEWISE' more than once"

    def test_unique_sizes_pass(self):
        assert found(base(), "GF603") == []


class TestModeSizes:
    def test_each_mode_list_is_checked_for_order_and_repeats(self):
        plan = replace_capture(base(), modes=[Mode.PIECEWISE], mode_sizes={Mode.PIECEWISE: (4, 1, 1)})
        assert only(plan, "GF602").message == "capture.sizes.PIECEWISE [4, 1, 1] are not in increasing order"
        assert only(plan, "GF603").message == "capture.sizes.PIECEWISE lists 1 more than once"

    def test_sizes_for_a_mode_that_is_not_captured_are_an_error(self):
        plan = replace_capture(base(), mode_sizes={Mode.FULL: (1,)})
        assert only(plan, "GF605").message == ("capture.sizes gives sizes for FULL, which capture.modes does not "
                                               "list")

    def test_capacity_is_checked_against_every_mode(self):
        plan = replace_capture(replace_buffer(base(), "q0", capacity={"B": 4}), sizes=[1, 2],
                               mode_sizes={Mode.PIECEWISE: (1, 8)})
        assert only(plan, "GF604").message == "sizes 8 are above buffer 'q0' capacity B=4"


class TestSizesAboveCapacity:
    def test_flags_sizes_above_a_buffer_capacity(self):
        d = only(replace_buffer(base(), "q0", capacity={"B": 2}), "GF604")
        assert d.element == "buffer q0" and d.message == "sizes 4 are above buffer 'q0' capacity B=2"
        assert d.fix == "raise its capacity to 4 or drop sizes above 2"

    def test_flags_a_symbol_above_capacity(self):
        plan = attrs.evolve(replace_buffer(base(), "q0", shape=("B", "S"), capacity={"S": 16}), symbols={"S": 32})
        assert only(plan, "GF604").message == "symbol S=32 is above buffer 'q0' capacity S=16"

    def test_capacity_at_the_largest_size_passes(self):
        assert validate(replace_buffer(base(), "q0", capacity={"B": 4})).diagnostics == ()


class TestMissingDescriptors:
    def test_flags_empty_modes(self):
        assert only(replace_capture(base(), modes=[]), "GF605").message == "capture.modes is empty"

    def test_flags_empty_sizes(self):
        assert only(replace_capture(base(), sizes=[]), "GF605").message == "capture.sizes is empty"

    def test_positive_sizes_pass(self):
        assert found(base(), "GF605") == []




class TestRetiredCodes:
    def test_retired_codes_are_listed_not_reused(self):
        assert set(RETIRED) == {"GF111", "GF606"} and not set(RETIRED) & {rule.code for rule in RULES}
        assert "## Retired codes" in rules_markdown() and "- GF606: bad capture settings" in rules_markdown()

    def test_disabling_a_retired_code_says_what_checks_it_now(self):
        with pytest.raises(ValueError, match=r"^GF111 is retired \(unknown dtype: now rejected when the plan is"):
            validate(base(), disable=["GF111"])


# -- unused declarations -----------------------------------------------------------------------


class TestUnusedBuffers:
    def test_warns_on_a_buffer_no_segment_uses(self):
        d = only(attrs.evolve(base(), buffers=[*base().buffers, buf("spare")]), "GF205")
        assert (d.severity, d.element) == (Severity.WARNING, "buffer spare")
        assert d.message == "buffer 'spare' is read or written by no segment"

    def test_a_buffer_used_only_through_an_alias_passes(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("root"), buf("view", alias_of="root")])
        plan = replace_segment(plan, "head", writes=["logits", "view"])
        plan = replace_buffer(plan, "root", role=BufferRole.OUTPUT)
        assert found(plan, "GF205") == []


class TestUnusedStreams:
    def test_warns_on_a_stream_no_segment_runs_on(self):
        d = only(attrs.evolve(base(), streams=[Stream("s0", "cuda:0"), Stream("side", "cuda:0")]), "GF404")
        assert (d.severity, d.element, d.message) == (Severity.WARNING, "stream side",
                                                      "stream side is used by no segment")

    def test_used_streams_pass(self):
        assert found(base(), "GF404") == []


# -- allocation against the memory of a GPU ----------------------------------------------------


def with_cache(rows: int) -> Plan:
    """The base plan plus a state cache of ``rows`` x 1024 float32 (its capacity), read by head."""
    plan = attrs.evolve(base(), buffers=[*base().buffers, buf("cache", ("B", 1024), role=BufferRole.STATE,
                                                              dtype="float32", capacity={"B": rows}, pad="keep")])
    return replace_segment(plan, "head", reads=["x", "cache"])


class TestDeviceMemory:
    # base(): x, q0, o0, q1, o1 are 4 rows x 64 bf16 (512 B each), logits 4 rows x 100 float32 (1600 B)
    STATIC = 5 * 512 + 1600

    def test_buffers_within_the_memory_pass(self):
        assert validate(base(), device_memory=self.STATIC).diagnostics == ()

    def test_warns_when_a_gpu_needs_more_than_its_memory(self):
        total = self.STATIC + (4 << 30)  # 4 GiB of cache
        [d] = [x for x in validate(with_cache(1 << 20), device_memory=1 << 30).diagnostics if x.code == "GF303"]
        assert (d.severity, d.element) == (Severity.WARNING, "plan")
        assert d.message == (f"static buffers on cuda:0 take 4.0 GiB ({total:,} bytes), more than its 1.0 GiB "
                             "(1,073,741,824 bytes) of memory; the largest: cache (4.0 GiB), logits (1.6 KiB), "
                             "x (512 B)")

    def test_without_a_figure_only_what_no_gpu_holds_is_flagged(self):
        assert found(with_cache(1 << 20), "GF303") == [] and found(with_cache(1 << 20), "GF304") == []
        d = only(with_cache(1 << 29), "GF304")  # 2 TiB
        assert d.severity is Severity.ERROR
        assert d.message.startswith("static buffers on cuda:0 take 2.0 TiB (")
        assert "more than any GPU holds (over 1.0 TiB); the largest: cache (2.0 TiB)" in d.message

    def test_a_larger_figure_raises_the_ceiling_and_one_finding_per_gpu(self):
        plan = with_cache(1 << 29)
        assert validate(plan, device_memory=4 << 40).diagnostics == ()
        assert [d.code for d in validate(plan, device_memory=1 << 40).diagnostics] == ["GF304"]

    def test_buffers_on_the_cpu_are_not_counted(self):
        plan = replace_buffer(with_cache(1 << 29), "cache", device="cpu")
        plan = replace_segment(plan, "head", reads=["x"])
        plan = insert_after(plan, "head", eager("host", reads=["cache"], writes=["cache"]))
        assert "GF304" not in validate(plan).codes()

    @pytest.mark.parametrize("amount", [0, -1, 1.5, True, "80GiB"])
    def test_the_figure_must_be_a_positive_number_of_bytes(self, amount):
        with pytest.raises(ValueError, match="device_memory must be a positive number of bytes"):
            validate(base(), device_memory=amount)


class TestAliasChainsAreOneStorage:
    def test_an_alias_of_an_alias_passes_and_is_read_as_its_root(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("q0v", alias_of="q0"), buf("q0vv", alias_of="q0v")])
        plan = replace_segment(plan, "L0.attn", reads=["q0vv"])
        assert validate(plan).diagnostics == ()

    def test_a_write_through_the_chain_and_the_root_is_two_names(self):
        plan = attrs.evolve(base(), buffers=[*base().buffers, buf("q0v", alias_of="q0"), buf("q0vv", alias_of="q0v")])
        plan = replace_segment(plan, "L0.attn", reads=["q0"], writes=["o0", "q0vv"])
        d = only(plan, "GF204")
        assert d.element == "buffer q0" and "written through 'q0' (by L0.pre), 'q0vv' (by L0.attn)" in d.message


# -- keyword calls, breaks, adoption, the reference ----------------------------------------------


class TestRealModelRules:
    def test_gf114_a_keyword_given_twice(self):
        plan = replace_segment(base(), "head", inputs={"x": "x"}, constants={"x": 2})
        d = only(plan, "GF114")
        assert (d.severity, d.element) == (Severity.ERROR, "segment head")
        assert d.message == "argument 'x' of model.head is given by inputs and by constants"

    def test_gf115_breaks_on_an_eager_segment(self):
        d = only(replace_segment(base(), "L0.attn", breaks=["layers.*.attn"]), "GF115")
        assert (d.severity, d.message) == (Severity.WARNING, "eager segment L0.attn names breaks (layers.*.attn), "
                                                             "which only split graph segments")

    def test_gf208_one_tensor_adopted_twice_or_by_an_alias(self):
        plan = replace_buffer(replace_buffer(base(), "q0", adopt="cache.k"), "q1", adopt="cache.k")
        assert only(plan, "GF208").message == "buffers 'q0' and 'q1' both adopt cache.k"
        view = buf("view", alias_of="x", adopt="cache.v")
        plan = replace_segment(attrs.evolve(base(), buffers=[*base().buffers, view]), "head", reads=["x", "view"])
        assert only(plan, "GF208").message == "alias 'view' adopts cache.v"

    def test_gf209_and_gf101_the_reference_names_buffers_the_step_writes(self):
        plan = attrs.evolve(base(), reference=Reference("forward", inputs={"x": "x"}, returns=["x", "y"]))
        assert only(plan, "GF101").message == "'y' is named by the reference forward but no buffer 'y' is declared"
        assert found(plan, "GF209") == []  # x is written in place by L0.post
        plan = attrs.evolve(base(), reference=Reference("forward", returns=["q0"]))
        assert found(plan, "GF209") == []
        plan = replace_segment(attrs.evolve(base(), reference=Reference("forward", returns=["o0"])),
                               "L0.attn", writes=["o1"])
        assert only(plan, "GF209").message == "the reference's output 'o0' is written by no segment"

    def test_gf405_breaks_in_a_region_on_two_streams(self):
        plan = attrs.evolve(base(), streams=[*base().streams, Stream("s1", "cuda:0")])
        plan = replace_segment(replace_segment(plan, "head", stream="s1"), "L1.post", breaks=["layers.*.attn"])
        d = only(plan, "GF405")
        assert d.message == ("graph segment L1.post has breaks, and region target:L1.post..head runs on streams s0, "
                             "s1")
