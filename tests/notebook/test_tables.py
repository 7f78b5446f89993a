"""Every table the notebook shows names its units: bytes in the unit of the chart beside it,
times in s or ms, fractions as percentages; the frames behind them keep plain numbers. The
mesh table lists the axes a user asked for, not meshlab's internal views."""

from __future__ import annotations

import json

import pandas as pd

from meshlab.measure.memory import MemoryReport
from meshlab.mesh import MeshSpec
from meshlab.notebook.charts import byte_unit, memory_chart
from meshlab.notebook.tables.comms import comms_tables
from meshlab.notebook.tables.memory import memory_frame, memory_table
from meshlab.notebook.tables.plan import plan_table
from meshlab.notebook.tables.schedule import schedule_table
from meshlab.notebook.tables.status import status_table
from meshlab.notebook.tables.table import Table, in_byte_unit, percent
from meshlab.notebook.widgets import MeshView, group_table
from meshlab.plan.report import plan
from meshlab.schedules import Costs, build


def test_memory_table_shows_the_bytes_in_the_unit_of_its_chart() -> None:
    reports = {r: MemoryReport(params=106_816, grads=106_816, optimizer=213_632)
               for r in range(2)}
    frame = memory_frame(reports, params=53_408, dp=2, stage=3,
                         activations={0: (50_000, 0), 1: (50_000, 0)})
    table = memory_table(frame)
    chart = json.dumps(memory_chart(frame).spec())
    assert "KiB" in chart and "MiB" not in chart  # the chart's axis is in KiB
    assert table.caption.startswith("memory per rank (KiB)")
    assert list(table.frame.columns) == ["rank", "params (KiB)", "grads (KiB)",
                                         "optimizer (KiB)", "activations (KiB)", "total (KiB)",
                                         "device (KiB)", "host (KiB)"]
    assert table.frame.loc[0, "params (KiB)"] == 106_816 / 1024
    assert "104" in table.text().splitlines()[2]  # 106,816 B shown as 104 KiB
    assert frame.loc["0", "params"] == 106_816  # the frame a user computes with: bytes


def test_a_byte_column_stays_whole_below_a_kib() -> None:
    shown = in_byte_unit(pd.DataFrame({"bytes": [1000, 12]}), ["bytes"])
    assert shown.unit == "B" and list(shown.frame.columns) == ["bytes (B)"]
    assert Table(shown.frame, formats=shown.formats).text().split() == ["bytes", "(B)", "1,000",
                                                                          "12"]


def test_plan_table_shows_mfu_as_a_percentage_and_memory_in_its_charts_unit() -> None:
    found = plan("meshlab", gpus=1024, global_batch=1024, top=1)  # a tiny model on H100s
    text = plan_table(found).text()
    header = text.splitlines()[1]
    assert "MFU" in header and "memory (KiB)" in header and "step (ms)" in header
    mfu = found.best.mfu
    assert f"{percent(3)(mfu)}" in text and "%" in percent(3)(mfu)
    assert percent(3)(0.0000177) == "0.00177%" and percent(3)(0.517) == "51.7%"
    largest = found.best.memory["total"]
    assert byte_unit(largest)[0] == "KiB"
    assert found.table()["mfu"].iloc[0] == found.rows()[0]["mfu"]  # still a fraction there


def test_status_table_names_the_memory_unit_and_the_throttle_factor() -> None:
    frame = pd.DataFrame([
        {"rank": 0, "host": "a", "pid": 10, "device": "cpu", "rss_mb": 2560.0,
         "throttle": 1.0, "alive": True, "busy": False},
        {"rank": 1, "host": "a", "pid": 11, "device": "cpu", "rss_mb": 512.0,
         "throttle": 3.0, "alive": True, "busy": False},
        {"rank": 2, "host": "a", "pid": 12, "device": "?", "alive": False, "busy": False},
    ]).set_index("rank")
    text = status_table(frame).text()
    lines = text.splitlines()
    assert "rss (GiB)" in lines[0] and "rss_mb" not in text
    assert "2.5" in lines[1] and "x1" in lines[1] and "0.5" in lines[2] and "x3" in lines[2]
    assert "nan" not in lines[3].lower()  # a rank that did not answer: blanks


def test_comms_tables_show_payload_and_wire_bytes_in_one_unit() -> None:
    frame = pd.DataFrame([{"rank": r, "op": "all_reduce", "axis": "dp_shard", "group": "[0-1]",
                           "count": 2, "bytes": 3 * 2**20, "wire_bytes": 3 * 2**19}
                          for r in range(2)])
    per_rank, totals = comms_tables(frame)
    assert "payload (MiB)" in per_rank.text() and "on the wire (MiB)" in per_rank.text()
    row = per_rank.text().splitlines()[2].split()
    assert row[-2:] == ["3", "1.5"], row
    assert totals.frame.loc[0, "payload (MiB)"] == 6


def test_schedule_table_shows_the_bubble_as_a_percentage() -> None:
    timeline = build("gpipe", ranks=4, microbatches=8).simulate(Costs())
    text = schedule_table(pd.DataFrame([timeline.summary()]).set_index("schedule")).text()
    assert f"{timeline.bubble_fraction:.1%}" in text and "makespan (cost units)" in text


def test_a_plain_dp_mesh_lists_only_its_axis() -> None:
    table = group_table(MeshSpec.parse("dp=4"))
    assert list(table.index) == ["dp_shard"]
    assert set(MeshSpec.parse("dp=4").groups()) >= {"dp", "dp_shard_cp", "dp_cp"}  # in code


def test_views_that_group_the_ranks_differently_are_listed_with_what_they_span() -> None:
    hsdp = group_table(MeshSpec.parse("dp_replicate=2 dp=2"))
    assert list(hsdp.index) == ["dp_replicate", "dp_shard", "dp"]
    assert hsdp.loc["dp", "spans"] == "dp_replicate x dp_shard"
    with_cp = group_table(MeshSpec.parse("dp=2 cp=2"))
    assert list(with_cp.index) == ["dp_shard", "cp", "dp_shard_cp"]


def test_ep_meshes_show_dp_shard_and_ep_not_their_internal_split() -> None:
    spec = MeshSpec.parse("dp=4 ep=2")
    table = group_table(spec)
    assert list(table.index) == ["dp_shard", "ep"]
    assert table.loc["ep", "ranks"] == "[0-1]  [2-3]"
    view = MeshView(spec)
    assert "rank 3: dp_shard=3 ep=1" in repr(view)
    assert "dp_shard_mod_ep" not in view._repr_html_() and "(ep →, ep group ↓)" in \
        view._repr_html_()
