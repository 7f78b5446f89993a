"""What the sharding widget and the mesh view say, from reports built by hand (no ranks)."""

from __future__ import annotations

from pathlib import Path

from meshlab.measure.sharding import RankShard, ShardingReport
from meshlab.mesh import MeshSpec
from meshlab.notebook.palette import RANKS, contrast, rank_colour, text_colour
from meshlab.notebook.widgets import MeshView
from meshlab.notebook.widgets.sharding import ShardingView, render_html
from meshlab.notebook.widgets.sharding_layout import blocks, tensor_state


def report(name: str, placements: list[str], pieces: dict[int, tuple[list[int], list[int]]],
           shape: tuple[int, int] = (8, 6)) -> ShardingReport:
    """A float32 DTensor on a 2 x 2 mesh; ``pieces``: rank -> (local shape, offsets)."""
    return ShardingReport(
        name=name, kind="dtensor", global_shape=list(shape), dtype="float32",
        mesh_shape=[2, 2], mesh_axes=["dp", "tp"], placements=placements,
        shards=[RankShard(rank=r, coordinate=[r // 2, r % 2], local_shape=local,
                          offsets=offsets, bytes=4 * local[0] * local[1])
                for r, (local, offsets) in pieces.items()])


GRID = report("w", ["Shard(0)", "Shard(1)"], {0: ([4, 3], [0, 0]), 1: ([4, 3], [0, 3]),
                                              2: ([4, 3], [4, 0]), 3: ([4, 3], [4, 3])})
# Replicate() over dp, Shard(1) over tp: ranks 0,2 hold the left half, 1,3 the right
COLS = report("cols", ["Replicate()", "Shard(1)"], {0: ([8, 3], [0, 0]), 1: ([8, 3], [0, 3]),
                                                   2: ([8, 3], [0, 0]), 3: ([8, 3], [0, 3])})
def split_columns(ranks: int, cols: int = 1000) -> ShardingReport:
    """A [64, cols] tensor, Shard(1) over ``ranks`` ranks: blocks as thin as the ranks many."""
    width = -(-cols // ranks)
    return ShardingReport(
        name="thin", kind="dtensor", global_shape=[64, cols], dtype="float32",
        mesh_shape=[ranks], mesh_axes=["tp"], placements=["Shard(1)"],
        mesh_ranks=list(range(ranks)),
        shards=[RankShard(rank=r, coordinate=[r], local_shape=[64, min(width, cols - r * width)],
                          offsets=[0, r * width], bytes=4 * 64 * width) for r in range(ranks)])


PARTIAL = report("partial", ["Partial(sum)", "Replicate()"],
                 {r: ([4, 4], [0, 0]) for r in range(4)}, shape=(4, 4))


def test_a_rank_has_one_colour_in_every_tensor() -> None:
    seen: dict[int, set[str]] = {}
    for r in (GRID, COLS, PARTIAL):
        for b in blocks(r, (0, 1)):
            for rank, colour in zip(b["ranks"], b["colors"], strict=True):
                seen.setdefault(rank, set()).add(colour)
    assert seen == {r: {rank_colour(r)} for r in range(4)}


def test_a_replicated_block_is_one_colour_with_its_ranks_in_a_band_along_the_top() -> None:
    left = next(b for b in blocks(COLS, (0, 1)) if b["ranks"] == [0, 2])
    assert left["replicated"] and left["fill"] == {"background-color": rank_colour(0)}
    assert [s["background-color"] for s in left["band"]] == [rank_colour(0), rank_colour(2)]
    assert {s["width"] for s in left["band"]} == {"50.00%"}  # equal segments
    assert all(s["height"] == "4px" and s["top"] == "0" for s in left["band"])
    # the word is on the block, not only in a tooltip
    assert [line["text"] for line in left["lines"]] == ["[ranks 0,2]", "rows 0-7 · cols 0-2",
                                                        "replicated"]
    assert "linear-gradient" not in ShardingView(COLS)._repr_html_()


def test_labels_read_at_4_5_to_1_on_every_rank_colour() -> None:
    for colour in RANKS:
        assert contrast(colour, text_colour(colour)) >= 4.5, colour
    for b in blocks(GRID, (0, 1)) + blocks(COLS, (0, 1)):
        assert contrast(b["color"], b["text"]) >= 4.5


def test_partial_blocks_are_hatched_without_the_background_shorthand() -> None:
    (b,) = blocks(PARTIAL, (0, 1))
    assert b["partial"] and "repeating-linear-gradient" in b["fill"]["background-image"]
    assert "repeating-linear-gradient" not in blocks(GRID, (0, 1))[0]["fill"].get(
        "background-image", "")
    html = ShardingView(PARTIAL)._repr_html_()
    assert "repeating-linear-gradient" in html and "background:#" not in html
    # the shorthand would reset the hatch the widget sets beside it
    js = (Path(__file__).parents[2] / "meshlab/notebook/widgets/sharding.js").read_text()
    assert "background:" not in js.replace(" ", "")


def test_blocks_say_their_rows_and_columns() -> None:
    ranges = {b["label"]: b["ranges"] for b in blocks(GRID, (0, 1))}
    assert ranges["[rank 1]"] == "rows 0-3 · cols 3-5"
    assert ranges["[rank 2]"] == "rows 4-7 · cols 0-2"


def test_the_text_form_lists_every_block_for_a_log() -> None:
    text = repr(ShardingView(GRID))
    assert text.splitlines()[0] == ("w [8, 6] float32 · Shard(0), Shard(1) on mesh [2, 2] "
                                    "(dp, tp)")
    assert "  rows 0-3 · cols 3-5: rank 1 · local [4, 3], 48 B each" in text
    assert "partial: pending reduction" in repr(ShardingView(PARTIAL))
    bundle = ShardingView(COLS)._repr_mimebundle_()
    data = bundle[0] if isinstance(bundle, tuple) else bundle
    assert "ranks 0,2 · local [8, 3]" in data["text/plain"] and "replicated" in data["text/plain"]


def test_the_mesh_caption_names_only_the_directions_it_has() -> None:
    assert "<small>(pp →)</small>" in MeshView(MeshSpec.parse("pp=4"))._repr_html_()
    assert "<small>(tp →, dp_shard ↓)</small>" in MeshView(
        MeshSpec.parse("dp=2 tp=2"))._repr_html_()


def test_narrow_blocks_turn_their_short_labels_upright_and_list_the_rest_below() -> None:
    drawn = blocks(split_columns(16))
    assert (drawn[0]["fit"], drawn[10]["fit"], drawn[15]["fit"]) == (
        "short", "upright", "small upright")  # r0 fits across; r10 upright; r15 is thinner
    r10 = drawn[10]
    (line,) = r10["lines"]
    assert line["text"] == "r10" and line["style"]["writing-mode"] == "vertical-rl"
    assert r10["key"]["text"] == "rank 10 · rows 0-63 · cols 630-692"
    assert r10["key"]["swatch"]["background-color"] == r10["color"]
    html = ShardingView(split_columns(16))._repr_html_()
    assert all(b["key"]["text"] in html for b in drawn)
    assert "overflow:hidden" not in html and "overflow:visible" in html


def test_a_block_too_small_for_any_text_says_everything_in_the_key() -> None:
    drawn = blocks(split_columns(100))
    assert all(b["fit"] == "none" and b["lines"] == [] for b in drawn)
    state = tensor_state(split_columns(100))
    assert [k["text"] for k in state["parts"][0]["key"]][:2] == [
        "rank 0 · rows 0-63 · cols 0-9", "rank 1 · rows 0-63 · cols 10-19"]


def test_a_wide_block_shows_its_ranks_ranges_and_note_with_no_key() -> None:
    for b in blocks(GRID, (0, 1)) + blocks(COLS, (0, 1)):
        assert b["fit"] == "full" and b["key"] is None, b["label"]
        assert [line["class"] for line in b["lines"]][:2] == ["meshlab-label", "meshlab-range"]


def test_the_html_fallback_draws_the_widgets_blocks_without_javascript() -> None:
    view = ShardingView(COLS)
    html = view._repr_html_()
    assert "<script" not in html and "class='meshlab-block replicated'" in html
    for b in view.tensor["blocks"]:  # the very styles the widget's front end applies
        style = "".join(f"{k}:{v};" for k, v in b["style"].items())
        assert f"data-ranks='{b['data_ranks']}' " in html and style in html
        assert all(line["text"] in html for line in b["lines"])
    assert render_html({}, [], {}) == ("<div class='meshlab-sharding' "
                                       "style='font:12px/1.4 sans-serif'></div>")


def test_partial_blocks_say_pending_reduction_not_replicated() -> None:
    (b,) = blocks(PARTIAL, (0, 1))
    assert not b["replicated"] and b["note"] == "partial: pending reduction"
    assert "partial: pending reduction" in [line["text"] for line in b["lines"]]


def test_hover_lines_keep_the_meshs_axis_order_through_a_saved_notebook() -> None:
    """A saved notebook's JSON sorts an object's keys (nbformat writes sort_keys): the
    coordinates travel as pairs, so the reopened hover reads pp, dp_shard, tp as before."""
    import json

    placed = ShardingReport(
        name="w", kind="dtensor", global_shape=[4, 4], dtype="float32", mesh_shape=[2],
        mesh_axes=["tp"], placements=["Shard(0)"],
        shards=[RankShard(rank=r, coordinate=[r], local_shape=[2, 4], offsets=[2 * r, 0],
                          bytes=32, place={"pp": 1, "dp_shard": 0, "tp": r})
                for r in range(2)])
    saved = json.loads(json.dumps(tensor_state(placed), sort_keys=True))
    places = [s["place"] for b in saved["blocks"] for s in b["detail"]]
    assert places == [[["pp", 1], ["dp_shard", 0], ["tp", r]] for r in range(2)]
    js = (Path(__file__).parents[2] / "meshlab/notebook/widgets/sharding.js").read_text()
    assert "s.place.map(" in js and "Object.entries(s.place)" not in js


def test_a_module_view_saves_every_rows_drawing_for_a_notebook_without_its_kernel() -> None:
    from meshlab.measure.sharding import ModuleReport

    view = ShardingView(ModuleReport(name="mlp", tensors=[GRID, COLS, PARTIAL]))
    assert [t["name"] for t in view.tensors] == ["w", "cols", "partial"]
    assert view.tensor == view.tensors[0]
    view.selected = 2  # what the kernel draws on a click is what the saved state holds
    assert view.tensor == view.tensors[2] == tensor_state(PARTIAL)
    js = (Path(__file__).parents[2] / "meshlab/notebook/widgets/sharding.js").read_text()
    assert 'model.set("tensor", tensors[i])' in js  # the front end draws it with no kernel
