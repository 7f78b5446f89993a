"""Charts and tables read true at a glance: checked on the altair spec and the frames."""

from __future__ import annotations

import base64
import json
import re
import sys
from typing import Any

import pandas as pd
import pytest
import vl_convert

from meshlab.notebook import activation_chart, charts
from meshlab.notebook.bench import bench_chart
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
    assert spec["encoding"]["x"]["title"] == "payload (MiB)"


def _every_kind_of_chart() -> list[charts.OfflineChart]:
    comms = pd.DataFrame([{"rank": r, "op": "all_reduce", "axis": "tp", "group": "[0-1]",
                           "count": 1, "bytes": 1024, "wire_bytes": 1024} for r in range(2)])
    plan_frame_ = pd.DataFrame({"layout": ["tp=8"], "part": ["params"], "gib": [60.0],
                                "usable_gib": [76.0]})
    bench = pd.DataFrame([{"rank": 0, "provider": p, "size": s, "median_ms": 1.0, "gbps": g,
                           "p20_ms": 0.9, "p80_ms": 1.1, "kernel": "rmsnorm", "mode": "fwd",
                           "dtype": "float32", "timer": t, "max_error": 0.0, "correct": True}
                          for p, g, t in (("triton", 2.0, "interpreter"),
                                          ("torch", 1.0, "cpu wall clock"))
                          for s in (256, 1024)])
    memory = pd.DataFrame([{"rank": r, "source": src, "params": 2**20, "grads": 2**20}
                           for r in range(2) for src in ("measured", "formula")])
    return [comms_chart(comms), charts.memory_chart(memory), timeline_chart(_timelines()),
            bench_chart(bench), plan_memory_chart(plan_frame_),
            plan_comm_chart(plan("llama3-8b", gpus=16, top=1).comm_frame())]


@pytest.mark.parametrize("version", ["5.8", "5.14"])  # JupyterLab 4.6 bundles a 5.x
def test_every_chart_renders_in_the_vega_lite_5_front_ends_draw_with(
        version: str, sequence_parallel_layouts: list[Any]) -> None:
    for chart in [*_every_kind_of_chart(),
                  activation_chart.activation_layout_chart(sequence_parallel_layouts)]:
        svg = vl_convert.vegalite_to_svg(chart.spec(), vl_version=version)
        assert svg.startswith("<svg") and "<text" in svg


def test_bundle_has_the_vega_lite_spec_and_the_svg() -> None:
    # the test shell every IPython test shares (a plain InteractiveShell.instance() here
    # would refuse the terminal one a later test's fixture starts)
    from IPython.testing import globalipapp

    globalipapp.start_ipython()
    chart = _every_kind_of_chart()[0]
    formatter = globalipapp.get_ipython().display_formatter
    assert formatter is not None
    data, metadata = formatter.format(chart)
    assert data[VEGALITE]["$schema"].endswith("/v5.json") and "datasets" in data[VEGALITE]
    assert data["image/svg+xml"].startswith("<svg")
    # JupyterLab adds a PNG to a chart output without one (the notebook reads as modified)
    assert base64.b64decode(data["image/png"]).startswith(b"\x89PNG")
    assert metadata[VEGALITE]["embed_options"]["actions"] is False  # no links off the page


def test_without_interactive_charts_the_bundle_is_the_svg_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(charts, "interactive", False)
    data, metadata = _every_kind_of_chart()[0]._repr_mimebundle_()
    assert VEGALITE not in data and data["image/svg+xml"].startswith("<svg") and not metadata
    assert "image/png" not in data


def test_without_vl_convert_a_chart_keeps_its_spec_and_names_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # found on a GPU machine whose carried wheels lacked vl-convert: a traceback per chart
    monkeypatch.setitem(sys.modules, "vl_convert", None)  # import raises ImportError
    data, _ = _every_kind_of_chart()[0]._repr_mimebundle_()
    assert "image/svg+xml" not in data and VEGALITE in data
    assert "pip install vl-convert-python" in data["text/plain"]


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


