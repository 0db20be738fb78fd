"""The pure views of a plan in ``graphflow.view.render``: summary and DOT (the picture: test_picture.py)."""

from __future__ import annotations

import pathlib
import re

import attrs
import pytest

from graphflow.plan import (
    Buffer,
    BufferRole,
    CaptureSettings,
    Channel,
    ChannelKind,
    Family,
    Mode,
    Plan,
    Segment,
    SegmentKind,
    Stream,
    WarmupPolicy,
)
from graphflow.plan.loader import load_plan
from graphflow.view.render import format_summary, shown_mode, summarize, to_dot, to_rich
from graphflow.units import compact_sizes, format_bytes, group_by_template

GRAPH, EAGER = SegmentKind.GRAPH, SegmentKind.EAGER
DEV = "cuda:0"
PLANS = pathlib.Path(__file__).resolve().parents[1] / "plans"


def split_plan(layers: int = 2, modes=(Mode.PIECEWISE,), sizes=(1, 2, 4, 8)) -> Plan:
    """Per layer: graph pre-attention, eager attention, graph post-attention with an all-reduce."""
    buffers = [Buffer("x", ("B", 1024), "bfloat16", DEV, BufferRole.INPUT)]
    segments = []
    for i in range(layers):
        buffers += [
            Buffer(f"q{i}", ("B", 8, 128), "bfloat16", DEV),  # 2048 bytes per batch row
            Buffer(f"o{i}", ("B", 8, 128), "bfloat16", DEV),
        ]
        segments += [
            Segment(f"L{i}.pre", GRAPH, f"layers.{i}.pre", reads=("x",), writes=(f"q{i}",), stream="s0"),
            Segment(f"L{i}.attn", EAGER, f"layers.{i}.attn", reads=(f"q{i}",), writes=(f"o{i}",)),
            Segment(f"L{i}.post", GRAPH, f"layers.{i}.post", reads=(f"o{i}", "x"), writes=("x",), stream="s0",
                    channels=("tp_ar",)),
        ]
    buffers.append(Buffer("logits", ("B", 1000), "float32", DEV, BufferRole.OUTPUT))
    segments.append(Segment("head", GRAPH, "head", reads=("x",), writes=("logits",), stream="s0"))
    return Plan(
        name="split",
        buffers=buffers,
        streams=[Stream("s0", DEV)],
        channels=[Channel("tp_ar", ChannelKind.ALL_REDUCE, "tp", 1, "target", WarmupPolicy.REAL)],
        segments=segments,
        capture=CaptureSettings(modes=modes, sizes=sizes),
        model="pkg.model:build",
        world_size=2,
    )


class TestCompactSizes:
    def test_vllm_decode_sizes_become_one_range(self):
        assert compact_sizes([1, 2, 4, *range(8, 513, 8)]) == "1, 2, 4, 8..512 step 8"

    def test_consecutive_sizes_have_no_step(self):
        assert compact_sizes(range(1, 9)) == "1..8"

    def test_short_runs_are_listed(self):
        assert compact_sizes([1, 2, 4, 8, 16, 32]) == "1, 2, 4, 8, 16, 32"
        assert compact_sizes([3, 5]) == "3, 5"

    def test_unsorted_duplicates_are_sorted_once(self):
        assert compact_sizes([8, 1, 4, 4, 2]) == "1, 2, 4, 8"

    def test_empty(self):
        assert compact_sizes([]) == ""


class TestFormatBytes:
    @pytest.mark.parametrize(
        ("n", "text"),
        [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (5 * 2**20, "5.0 MiB"),
         (3 * 2**30, "3.0 GiB"), (2**50, "1024.0 TiB")],
    )
    def test_binary_units(self, n, text):
        assert format_bytes(n) == text


class _Named:
    def __init__(self, name, kind="a"):
        self.name = name
        self.kind = kind


