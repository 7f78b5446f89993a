"""Collective tracing: every collective a cell issued, with its group and computed bytes."""

from __future__ import annotations

from typing import Any

import pytest

from meshlab import Cluster
from meshlab.measure.comms import collective_name, wire_bytes
from meshlab.notebook.tables.comms import comms_frame, comms_totals


@pytest.mark.parametrize("func, op", [
    ("c10d.allreduce_", "all_reduce"), ("c10d._allgather_base_", "all_gather"),
    ("c10d._reduce_scatter_base_", "reduce_scatter"), ("c10d.alltoall_base_", "all_to_all"),
    ("_c10d_functional.all_gather_into_tensor", "all_gather"),
    ("_c10d_functional.reduce_scatter_tensor", "reduce_scatter"),
    ("c10d.broadcast_", "broadcast"), ("c10d.recv_", "recv"), ("c10d.barrier", "barrier"),
    ("_c10d_functional.wait_tensor", None),
])
def test_dispatcher_ops_map_to_collectives(func: str, op: str | None) -> None:
    assert collective_name(func) == op


def test_ring_estimates_follow_the_algorithmic_factors() -> None:
    assert wire_bytes("all_reduce", 1000, 4) == 1500  # 2(n-1)/n
    assert wire_bytes("all_gather", 1000, 4) == 750  # (n-1)/n
    assert wire_bytes("send", 1000, 2) == 1000 and wire_bytes("all_reduce", 1000, 1) == 0


CELL = """
from torch.distributed.tensor import distribute_tensor, Shard, Replicate
x = torch.ones(256)                                   # 1 KiB
dist.all_reduce(x)                                    # world
dist.all_reduce(x, group=mesh["tp"].get_group())      # tp
out = torch.empty(4 * 64)
dist.all_gather_into_tensor(out, torch.ones(64))      # 1 KiB gathered
dt = distribute_tensor(torch.ones(8, 8), mesh, [Shard(0), Shard(1)])
full = dt.redistribute(mesh, [Replicate(), Replicate()])
"""


@pytest.mark.cluster
def test_comms_trace_counts_bytes_and_axes(cluster: Cluster) -> None:
    cluster.init_mesh("dp=2 tp=2")
    result = cluster.run(CELL, comms=True)
    frame = comms_frame(result.comms, cluster.mesh_spec, cluster.world_size)
    rank0 = frame[frame["rank"] == 0].set_index(["op", "axis"])
    assert rank0.loc[("all_reduce", "world"), ["count", "bytes", "wire_bytes"]].tolist() == \
        [1, 1024, 1536]
    assert rank0.loc[("all_reduce", "tp"), ["count", "bytes"]].tolist() == [1, 1024]
    assert rank0.loc[("all_gather", "world"), "bytes"] == 1024
    # the redistribute: all-gathers over tp then dp (8x8 floats assembled from 4x4 pieces)
    assert {"dp_shard", "tp"} <= set(frame[frame["op"] == "all_gather"]["axis"])
    assert set(frame["rank"]) == {0, 1, 2, 3}
    totals = comms_totals(frame).set_index(["op", "axis"])
    assert totals.loc[("all_reduce", "world"), "count"] == 4  # once on each rank


@pytest.mark.cluster
def test_comms_cell_in_the_notebook_shows_tables_and_a_chart(shell: Any) -> None:
    from IPython.utils.capture import capture_output

    shell.run_line_magic("mesh", "init dp=2 tp=2")
    with capture_output() as cap:
        assert shell.run_cell("%%mesh --comms\ndist.all_reduce(torch.ones(4))").success
    per_rank, totals, chart = cap.outputs[-3:]
    assert "all_reduce" in per_rank.data["text/plain"] and "world" in totals.data["text/plain"]
    svg = chart.data["image/svg+xml"]  # drawn offline, with the collective and axis named
    assert svg.startswith("<svg") and "all_reduce" in svg and "world" in svg


@pytest.mark.cluster
def test_tracing_stops_after_the_cell(cluster: Cluster) -> None:
    cluster.run("dist.all_reduce(torch.ones(1))", comms=True)
    assert cluster.run("dist.all_reduce(torch.ones(1))").comms == {}
    assert cluster.run("import meshlab.measure.comms\n"
                       "meshlab.measure.comms._active is None").results() == \
        "Out[ranks 0-3]: True"


def test_charts_render_to_svg_here_without_fetching_anything() -> None:
    import pandas as pd

    from meshlab.notebook.charts import comms_chart

    frame = pd.DataFrame([{"rank": 0, "op": "all_reduce", "axis": "tp", "group": "[0-1]",
                           "count": 1, "bytes": 1024, "wire_bytes": 1024}])
    svg = comms_chart(frame).svg()
    assert svg.startswith("<svg") and "all_reduce on tp" in svg
    assert "<script" not in svg