# -- charts that fit, stack as their legends read, and name their units --------------------------
# Built from real data: collectives traced (meshlab.measure.comms) and memory measured
# (meshlab.measure.memory) on
# a fake process group (torch's "fake" backend: this process plays each rank in turn, collectives
# return without peers), the activation layouts a real tensor + sequence parallel forward
# reports, and a real Triton kernel benchmarked in the interpreter (in a subprocess).

FAKE_PG = "torch.testing._internal.distributed.fake_pg"


def _as_fake_rank(rank: int, world_size: int, mesh: str, work: Any) -> Any:
    """``work(mesh)`` as ``rank`` of a fake ``world_size``-rank process group."""
    import torch.distributed as dist

    from meshlab.mesh import build, forget_built

    fake_pg = pytest.importorskip(FAKE_PG)
    if dist.is_initialized():
        pytest.skip("needs no process group already in this process")
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world_size)
    try:
        return work(build(mesh))
    finally:
        forget_built()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def traced_comms() -> pd.DataFrame:
    """What %%mesh --comms charts for a cell issuing collectives on tp, dp and the world."""
    import torch
    import torch.distributed as dist

    import meshlab.measure.comms
    from meshlab.mesh import MeshSpec
    from meshlab.notebook.tables.comms import comms_frame

    def cell(mesh: Any) -> list[Any]:
        meshlab.measure.comms.start()
        dist.all_reduce(torch.ones(128 * 1024), group=mesh["tp"].get_group())  # 512 KiB
        out = torch.empty(2 * 32 * 1024)
        dist.all_gather_into_tensor(out, torch.ones(32 * 1024), group=mesh["dp"].get_group())
        dist.all_reduce(torch.ones(4))  # 16 bytes: far too thin to draw beside 768 KiB
        return meshlab.measure.comms.stop()

    per_rank = {r: _as_fake_rank(r, 4, "dp=2 tp=2", cell) for r in range(4)}
    return comms_frame(per_rank, MeshSpec.parse("dp=2 tp=2"), 4)


@pytest.fixture(scope="module")
def measured_memory() -> dict[str, pd.DataFrame]:
    """%mesh memory's frames for a ZeRO-3 model after one step: kept on the device (beside
    the ZeRO-3 formula), and with parameters, gradients, states and activations offloaded."""
    from meshlab.measure.memory import activation_placement, measure
    from meshlab.models import ModelConfig, Transformer, local_batch
    from meshlab.notebook.tables.memory import memory_frame
    from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
    from meshlab.verify.compare import train

    def step(offload: bool) -> Any:
        def work(mesh: Any) -> pd.DataFrame:
            plan = ParallelPlan(data_parallel="zero3", offload_params=offload,
                                offload_activations=offload)
            model = parallelize(Transformer(ModelConfig()), mesh, plan)
            opt = build_optimizer(model, mesh, plan)
            batch = local_batch(step=0, batch=4, seq=16, vocab=256, rank=0, ranks=2)
            train(model, opt, [batch])
            report, saved = measure(model, opt), activation_placement(model, batch[0])
            whole = sum(p.numel() for p in Transformer(ModelConfig()).parameters())
            return memory_frame({r: report for r in range(2)}, params=whole, dp=2,
                                stage=None if offload else 3,
                                activations={r: saved for r in range(2)})
        return _as_fake_rank(0, 2, "dp=2", work)

    return {"kept": step(False), "offloaded": step(True)}