class TestGroupByTemplate:
    def test_layer_numbered_names_group_into_a_range(self):
        items = [_Named(f"q{i}") for i in range(61)]
        groups = group_by_template(items)
        assert [(g.label, len(g.members)) for g in groups] == [("q{0..60}", 61)]

    def test_gaps_are_shown_as_a_sparse_range(self):
        groups = group_by_template([_Named(f"q{i}") for i in (0, 2, 4)])
        assert [g.label for g in groups] == ["q{0,..,4}"]

    def test_fewer_than_three_stay_separate(self):
        groups = group_by_template([_Named("w1"), _Named("w2")])
        assert [g.label for g in groups] == ["w1", "w2"]

    def test_key_splits_groups(self):
        items = [_Named(f"q{i}", "a") for i in range(3)] + [_Named(f"q{i}", "b") for i in range(3, 6)]
        groups = group_by_template(items, key=lambda item: item.kind)
        assert [g.label for g in groups] == ["q{0..2}", "q{3..5}"]

    def test_only_the_varying_number_becomes_a_range(self):
        groups = group_by_template([_Named(f"L{i}.w1") for i in range(4)])
        assert [g.label for g in groups] == ["L{0..3}.w1"]

    def test_order_follows_first_member(self):
        items = [_Named("x"), _Named("q0"), _Named("y"), _Named("q1"), _Named("q2")]
        assert [g.label for g in group_by_template(items)] == ["x", "q{0..2}", "y"]


class TestSummary:
    def text(self, plan: Plan) -> str:
        return format_summary(summarize(plan))

    def test_header_names_model_world_size_and_descriptors(self):
        text = self.text(split_plan())
        assert "plan split\n" in text
        assert "model: pkg.model:build" in text
        assert "world size: 2" in text
        assert "descriptors: PIECEWISE x 4 sizes 1..8 (B = 1, 2, 4, 8)" in text

    def test_segments_counted_by_kind_and_family(self):
        text = self.text(split_plan(layers=3))
        assert "10 segments: 7 graph, 3 eager" in text
        assert "  target: 7 graph, 3 eager" in text

    def test_piecewise_regions_and_graph_count(self):
        text = self.text(split_plan(layers=2))
        assert "3 regions (target 3): 3 graphs per descriptor, 12 graphs over 4 sizes" in text
        assert "  target#0: L0.pre\n  target#1: L0.post, L1.pre\n  target#2: L1.post, head\n" in text

    def test_many_regions_elide_the_middle(self):
        text = self.text(split_plan(layers=61))
        assert "  target#3: L2.post, L3.pre\n  ... 57 more\n  target#61: L60.post, head\n" in text

    def test_six_regions_are_all_listed(self):
        text = self.text(split_plan(layers=5))
        assert "  target#4: L3.post, L4.pre\n  target#5: L4.post, head\n" in text
        assert "more" not in text

    def test_full_region_notes_eager_segments_inside(self):
        text = self.text(split_plan(layers=2, modes=(Mode.FULL,)))
        assert "FULL regions" in text
        assert "  target#0: L0.pre .. head (7 segments); 2 eager segments inside (FULL needs none)" in text
        assert "PIECEWISE regions" not in text

    def test_buffer_table_groups_layers_with_bytes_at_the_smallest_size_and_allocated(self):
        lines = self.text(split_plan(layers=4)).splitlines()
        header = next(line for line in lines if line.startswith("name "))
        assert header.split() == ["name", "count", "shape", "dtype", "device", "role", "bytes", "B=1", "allocated"]
        shown = re.compile(r"^(x|q\{0\.\.3\}|o\{0\.\.3\}|logits)\s")
        rows = {line.split()[0]: line.split() for line in lines if shown.match(line)}
        # x: [B, 1024] bfloat16 -> 2048 bytes per batch row.
        assert rows["x"] == ["x", "1", "[B,", "1024]", "bfloat16", "cuda:0", "input", "2.0", "KiB", "16.0", "KiB"]
        # q0..q3: 4 x [B, 8, 128] bfloat16 -> 4 x 2048 bytes per batch row.
        assert rows["q{0..3}"][1] == "4"
        assert rows["q{0..3}"][-4:] == ["8.0", "KiB", "64.0", "KiB"]
        assert rows["logits"][-4:] == ["3.9", "KiB", "31.2", "KiB"]

    def test_static_memory_is_the_allocation_at_the_largest_size(self):
        # per batch row: x 2048 + 2 layers x (q 2048 + o 2048) + logits 4000 = 14240 bytes, x 8 rows
        text = self.text(split_plan(layers=2))
        assert "static memory, allocated once at B=8 (capacities included): 111.2 KiB (113,920 bytes)\n" in text
        assert "cuda:0:" not in text  # one device: no per-device lines

    def test_static_memory_per_device_when_there_are_several(self):
        plan = split_plan(layers=1)
        host = Buffer("ids", ("B", 16), "int64", "cpu", BufferRole.INPUT)
        text = self.text(attrs.evolve(plan, buffers=(*plan.buffers, host)))
        # cuda:0: 8 rows x (x 2048 + q 2048 + o 2048 + logits 4000); cpu: 8 rows x 16 int64
        assert "(capacities included): 80.2 KiB (82,176 bytes)\n  cuda:0: 79.2 KiB (81,152 bytes)\n" \
               "  cpu: 1.0 KiB (1,024 bytes)\n" in text

    def test_aliases_share_storage_and_are_not_counted(self):
        plan = split_plan(layers=1)
        alias = Buffer("x_view", ("B", 1024), "bfloat16", DEV, alias_of="x")
        plan = Plan(name=plan.name, buffers=(*plan.buffers, alias), streams=plan.streams, channels=plan.channels,
                    segments=plan.segments, capture=plan.capture)
        text = self.text(plan)
        assert "alias of x" in text
        assert "(capacities included): 79.2 KiB (81,152 bytes)" in text  # 8 x (2048 + 2*2048 + 4000)

    def test_a_capacity_above_the_largest_size_is_allocated(self):
        # A KV cache for 64 sequences, captured up to 8: the engine allocates 64 rows.
        cache = Buffer("cache", ("B", 256), "float32", DEV, BufferRole.STATE, capacity={"B": 64})
        text = self.text(Plan(name="p", buffers=[cache], capture=CaptureSettings(sizes=(1, 8))))
        assert re.search(r"^cache .* state +1\.0 KiB +64\.0 KiB$", text, re.M)  # a B=1 view, the allocation
        assert "(capacities included): 64.0 KiB (65,536 bytes)" in text

    def test_a_capacity_on_another_symbol_is_allocated(self):
        cache = Buffer("cache", ("B", "S", 4), "float32", DEV, BufferRole.STATE, capacity={"S": 32})
        plan = Plan(name="p", buffers=[cache], symbols={"S": 16}, capture=CaptureSettings(sizes=(1, 2)))
        text = self.text(plan)
        assert re.search(r"^cache .* 512 B +1\.0 KiB$", text, re.M)  # S at 32 in the view too
        assert "(capacities included): 1.0 KiB (1,024 bytes)" in text

    def test_unknown_symbol_is_shown_not_raised(self):
        plan = Plan(name="p", buffers=[Buffer("kv", ("S", 4), "float32", DEV)], capture=CaptureSettings(sizes=(1, 2)))
        text = self.text(plan)
        assert re.search(r"^kv .* \?\s+\?$", text, re.M)
        assert "(capacities included): 0 B (0 bytes) (1 buffer with an unknown shape symbol not counted)" in text

    def test_an_unknown_symbol_leaves_the_other_buffers_counted(self):
        plan = Plan(name="p", buffers=[Buffer("kv", ("S", 4), "float32", DEV), Buffer("x", ("B",), "int8", DEV)],
                    capture=CaptureSettings(sizes=(1, 2)))
        assert "(capacities included): 2 B (2 bytes) (1 buffer with an unknown shape symbol not counted)" in \
               self.text(plan)

    def test_channels_listed_by_family_with_users(self):
        text = self.text(split_plan(layers=3))
        assert "target:\n  tp_ar: all_reduce group=tp id=1 warmup=real, used by 3 segments" in text

    def test_rich_rendering_carries_the_same_table(self):
        from rich.console import Console

        console = Console(record=True, width=160)
        console.print(to_rich(summarize(split_plan(layers=4))))
        text = console.export_text()
        assert "q{0..3}" in text and "64.0 KiB" in text and "buffers" in text


