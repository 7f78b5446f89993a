"""The activations' layout over tensor parallelism, drawn: which part of the sequence and of
the features each tp rank holds at each module's input (``meshlab.measure.activation_layout``
records it on the ranks during one forward)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import altair as alt
import pandas as pd

from meshlab.notebook.charts import ROW, WIDTH, OfflineChart, byte_unit, chart_legend

LAYOUT_COLOURS = {"split along the sequence": "#4e79a7", "whole on every rank": "#9c9c9c",
                  "split along the features": "#e15759", "partial sums (a reduction pending)":
                  "#edc948"}


def _layout_kind(placement: str, ndim: int) -> str:
    """A placement on the tp axis in words, for an activation laid out (batch, sequence,
    features)."""
    if placement == "Shard(1)" and ndim >= 2:
        return "split along the sequence"
    if placement in (f"Shard({ndim - 1})", "Shard(-1)") and ndim >= 3:
        return "split along the features"
    if placement.startswith("Replicate"):
        return "whole on every rank"
    if placement.startswith("Partial"):
        return "partial sums (a reduction pending)"
    return placement


def activation_layout_frame(reports: Sequence[Any], axis: str = "tp") -> pd.DataFrame:
    """One row per (module input, rank) from
    ``meshlab.measure.activation_layout.activation_layouts``:
    the slice of the sequence (dim 1) and of the features (the last dim) the rank holds, the
    placement on ``axis`` in words. Sibling modules in a row with the same input layout (q, k
    and v) share one row."""
    groups: list[list[Any]] = []
    for report in reports:
        last = groups[-1][-1] if groups else None
        if last is not None and (report.name.rpartition(".")[0] == last.name.rpartition(".")[0]
                                 and "." in report.name and report.global_shape ==
                                 last.global_shape and report.placements == last.placements):
            groups[-1].append(report)
        else:
            groups.append([report])
    rows = []
    for order, group in enumerate(groups):
        first = group[0]
        shape = list(first.global_shape)
        names = [first.name] + [r.name.rpartition(".")[2] for r in group[1:]]
        label = f"{', '.join(names)} ({'x'.join(map(str, shape))})"
        at = list(first.mesh_axes).index(axis) if axis in first.mesh_axes else 0
        placement = first.placements[at] if first.placements else "Replicate()"
        seq, feat = (shape[1], shape[-1]) if len(shape) >= 3 else (shape[-1], 1)
        for shard in first.shards:
            offsets, local = list(shard.offsets), list(shard.local_shape)
            s0 = offsets[1] if len(shape) >= 2 else 0
            s1 = s0 + (local[1] if len(shape) >= 2 else seq)
            f0 = offsets[-1] if len(shape) >= 3 else 0
            f1 = f0 + (local[-1] if len(shape) >= 3 else feat)
            rows.append({"order": order, "input of": label, "rank": int(shard.rank),
                         "column": f"rank {shard.rank} ({axis} {shard.coordinate[at]})"
                                   if shard.coordinate else f"rank {shard.rank}",
                         "placement": placement, "layout": _layout_kind(placement, len(shape)),
                         "seq_start": s0, "seq_end": s1, "seq_len": seq,
                         "feat_start": f0 / feat, "feat_end": f1 / feat,
                         "positions": f"{s0}-{s1 - 1} of {seq}" if s1 > s0 else "none",
                         "features": f"{f0}-{f1 - 1} of {feat}" if f1 > f0 else "none",
                         "global_shape": " x ".join(map(str, shape)),
                         "local_shape": " x ".join(map(str, local)), "bytes": shard.bytes})
    return pd.DataFrame(rows)


def activation_layout_chart(reports: Sequence[Any], *, axis: str = "tp") -> OfflineChart:
    """Where each rank's part of the activations lies at each module's input (the records
    ``activation_layouts`` makes on a rank): a row per module input in forward order, a
    column per rank of the ``axis`` group; each cell is the whole activation, its sequence
    across and its features down, the rank's part filled and coloured by its layout."""
    data = activation_layout_frame(reports, axis)
    unit, size = byte_unit(float(data["bytes"].max()) if len(data) else 0)
    data = data.assign(amount=data["bytes"] / size)
    rows = list(dict.fromkeys(data.sort_values("order")["input of"]))
    columns = list(dict.fromkeys(data.sort_values("rank")["column"]))
    kinds = [k for k in LAYOUT_COLOURS if k in set(data["layout"])]
    kinds += sorted(set(data["layout"]) - set(kinds))
    scale = alt.Scale(domain=kinds, range=[LAYOUT_COLOURS.get(k, "#b07aa1") for k in kinds])
    seq = int(data["seq_len"].max()) if len(data) else 1
    ticks = sorted({0, seq, *data["seq_start"].astype(int), *data["seq_end"].astype(int)})
    x = alt.X("seq_start:Q", title="sequence position", scale=alt.Scale(domain=[0, seq],
                                                                       nice=False),
              axis=alt.Axis(values=ticks, format="d", labelOverlap="greedy"))
    y = alt.Y("feat_start:Q", title=None, scale=alt.Scale(domain=[0, 1], reverse=True),
              axis=None)
    whole = alt.Chart().mark_rect(fill="#f4f4f4", stroke="#bdbdbd", strokeWidth=0.5).encode(
        x=alt.X("zero:Q", scale=alt.Scale(domain=[0, seq], nice=False),
                title="sequence position"),
        x2="seq_len:Q", y=alt.Y("zero:Q", scale=alt.Scale(domain=[0, 1], reverse=True),
                                axis=None), y2="one:Q")
    tooltip = [alt.Tooltip("input of:N"), alt.Tooltip("column:N", title="rank"),
               alt.Tooltip("placement:N", title=f"placement on {axis}"),
               alt.Tooltip("layout:N"), alt.Tooltip("global_shape:N", title="whole shape"),
               alt.Tooltip("local_shape:N", title="this rank's shape"),
               alt.Tooltip("positions:N", title="sequence positions held"),
               alt.Tooltip("features:N", title="features held"),
               alt.Tooltip("amount:Q", title=f"this rank holds ({unit})", format=",.3~r")]
    held = alt.Chart().mark_rect(stroke="white", strokeWidth=0.5).encode(
        x=x, x2="seq_end:Q", y=y, y2="feat_end:Q", tooltip=tooltip,
        color=alt.Color("layout:N", scale=scale, sort=kinds,
                        legend=chart_legend(f"the {axis} rank's part", orient="bottom",
                                       direction="horizontal", columns=2)))
    width = max(120, min(280, WIDTH // max(1, len(columns))))
    cells = alt.layer(whole, held, data=data.assign(zero=0, one=1)).properties(
        width=width, height=ROW)
    chart = cells.facet(
        row=alt.Row("input of:N", sort=rows, title=None, header=alt.Header(
            labelAngle=0, labelAlign="left", labelOrient="left", labelLimit=0,
            labelFontSize=11)),
        column=alt.Column("column:N", sort=columns, title=None, header=alt.Header(
            labelFontWeight="bold", labelFontSize=11)),
        spacing={"row": 4, "column": 12})
    return OfflineChart(chart.properties(title=alt.TitleParams(
        f"which part of each activation every {axis} rank holds, at the input of each module",
        subtitle=["one forward, modules in the order it runs them; a repeated block is "
                  "shown once",
                  "each cell is the whole activation: its sequence across, its features "
                  "down; the filled part is the rank's"],
        anchor="start")))
