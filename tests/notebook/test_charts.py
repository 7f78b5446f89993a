"""Charts and tables read true at a glance: checked on the altair spec and the frames."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import vl_convert

from meshlab.notebook import charts
from meshlab.notebook.charts import (
    VEGALITE,
    comms_chart,
    plan_comm_chart,
    plan_memory_chart,
    timeline_chart,
)
from meshlab.notebook.stepping import compare, grid_frame, plan_frame
from meshlab.notebook.tables.comms import comms_by_ranks, comms_tables
from meshlab.notebook.tables.table import Lines, sig
from meshlab.plan.report import plan
from meshlab.schedules import Costs, build


def _timelines() -> pd.DataFrame:
    schedules = [build("gpipe", ranks=4, microbatches=8),
                 build("zb_h1", ranks=4, microbatches=8),
                 build("interleaved_1f1b", ranks=4, microbatches=8, virtual=2)]
    return plan_frame(compare(schedules, Costs())[0])


def test_compared_schedules_share_one_time_axis() -> None:
    spec = timeline_chart(_timelines()).chart.to_dict()
    assert "resolve" not in spec  # one x scale: ZB-H1 draws shorter than GPipe


def test_panels_in_different_units_keep_their_own_axes() -> None:
    grid = grid_frame(build("1f1b", ranks=2, microbatches=2)).assign(view="grid", unit="slots")
    ms = grid.assign(view="measured", unit="ms", start=grid["start"] * 3, end=grid["end"] * 3)
    spec = timeline_chart(pd.concat([grid, ms])).chart.to_dict()
    assert spec["resolve"] == {"scale": {"x": "independent"}}


def test_a_ranks_second_chunk_is_primed_and_in_the_tooltip() -> None:
    spec = timeline_chart(_timelines()).chart.to_dict()
    rows = next(iter(spec["datasets"].values()))
    second = [r for r in rows if r["view"].startswith("interleaved") and r["chunk"] == 1]
    assert second and all(r["label"] == f"{r['microbatch']}'" for r in second)
    bars = spec["spec"]["layer"][0]["encoding"]["tooltip"]
    assert {"field": "chunk", "type": "quantitative"} in bars
    assert "second chunk" in spec["title"]["subtitle"]


def test_labels_are_drawn_only_on_bars_wide_enough_for_them() -> None:
    spec = timeline_chart(_timelines()).chart.to_dict()
    text = next(layer for layer in spec["spec"]["layer"] if layer["mark"]["type"] == "text")
    assert text["transform"] == [{"filter": "(datum.width_px >= datum.label_px)"}]
    rows = next(iter(spec["datasets"].values()))
    interleaved_f = [r for r in rows if r["view"].startswith("interleaved") and r["kind"] == "F"]
    assert all(r["width_px"] < r["label_px"] for r in interleaved_f)  # half-unit bars: none


def test_pending_slots_are_outlined_with_black_labels_and_no_opacity() -> None:
    grid = grid_frame(build("1f1b", ranks=2, microbatches=2))
    grid = grid.assign(state=["done" if s < 2 else "pending" for s in grid["slot"]])
    spec = timeline_chart(grid).chart.to_dict()
    assert "opacity" not in json.dumps(spec)
    pending = next(layer for layer in spec["layer"]
               if layer.get("transform") == [{"filter": "(datum.state === 'pending')"}])
    assert pending["mark"]["fill"] == "white" and "stroke" in pending["encoding"]
    rows = next(iter(spec["datasets"].values()))
    assert {r["text_fill"] for r in rows if r["state"] == "pending"} == {"#000000"}


def test_a_tiny_models_memory_is_drawn_in_kib_without_the_80_gib_rule() -> None:
    frame = pd.DataFrame({"layout": ["dp=2"] * 2, "part": ["params", "grads"],
                          "gib": [0.0004, 0.0005], "usable_gib": [80.0, 80.0]})
    spec = plan_memory_chart(frame).chart.to_dict()
    assert spec["layer"][0]["encoding"]["x"]["title"] == "KiB per GPU"
    assert len(spec["layer"]) == 1 and "far off this scale" in spec["title"]
    assert spec["layer"][0]["encoding"]["x"]["axis"]["format"] == ",.3~r"


def test_memory_on_the_usable_scale_keeps_the_rule() -> None:
    frame = pd.DataFrame({"layout": ["tp=8"], "part": ["params"], "gib": [60.0],
                          "usable_gib": [76.0]})
    spec = plan_memory_chart(frame).chart.to_dict()
    assert len(spec["layer"]) == 2 and spec["layer"][1]["mark"]["type"] == "rule"


def test_exposed_and_overlapped_are_colours_the_legend_shows() -> None:
    frame = plan("llama3-8b", gpus=16, top=1).comm_frame()
    spec = plan_comm_chart(frame).chart.to_dict()
    assert "opacity" not in spec["encoding"]
    assert spec["encoding"]["color"]["field"] == "kind"
    assert spec["encoding"]["x"]["title"].endswith("per step")


def test_comms_chart_axis_names_its_byte_unit() -> None:
    frame = pd.DataFrame([{"rank": r, "op": "all_reduce", "axis": "tp", "group": "[0-1]",
                           "count": 1, "bytes": 3 * 2**20, "wire_bytes": 3 * 2**20}
                          for r in range(2)])
    spec = comms_chart(frame).chart.to_dict()
    assert spec["encoding"]["y"]["title"] == "payload (MiB)"


def _every_kind_of_chart() -> list[charts.OfflineChart]:
    comms = pd.DataFrame([{"rank": r, "op": "all_reduce", "axis": "tp", "group": "[0-1]",
                           "count": 1, "bytes": 1024, "wire_bytes": 1024} for r in range(2)])
    plan_frame_ = pd.DataFrame({"layout": ["tp=8"], "part": ["params"], "gib": [60.0],
                                "usable_gib": [76.0]})
    bench = pd.DataFrame([{"rank": 0, "provider": p, "size": s, "median_ms": 1.0, "gbps": g,
                           "kernel": "rmsnorm", "timer": "interpreter",
                           "correct": True} for p, g in (("triton", 2.0), ("torch", 1.0))
                          for s in (256, 1024)])
    memory = pd.DataFrame([{"rank": r, "source": src, "params": 2**20, "grads": 2**20}
                           for r in range(2) for src in ("measured", "formula")])
    return [comms_chart(comms), charts.memory_chart(memory), timeline_chart(_timelines()),
            charts.bench_chart(bench), plan_memory_chart(plan_frame_),
            plan_comm_chart(plan("llama3-8b", gpus=16, top=1).comm_frame())]


@pytest.mark.parametrize("version", ["5.8", "5.14"])  # JupyterLab 4.6 bundles a 5.x
def test_every_chart_renders_in_the_vega_lite_5_front_ends_draw_with(version: str) -> None:
    for chart in _every_kind_of_chart():
        svg = vl_convert.vegalite_to_svg(chart.spec(), vl_version=version)
        assert svg.startswith("<svg") and "<text" in svg


def test_bundle_has_the_vega_lite_spec_and_the_svg() -> None:
    from IPython.core.interactiveshell import InteractiveShell

    chart = _every_kind_of_chart()[0]
    data, metadata = InteractiveShell.instance().display_formatter.format(chart)
    assert data[VEGALITE]["$schema"].endswith("/v5.json") and "datasets" in data[VEGALITE]
    assert data["image/svg+xml"].startswith("<svg")
    assert metadata[VEGALITE]["embed_options"]["actions"] is False  # no links off the page


def test_without_interactive_charts_the_bundle_is_the_svg_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(charts, "interactive", False)
    data, metadata = _every_kind_of_chart()[0]._repr_mimebundle_()
    assert VEGALITE not in data and data["image/svg+xml"].startswith("<svg") and not metadata


def test_identical_ranks_share_one_row_of_the_comms_table() -> None:
    rows = [{"rank": r, "op": "all_reduce", "axis": "tp", "group": g, "count": 1,
             "bytes": 1024, "wire_bytes": 1024}
            for r, g in ((0, "[0-1]"), (1, "[0-1]"), (2, "[2-3]"), (3, "[2-3]"))]
    rows.append({"rank": 3, "op": "all_gather", "axis": "world", "group": "[0-3]",
                 "count": 1, "bytes": 64, "wire_bytes": 48})
    table = comms_by_ranks(pd.DataFrame(rows))
    assert table[["ranks", "op"]].values.tolist() == [
        ["0-2", "all_reduce"], ["3", "all_reduce"], ["3", "all_gather"]]
    _, totals = comms_tables(pd.DataFrame(rows))
    assert totals.caption and "totals" in totals.text().splitlines()[0]
    assert not totals.index and "\n0 " not in totals.text()  # no bare 0..n index


def test_numbers_read_rounded_and_summaries_wrap_between_words() -> None:
    three = sig(3)
    assert [three(x) for x in (593.413877, 311000.0, 22864672)] == ["593", "311,000",
                                                                     "22,900,000"]
    html = Lines("step 43.2 s, 310,828 tokens/s")._repr_html_()
    assert "word-break: normal" in html and "310,828\u00a0tokens/s" in html
    assert plan("llama3-8b", gpus=16, top=1).table()["tokens_per_s"].dtype.kind == "i"