@pytest.fixture(scope="module")
def sequence_parallel_layouts() -> list[Any]:
    """What rank 0 of notebook 04's dp=2 tp=2 mesh reports for one forward under TP + SP."""
    from meshlab.measure.activation_layout import activation_layouts
    from meshlab.models import ModelConfig, Transformer, local_batch
    from meshlab.parallel import ParallelPlan, parallelize

    def work(mesh: Any) -> list[Any]:
        model = parallelize(Transformer(ModelConfig()), mesh,
                            ParallelPlan(data_parallel="zero3", sequence_parallel=True))
        tokens, _ = local_batch(step=0, batch=4, seq=16, vocab=256, rank=0, ranks=2)
        return activation_layouts(model, tokens)

    return list(_as_fake_rank(0, 4, "dp=2 tp=2", work))


BENCHED = '''
import os, pickle, sys
import torch
import triton
import triton.language as tl
import pandas as pd
from meshlab.kernels.bench import bench


@triton.jit
def _square(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x * x, mask=mask)


def forgot_the_relu(x):  # notebook 06's wrong kernel: relu(x)**2 without the relu
    y = torch.empty_like(x)
    _square[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256)
    return y


frames = {}
for rank in (0, 1):  # two ranks' rows, as each rank's bench returns them
    os.environ["RANK"] = str(rank)
    frames.setdefault("rmsnorm", []).append(bench("rmsnorm", sizes=[64, 1024]))
    frames.setdefault("wrong", []).append(bench(forgot_the_relu, lambda x: torch.relu(x) ** 2,
                                                sizes=[64, 1024], name="forgot_the_relu"))
with open(sys.argv[1], "wb") as f:
    pickle.dump({k: pd.concat(v, ignore_index=True) for k, v in frames.items()}, f)
'''