class TestDot:
    def test_regions_are_clusters_with_their_segments(self):
        dot = to_dot(split_plan(layers=2))
        cluster = re.search(r"subgraph cluster_target_1 \{(.*?)\n  \}", dot, re.S)
        assert cluster is not None
        assert 'label="PIECEWISE target#1"' in cluster.group(1)
        assert '"L0.post" [' in cluster.group(1) and '"L1.pre" [' in cluster.group(1)
        assert dot.count("subgraph cluster_") == 3

    def test_eager_breaks_have_their_own_shape_outside_clusters(self):
        dot = to_dot(split_plan(layers=1))
        line = next(line for line in dot.splitlines() if line.strip().startswith('"L0.attn" ['))
        assert "shape=octagon" in line
        assert line.startswith('  "L0.attn"')  # top level, not inside a cluster
        graph_line = next(line for line in dot.splitlines() if line.strip().startswith('"L0.pre" ['))
        assert "shape=box" in graph_line

    def test_a_cut_segment_shows_its_graph_pieces_and_breaks(self):
        dot = to_dot(load_plan(PLANS.parent / "examples" / "hf_llama" / "decode.yaml"))
        assert 'label="PIECEWISE target#0, cut at model.layers.*.self_attn"' in dot
        assert ('"decode" [shape=record, label="{decode|{graph|eager: model.layers.*.self_attn|graph …}|'
                'graph pieces cut at model.layers.*.self_attn (eager)}"') in dot

    def test_edges_carry_buffer_versions(self):
        dot = to_dot(split_plan(layers=2))
        assert '"L0.pre" -> "L0.attn" [style=solid, label="q0@1"];' in dot
        assert '"L0.post" -> "L1.pre" [style=solid, label="x@1"];' in dot
        # L0.post overwrites x that L0.pre read: an in-place update ordered after its reader.
        assert '"L0.pre" -> "L0.post" [style=dashed, label="x@0"];' in dot

    def test_full_only_plan_clusters_each_family_step(self):
        dot = to_dot(split_plan(layers=1, modes=(Mode.FULL,)))
        assert dot.count("subgraph cluster_") == 1
        cluster = re.search(r"subgraph cluster_target_0 \{(.*?)\n  \}", dot, re.S).group(1)
        assert 'label="FULL target#0"' in cluster
        assert re.findall(r'^    "([^"]+)" \[', cluster, re.M) == ["L0.pre", "L0.attn", "L0.post", "head"]

    def test_channel_users_name_their_channels_on_a_second_line(self):
        assert '"L0.post" [label="L0.post\\ntp_ar", shape=box' in to_dot(split_plan(layers=1))

    def test_names_are_quoted(self):
        plan = Plan(name='a "b"', segments=[Segment('s"1', GRAPH, "f", stream="s0")])
        dot = to_dot(plan)
        assert dot.startswith('digraph "a \\"b\\"" {')
        assert '"s\\"1" [label="s\\"1"' in dot
        assert to_dot(Plan(name="p", segments=[Segment("a\\b", GRAPH, "f")])).count('"a\\\\b"') == 2

    def test_family_colors_differ(self):
        plan = Plan(
            name="two",
            families=[Family("target"), Family("draft")],
            segments=[Segment("t", GRAPH, "t", stream="s"), Segment("d", GRAPH, "d", stream="s", family="draft")],
        )
        colors = re.findall(r'fillcolor="(#\w+)"', "\n".join(l for l in to_dot(plan).splitlines() if "label=\"t\"" in l
                                                              or "label=\"d\"" in l))
        assert len(colors) == 2 and colors[0] != colors[1]


