"""The plan's picture (``graphflow.view.picture``): what is drawn, checked on the layout, then on the files."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from big_plans import chain_plan, layered_plan
from graphflow.plan.schedule import build_schedule, dependencies
from graphflow.plan.loader import load_plan
from graphflow.view.picture import MAX_PIXELS, SCREEN_PIXELS, Expand, ImageFormat, draw, layout, parse_layers
from graphflow.plan import Channel, ChannelKind, Mode, Origin, Plan, Segment, SegmentKind, Stream

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
GRAPH, EAGER = SegmentKind.GRAPH, SegmentKind.EAGER


def plan(name: str) -> Plan:
    return load_plan(PLANS / f"{name}.yaml")


def box(picture, label: str):
    (found,) = [b for b in picture.boxes if b.label == label]
    return found


def drawn(picture, source: str, target: str):
    """The drawn edges standing for the real edge source -> target."""
    return [e for e in picture.edges if (source, target) in e.real]


ALL = ["toy", "toy_full", "dsv4_mini_piecewise", "dsv4_mini_full", "dsv4_61l_decode", "dsv4_61l_full",
       "dsv4_tp_piecewise", "dsv4_tp_full"]


class TestEveryEdgeIsDrawn:
    @pytest.mark.parametrize("name", ALL)
    @pytest.mark.parametrize("expand", [Expand.NONE, Expand.ALL])
    def test_each_dag_edge_is_some_drawn_edge(self, name, expand):
        p = plan(name)
        picture = layout(p, expand=expand)
        assert picture.real_edges() == set(p.dag().edges)

    def test_the_eager_attention_is_no_dead_end(self):
        picture = layout(plan("dsv4_mini_piecewise"), expand=Expand.ALL)
        for layer in range(4):
            attn = box(picture, f"L{layer}.attn")
            index = picture.boxes.index(attn)
            assert [e for e in picture.edges if e.target == index], "nothing feeds the attention"
            outgoing = [e for e in picture.edges if e.source == index]
            assert {picture.boxes[e.target].label for e in outgoing} == {f"L{layer}.mix"}

    def test_a_collapsed_block_draws_the_feed_to_the_next_copy_on_its_bus(self):
        picture = layout(plan("toy"))
        (carried,) = drawn(picture, "L0.post", "L1.pre")
        assert carried.route == "carried" and carried.offset == 1
        assert carried == drawn(picture, "L1.post", "L2.pre")[0]  # one drawn edge for every copy
        assert picture.boxes[carried.source].label == "L{0..2}.post"
        assert picture.boxes[carried.target].label == "L{0..2}.pre"

    def test_edges_into_and_out_of_a_block_are_direct(self):
        picture = layout(plan("dsv4_61l_decode"))
        (into,) = drawn(picture, "embed", "L0.pre")
        assert into.route == "direct" and {"x", "rope"} <= set(into.buffers)
        (out,) = drawn(picture, "L60.ffn_out", "head")
        assert out.route == "direct" and picture.boxes[out.target].label == "head"

    def test_edges_across_a_line_break_are_connectors(self):
        picture = layout(plan("dsv4_mini_piecewise"), expand=Expand.ALL)
        assert len({b.line for b in picture.boxes}) > 1
        for edge in picture.edges:
            a, b = picture.boxes[edge.source], picture.boxes[edge.target]
            assert edge.route == ("direct" if a.line == b.line and a.x < b.x else "connector")


class TestLanes:
    def test_one_lane_per_stream_each_segment_on_its_own(self):
        p = plan("dsv4_mini_piecewise")
        picture = layout(p)
        ((family, lanes),) = picture.lanes
        assert family == "target" and [lane.key for lane in lanes] == ["s0", "s1", "s2"]
        for b in picture.boxes:
            assert lanes[b.lane].key == b.segment.stream

    def test_segments_without_a_stream_share_the_engine_lane_of_their_device(self):
        p = Plan(name="p", streams=[Stream("s0", "cuda:0")], segments=[
            Segment("a", GRAPH, "a", writes=("x",), stream="s0"),
            Segment("b", EAGER, "b", reads=("x",), writes=("y",), device="cuda:0"),
        ])
        ((_, lanes),) = layout(p).lanes
        assert [(lane.key, lane.label) for lane in lanes] == [("s0", "s0"), ("engine:cuda:0", "engine stream")]

    def test_a_segment_starts_after_what_it_depends_on(self):
        picture = layout(plan("dsv4_mini_full"), expand=Expand.ALL)
        x = {b.label: b.x for b in picture.boxes}
        for a, b in plan("dsv4_mini_full").dag().edges:
            assert x[a] < x[b] or box(picture, a).line < box(picture, b).line

    def test_concurrent_segments_share_a_column(self):
        picture = layout(plan("dsv4_mini_full"))
        moe, ffn_res, shared = (box(picture, f"L{{0..3}}.{n}") for n in ("moe", "ffn_res", "shared"))
        assert moe.x == ffn_res.x == shared.x
        assert len({moe.lane, ffn_res.lane, shared.lane}) == 3


class TestEventWaits:
    def test_every_wait_the_engine_inserts_is_an_event_edge(self):
        p = plan("dsv4_mini_piecewise")
        picture = layout(p, expand=Expand.ALL)
        for region in p.regions(Mode.PIECEWISE):
            segments = [p.segment(n) for n in region.segments]
            schedule = build_schedule(region.segments, [s.stream for s in segments], dependencies(p, segments))
            for step in schedule.steps:
                for waited in step.waits:
                    index = (picture.boxes.index(box(picture, waited)), picture.boxes.index(box(picture, step.name)))
                    assert any((e.source, e.target) == index and "event" in e.hazards for e in picture.edges)
        events = sum("event" in e.hazards for e in picture.edges)
        assert events == 4 * 5  # per layer: res->mix, mix->ffn_res, mix->shared, ffn_res->ffn_out, shared->ffn_out

    def test_forks_and_joins_follow_the_schedule(self):
        picture = layout(plan("dsv4_mini_piecewise"))
        lanes = {lane.key: i for i, lane in enumerate(picture.lanes[0][1])}
        forks = {(s.from_lane, s.to_lane) for s in picture.syncs if s.kind == "fork"}
        joins = {(s.from_lane, s.to_lane) for s in picture.syncs if s.kind == "join"}
        s0, s1, s2 = lanes["s0"], lanes["s1"], lanes["s2"]
        # A region L{k}.res .. L{k+1}.pre starts on s1 and forks s0 and s2; it ends joining them back.
        assert forks == {(s1, s0), (s1, s2)}
        assert joins == {(s0, s1), (s2, s1)}

    def test_a_one_stream_plan_has_no_events(self):
        picture = layout(plan("toy"), expand=Expand.ALL)
        assert not picture.syncs and not any("event" in e.hazards for e in picture.edges)


class TestRegions:
    def test_piecewise_regions_are_boxed_and_repeated_ones_merged(self):
        picture = layout(plan("dsv4_61l_decode"))
        labels = sorted(r.label for r in picture.regions)
        # embed + L0.pre is R0; L{k}.res .. L{k+1}.pre is R{k+1}; L60.res .. head is R61.
        assert labels == sorted(["R0", "R{0..60}", "R{1..61}", "R61"])
        covered = {name for r in picture.regions for name in r.regions}
        assert covered == {r.name for r in plan("dsv4_61l_decode").regions(Mode.PIECEWISE)}

    def test_a_region_through_a_block_is_open_where_it_goes_on(self):
        picture = layout(plan("toy"))
        pre = next(r for r in picture.regions if r.label == "R{0..2}")
        post = next(r for r in picture.regions if r.label == "R{1..3}")
        assert (pre.open_left, pre.open_right) == (True, False)  # begun by the previous copy's post (or nothing)
        assert (post.open_left, post.open_right) == (False, True)

    def test_full_region_of_a_full_plan(self):
        picture = layout(plan("dsv4_mini_full"))
        assert {r.mode for r in picture.regions} == {Mode.FULL}
        assert {r.label for r in picture.regions} == {"FULL graph"}

    def test_a_plan_captured_both_ways_outlines_the_full_graph_too(self):
        picture = layout(plan("toy_full"))
        assert picture.full_outline
        assert {r.mode for r in picture.regions} == {Mode.PIECEWISE, Mode.FULL}

    def test_a_mode_the_plan_does_not_capture_says_so(self):
        picture = layout(plan("toy"), mode=Mode.FULL)
        assert picture.notes[0] == "the plan does not capture FULL: the boxes show how FULL would group the step"

    def test_mode_full_orders_the_step_as_one_graph(self):
        p = plan("toy_full")
        piecewise, full = layout(p), layout(p, mode=Mode.FULL)
        assert full.mode is Mode.FULL and not full.full_outline
        assert {r.mode for r in full.regions} == {Mode.FULL}
        assert len(piecewise.boxes) == len(full.boxes)


class TestCuts:
    """A segment cut at ``breaks``: PIECEWISE makes a graph per piece, the picture draws them."""

    def test_a_wildcard_cut_is_drawn_generically_and_counted_in_the_header(self, tmp_path):
        picture = layout(load_plan(ROOT / "examples" / "hf_llama" / "decode.yaml"))
        (cut,) = picture.cuts
        assert picture.boxes[cut.box].label == "decode" and cut.pieces is None
        assert cut.label == "graph pieces cut at model.layers.*.self_attn (eager)"
        assert "1 PIECEWISE region (1 cut into graph pieces)" in picture.header[1]
        assert "decode: graph pieces cut at model.layers.*.self_attn (eager), a graph per piece" in picture.notes
        assert "R0, cut at self_attn" in {r.label for r in picture.regions}
        draw(picture, str(tmp_path / "cut.svg"), ImageFormat.SVG)
        text = "".join(ET.parse(tmp_path / "cut.svg").getroot().itertext())
        assert "self_attn" in text and "…" in text and "one graph per piece where cut" in text

    def test_named_submodules_give_the_number_of_pieces(self):
        segment = Segment(name="step", kind=GRAPH, call="forward", breaks=("model.attn", "model.mlp"))
        picture = layout(Plan(name="named", segments=(segment,)))
        assert [(c.pieces, c.label) for c in picture.cuts] == [
            (3, "3 graph pieces, cut at model.attn, model.mlp (eager)")]

    def test_full_capture_is_not_cut(self):
        picture = layout(load_plan(ROOT / "examples" / "hf_llama" / "decode.yaml"), mode=Mode.FULL)
        assert picture.cuts == () and "cut" not in picture.header[1]


class TestCollapse:
    def test_61_copies_are_drawn_once(self):
        picture = layout(plan("dsv4_61l_decode"))
        ((block),) = picture.blocks
        assert (block.label, block.count) == ("L{0..60}", 61)
        assert len(picture.boxes) == 2 + 8  # embed, head and one copy of the layer
        assert box(picture, "L{0..60}.attn").members == tuple(f"L{i}.attn" for i in range(61))
        assert any("61 copies of one for_each block, drawn once (×61)" in n for n in picture.notes)

    def test_expand_draws_every_copy_of_a_small_plan(self):
        picture = layout(plan("dsv4_mini_piecewise"), expand=Expand.ALL)
        assert not picture.blocks
        assert len(picture.boxes) == 34
        assert picture.pixels[0] <= SCREEN_PIXELS[0]

    def test_layers_draw_the_chosen_copies_apart(self):
        picture = layout(plan("dsv4_61l_decode"), layers=parse_layers("30-31"))
        assert [(b.label, b.count) for b in picture.blocks] == [("L{0..29}", 30), ("L{32..60}", 29)]
        assert {"L30.attn", "L31.attn"} <= {b.label for b in picture.boxes}

    def test_copies_that_differ_are_drawn_apart(self):
        segments, origins = [], {}
        for i in range(6):
            for name, line, kind, channels in (("a", 10, GRAPH, ()), ("b", 11, EAGER, ("ar",) if i == 2 else ())):
                segments.append(Segment(f"L{i}.{name}", kind, name, reads=("x",) if name == "a" else (f"h{i}",),
                                        writes=(f"h{i}",) if name == "a" else ("x",), stream="s0",
                                        channels=channels))
                origins[f"segment:L{i}.{name}"] = Origin("p.yaml", line)
        p = Plan(name="p", streams=[Stream("s0", "cuda:0")], segments=segments, origins=origins,
                 channels=[Channel("ar", ChannelKind.ALL_REDUCE, "tp", 1, "target")])
        picture = layout(p)
        assert [(b.label, b.count) for b in picture.blocks] == [("L{0..1}", 2), ("L{3..5}", 3)]
        assert {"L2.a", "L2.b"} <= {b.label for b in picture.boxes}
        assert any(n.startswith("L2: differs from the other copies") for n in picture.notes)
        assert picture.real_edges() == set(p.dag().edges)

    def test_a_plan_without_origins_is_grouped_by_its_names(self):
        segments = [Segment(f"L{i}.{n}", GRAPH, n, reads=("x",), writes=("x",), stream="s0")
                    for i in range(5) for n in ("a", "b")]
        picture = layout(Plan(name="p", streams=[Stream("s0", "cuda:0")], segments=segments))
        assert [(b.label, b.count) for b in picture.blocks] == [("L{0..4}", 5)]


@pytest.fixture(scope="module")
def big():
    return layered_plan(2500)


class TestSizeCap:
    def test_a_10001_segment_plan_collapses_to_one_screen(self, big):
        assert len(big.segments) == 10_001
        picture = layout(big)
        assert [(b.label, b.count) for b in picture.blocks] == [("L{0..2499}", 2500)]
        width, height = picture.pixels
        assert width <= SCREEN_PIXELS[0] and height <= SCREEN_PIXELS[1]
        assert picture.real_edges() == set(big.dag().edges)

    def test_expanding_it_stops_at_the_cap_and_says_what_stayed_collapsed(self, big):
        picture = layout(big, expand=Expand.ALL)
        width, height = picture.pixels
        assert width <= MAX_PIXELS[0] and height <= MAX_PIXELS[1]
        (block,) = picture.blocks
        apart = 2500 - block.count
        assert 10 < apart < 2500
        assert picture.notes[0].startswith(f"{apart:,} of 2,500 copies drawn apart; the other {block.count:,} stay "
                                           f"collapsed to keep the picture within {MAX_PIXELS[0]} x {MAX_PIXELS[1]}")
        assert picture.real_edges() == set(big.dag().edges)

    def test_a_smaller_cap_is_kept_too(self, big):
        picture = layout(big, expand=Expand.ALL, max_pixels=(1600, 1200))
        assert picture.pixels[0] <= 1600 and picture.pixels[1] <= 1200

    def test_nothing_to_collapse_elides_the_tail(self):
        p = chain_plan(3000)
        picture = layout(p)
        width, height = picture.pixels
        assert width <= MAX_PIXELS[0] and height <= MAX_PIXELS[1]
        (elided,) = picture.elided
        assert len(picture.boxes) + elided.count == 3000
        assert (elided.first, elided.last) == (p.segments[len(picture.boxes)].name, p.segments[-1].name)
        assert any(n.startswith(f"{elided.count:,} segments (") and "not drawn" in n for n in picture.notes)
        assert picture.real_edges() == set(p.dag().edges)

    def test_the_drawn_png_has_the_layout_size(self, big, tmp_path):
        from PIL import Image

        picture = layout(big, expand=Expand.ALL)
        path = tmp_path / "big.png"
        draw(picture, str(path), ImageFormat.PNG)
        assert Image.open(path).size == picture.pixels


class TestFiles:
    def test_svg_keeps_text_as_text(self, tmp_path):
        path = tmp_path / "dag.svg"
        draw(layout(plan("dsv4_61l_decode")), str(path), ImageFormat.SVG)
        root = ET.parse(path).getroot()
        assert root.tag == "{http://www.w3.org/2000/svg}svg"
        texts = {"".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")}
        assert {"L{0..60}  ×61", "L{0..60}.attn", "embed", "head", "s0", "s1", "s2"} <= texts

    def test_svg_is_the_same_bytes_every_time(self, tmp_path):
        picture = layout(plan("toy"))
        draw(picture, str(tmp_path / "a.svg"), ImageFormat.SVG)
        draw(picture, str(tmp_path / "b.svg"), ImageFormat.SVG)
        assert (tmp_path / "a.svg").read_bytes() == (tmp_path / "b.svg").read_bytes()

    def test_tp_channel_users_are_tagged(self, tmp_path):
        picture = layout(plan("dsv4_tp_piecewise"))
        assert {b.label for b in picture.boxes if b.segment.channels} == {"L{0..3}.mix", "L{0..3}.ffn_out"}
        path = tmp_path / "tp.svg"
        draw(picture, str(path), ImageFormat.SVG)
        assert path.read_text().count("⇄ tp_ar") == 2


class TestParseLayers:
    def test_numbers_and_ranges(self):
        assert parse_layers("3") == {3}
        assert parse_layers("0,10-12") == {0, 10, 11, 12}

    @pytest.mark.parametrize("text", ["", "a", "3-", "5-3", "1,,2"])
    def test_malformed(self, text):
        with pytest.raises(ValueError, match="--layers"):
            parse_layers(text)


def test_the_layout_imports_neither_torch_nor_matplotlib():
    code = ("import sys; from graphflow.plan.loader import load_plan; from graphflow.view.picture import layout; "
            "layout(load_plan('plans/dsv4_mini_piecewise.yaml')); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'matplotlib'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