@pytest.fixture(scope="module")
def benched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pd.DataFrame]:
    """%mesh bench's frames on CPU ranks: rmsnorm (right) and notebook 06's forgotten ReLU
    (wrong), each in Triton's interpreter beside torch. In a fresh process: importing
    meshlab.kernels sets TRITON_INTERPRET, which must not leak into this one."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    folder = tmp_path_factory.mktemp("bench")
    script, out = folder / "bench_two_ranks.py", folder / "frames.pkl"
    script.write_text(BENCHED)  # @triton.jit reads its kernel's source from a file
    done = subprocess.run([sys.executable, str(script), str(out)], capture_output=True,
                          text=True, timeout=240, cwd=Path(__file__).parents[2],
                          env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    frames = pickle.loads(out.read_bytes())
    for name, frame in frames.items():  # as run_bench adds it
        fastest = frame.groupby(["provider", "size"])["median_ms"].transform("min")
        frames[name] = frame.assign(vs_fastest_rank=frame["median_ms"] / fastest)
    return frames


def _svg_width(chart: charts.OfflineChart) -> float:
    """The width the chart draws at, in px (vl-convert lays it out as the front ends do)."""
    import re

    return float(re.search(r'width="([\d.]+)"', chart.svg())[1])  # type: ignore[index]


def _rows(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for rows in spec["datasets"].values() for r in rows]


def test_comms_chart_is_a_row_per_rank_as_wide_as_the_output_area(
        traced_comms: pd.DataFrame) -> None:
    chart = comms_chart(traced_comms)
    spec = chart.chart.to_dict()
    assert spec["encoding"]["y"]["field"] == "rank" and spec["width"] == charts.WIDTH
    assert spec["height"] >= charts.ROW * 4
    assert 0.6 * charts.OUTPUT <= _svg_width(chart) <= charts.OUTPUT  # no sliver, no overflow


def test_comms_chart_stacks_collectives_in_the_legends_order(traced_comms: pd.DataFrame) -> None:
    spec = comms_chart(traced_comms).chart.to_dict()
    legend = spec["encoding"]["color"]["sort"]
    assert spec["encoding"]["order"] == {"field": "stack_index", "type": "quantitative"}
    stacked = sorted({(r["stack_index"], r["collective"]) for r in _rows(spec)})
    assert [c for _, c in stacked] == legend
    assert legend[0] == "all_reduce on tp"  # the most bytes first


def test_comms_chart_names_a_collective_too_thin_to_draw(traced_comms: pd.DataFrame) -> None:
    spec = comms_chart(traced_comms).chart.to_dict()
    assert "all_reduce on world (at most 16 B per rank: too thin to see)" in \
        spec["encoding"]["color"]["sort"]


def test_comms_chart_puts_byte_units_on_its_axis_and_tooltips(
        traced_comms: pd.DataFrame) -> None:
    spec = comms_chart(traced_comms).chart.to_dict()
    assert spec["encoding"]["x"]["title"] == "payload (KiB)"
    numbers = [t for t in spec["encoding"]["tooltip"] if t["type"] == "quantitative"]
    assert {t["title"] for t in numbers} == {"calls", "payload (KiB)",
                                            "sent on the wire (KiB)"}


def test_memory_chart_stacks_parts_in_the_legends_order(
        measured_memory: dict[str, pd.DataFrame]) -> None:
    spec = charts.memory_chart(measured_memory["kept"]).chart.to_dict()
    legend = spec["encoding"]["color"]["sort"]
    assert legend == ["params", "grads", "optimizer", "activations"]
    stacked = sorted({(r["stack_index"], r["part"]) for r in _rows(spec)})
    assert [p for _, p in stacked] == legend
    assert spec["encoding"]["order"]["field"] == "stack_index"


def test_memory_chart_fades_the_formula_and_names_it_only_when_there(
        measured_memory: dict[str, pd.DataFrame]) -> None:
    kept = charts.memory_chart(measured_memory["kept"]).chart.to_dict()
    # faded through an encoding of the data's own field: the aggregate keeps it
    assert kept["encoding"]["opacity"]["field"] == "source"
    assert kept["encoding"]["opacity"]["scale"] == {"domain": ["measured", "formula"],
                                                    "range": [1.0, 0.45]}
    assert "ZeRO-3 formula" in kept["title"]["subtitle"]
    assert "ZeRO-3 formula" in kept["encoding"]["y"]["sort"]  # its own row, named on the axis
    moved = charts.memory_chart(measured_memory["offloaded"]).chart.to_dict()
    assert "formula" not in json.dumps(moved["title"])  # no bar promised that is not drawn


def test_memory_chart_of_an_offloaded_model_shows_device_and_host_apart(
        measured_memory: dict[str, pd.DataFrame]) -> None:
    frame = measured_memory["offloaded"]
    spec = charts.memory_chart(frame).chart.to_dict()
    what, where = spec["vconcat"]
    assert where["encoding"]["color"]["sort"] == ["device", "host"]
    rows = [r for r in _rows(spec) if "place" in r]
    for rank in ("0", "1"):
        held = {r["place"]: r["bytes"] for r in rows if r["row"] == f"rank {rank}"}
        assert held == {"device": frame.loc[rank, "device"], "host": frame.loc[rank, "host"]}
        assert 0 < held["device"] < held["host"]  # the states and the blocks' activations moved
    assert what["encoding"]["color"]["sort"] == ["params", "grads", "optimizer", "activations"]
    assert spec["resolve"] == {"scale": {"color": "independent"}}  # two legends, two meanings


def test_memory_chart_without_offloading_says_so_and_shows_no_host_entry(
        measured_memory: dict[str, pd.DataFrame]) -> None:
    spec = charts.memory_chart(measured_memory["kept"]).chart.to_dict()
    assert "vconcat" not in spec and "host" not in json.dumps(spec["encoding"])
    assert "nothing offloaded" in spec["title"]["subtitle"]
    unit = spec["title"]["text"].removeprefix("memory per rank (").removesuffix(")")
    assert unit in ("KiB", "MiB") and spec["encoding"]["x"]["title"] == f"{unit} per rank"
    assert {t["title"] for t in spec["encoding"]["tooltip"] if t["type"] == "quantitative"} \
        == {unit, "bytes"}


def test_bench_table_is_one_row_per_provider_and_size_with_units_and_rounding(
        benched: dict[str, pd.DataFrame]) -> None:
    from meshlab.notebook.bench import bench_table

    frame = benched["rmsnorm"]
    table = bench_table(frame)
    assert len(frame) == 2 * 2 * 2 and len(table.frame) == 2 * 2  # ranks folded into rows
    assert table.frame[["provider (timer)", "row length"]].values.tolist() == [
        ["triton (interpreter)", 64], ["triton (interpreter)", 1024],
        ["torch (cpu wall clock)", 64], ["torch (cpu wall clock)", 1024]]
    assert {"fastest rank (ms)", "slowest rank (ms)", "GB/s (median rank)"} <= set(table.frame)
    text = table.text()
    assert text.startswith("rmsnorm · fwd · float32 · cpu  (interpreter rows: Triton's CPU "
                           "interpreter, not kernel speed)")
    body = text.splitlines()[2:6]
    decimals = [n for line in body for n in re.findall(r"\d*\.\d+", line)]
    assert decimals and all(len(n.replace(".", "").lstrip("0")) <= 3 for n in decimals), body
    assert all(" 1024 " in line or " 64 " in line for line in body)  # not 1.024k, not 1,024
    # the interpreter's GB/s is left out: an interpreter timing is not a bandwidth
    assert table.frame.loc[:1, "GB/s (median rank)"].isna().all()


def test_bench_table_says_where_a_kernel_was_wrong(benched: dict[str, pd.DataFrame]) -> None:
    from meshlab.notebook.bench import bench_table

    table = bench_table(benched["wrong"]).frame.set_index(["provider (timer)", "row length"])
    assert table.loc[("triton (interpreter)", 64), "check"] == "wrong result, every rank"
    assert table.loc[("torch (cpu wall clock)", 64), "check"] == "the reference, every rank"


def test_bench_chart_never_draws_the_interpreter_and_torch_on_one_axis(
        benched: dict[str, pd.DataFrame]) -> None:
    spec = bench_chart(benched["rmsnorm"]).chart.to_dict()
    panels = spec["hconcat"]
    assert [p["title"]["text"] for p in panels] == ["triton, in Triton's CPU interpreter",
                                                    "torch, eager on the CPU (wall clock)"]
    ys = [p["layer"][1]["encoding"]["y"] for p in panels]
    assert all(y["field"] == "median_ms" and y["title"].startswith("median time (ms")
               for y in ys)  # times, not GB/s: an interpreter's GB/s means nothing
    interpreted, eager = (y["scale"]["domain"] for y in ys)
    assert interpreted != eager  # each panel its own time axis
    for panel in panels:  # and its own rows only
        paths = {r["path"] for r in spec["datasets"][panel["data"]["name"]]}
        assert paths == {panel["title"]["text"]}


def test_bench_chart_draws_points_on_its_lines_and_sizes_as_integers(
        benched: dict[str, pd.DataFrame]) -> None:
    spec = bench_chart(benched["rmsnorm"]).chart.to_dict()
    lines, points = spec["hconcat"][0]["layer"]
    assert lines["mark"]["type"] == "line" and points["mark"]["type"] == "point"
    x = points["encoding"]["x"]
    assert x["axis"]["values"] == [64, 1024] and x["axis"]["format"] == "d"
    assert points["encoding"]["color"]["field"] == "rank"  # a line per rank, in its colour


def test_bench_chart_marks_a_wrong_kernel_with_a_black_cross(
        benched: dict[str, pd.DataFrame]) -> None:
    spec = bench_chart(benched["wrong"]).chart.to_dict()
    points = spec["hconcat"][0]["layer"][1]["encoding"]
    results = dict(zip(points["shape"]["scale"]["domain"], zip(
        points["shape"]["scale"]["range"], points["size"]["scale"]["range"],
        points["stroke"]["scale"]["range"], strict=True), strict=True))
    assert results["wrong result"] == ("cross", 280, "#000000")
    assert points["size"]["scale"]["type"] == "ordinal"  # a point scale would blur the sizes
    drawn = {r["result"] for r in _rows(spec)}
    assert drawn == {"wrong result", "the reference"}
    assert points["shape"]["legend"]["values"] == ["the reference", "wrong result"]
    assert "black cross: a wrong result (ranks 0-1, row length 64, 1024)" in spec["title"][
        "subtitle"]


def test_activation_layout_shows_the_sequence_split_between_the_tp_regions(
        sequence_parallel_layouts: list[Any]) -> None:
    frame = activation_chart.activation_layout_frame(sequence_parallel_layouts)
    held = {(r["input of"].split(" (")[0], r["rank"]): (r["layout"], r["positions"],
                                                       r["features"])
            for r in frame.to_dict("records")}
    # the norms hold half of the sequence each (sequence parallel)
    assert held["layers.0.attention_norm", 0] == ("split along the sequence", "0-7 of 16",
                                                  "0-63 of 64")
    assert held["layers.0.attention_norm", 1][1] == "8-15 of 16"
    # the attention gathers it whole; its row-parallel output projection takes half the features
    assert held["layers.0.attention", 1][0] == "whole on every rank"
    assert held["layers.0.attention.wq, wk, wv", 0][0] == "whole on every rank"
    assert held["layers.0.attention.wo", 1] == ("split along the features", "0-15 of 16",
                                                "32-63 of 64")
    assert held["layers.0.feed_forward.w2", 0][2] == "0-63 of 128"
    assert held["norm", 1][0] == "split along the sequence"
    assert not any(name.startswith("layers.1") for name, _ in held)  # one block stands for all


def test_activation_layout_chart_is_a_row_per_module_input_and_a_column_per_tp_rank(
        sequence_parallel_layouts: list[Any]) -> None:
    chart = activation_chart.activation_layout_chart(sequence_parallel_layouts)
    spec = chart.chart.to_dict()
    assert spec["facet"]["column"]["sort"] == ["rank 0 (tp 0)", "rank 1 (tp 1)"]
    assert spec["facet"]["row"]["sort"][1].startswith("layers.0.attention_norm")
    held = spec["spec"]["layer"][1]["encoding"]
    assert held["x"]["title"] == "sequence position"
    assert held["color"]["sort"] == ["split along the sequence", "whole on every rank",
                                     "split along the features"]
    assert any(t.get("title") == "this rank holds (KiB)" for t in held["tooltip"])
    assert _svg_width(chart) <= charts.OUTPUT


def test_every_chart_fits_the_output_area(
        traced_comms: pd.DataFrame, measured_memory: dict[str, pd.DataFrame],
        benched: dict[str, pd.DataFrame], sequence_parallel_layouts: list[Any]) -> None:
    drawn = {"comms": comms_chart(traced_comms),
             "memory": charts.memory_chart(measured_memory["offloaded"]),
             "bench": bench_chart(benched["rmsnorm"]),
             "wrong bench": bench_chart(benched["wrong"]),
             "activations": activation_chart.activation_layout_chart(sequence_parallel_layouts),
             "schedules": timeline_chart(_timelines()),
             "plan memory": plan_memory_chart(plan("llama3-8b", gpus=16, top=3).memory_frame()),
             "plan comms": plan_comm_chart(plan("llama3-8b", gpus=16, top=1).comm_frame())}
    widths = {name: _svg_width(chart) for name, chart in drawn.items()}
    assert all(500 <= w <= charts.OUTPUT for w in widths.values()), widths


def test_activation_layout_chart_is_true_to_its_data(
        sequence_parallel_layouts: list[Any]) -> None:
    # the chart functions' check (test_chart_legends.py), on a real forward's layouts
    from chart_truth import assert_axes_fit, assert_legends_true

    chart = activation_chart.activation_layout_chart(sequence_parallel_layouts)
    assert_legends_true(chart)
    assert_axes_fit(chart)