class TestShownMode:
    def test_piecewise_whenever_captured(self):
        assert shown_mode(split_plan(modes=(Mode.PIECEWISE, Mode.FULL))) is Mode.PIECEWISE

    def test_full_for_a_full_only_plan(self):
        assert shown_mode(split_plan(modes=(Mode.FULL,))) is Mode.FULL


class TestStreamsSection:
    def section(self, plan: Plan) -> list[str]:
        return format_summary(summarize(plan)).split("streams\n-------\n")[1].split("\n\n")[0].splitlines()

    def test_a_one_stream_plan_lists_the_stream_and_nothing_to_overlap(self):
        assert self.section(load_plan(PLANS / "toy.yaml")) == ["s0 (cuda:0): 10 segments"]

    def test_segments_without_a_stream_run_on_the_engines_and_their_edges_cross(self):
        assert self.section(split_plan(layers=2)) == [
            "s0 (cuda:0): 5 segments",
            "no stream (the engine's own stream on their device): 2 segments",
            "4 dependencies cross streams: each is an event wait, unless another wait already covers it",
        ]

    def test_side_streams_count_segments_crossings_and_forking_regions(self):
        section = self.section(load_plan(PLANS / "dsv4_mini_full.yaml"))
        assert section[:3] == ["s0 (cuda:0): 22 segments", "s1 (cuda:0): 8 segments", "s2 (cuda:0): 4 segments"]
        assert re.fullmatch(r"\d+ dependencies cross streams: each is an event wait, unless another wait already "
                            r"covers it", section[3])
        assert section[4] == "FULL: 1 of 1 region forks onto several streams inside the graph"
        assert self.section(load_plan(PLANS / "dsv4_mini_piecewise.yaml"))[-1] == (
            "PIECEWISE: 4 of 5 regions fork onto several streams inside the graph")
