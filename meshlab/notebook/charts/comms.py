"""The chart of a cell's collectives (``%%mesh --comms``), beside tables/comms.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import (
    ROW,
    WIDTH,
    byte_unit,
    chart_legend,
    thin_names,
    value_axis,
    with_stack_index,
)
from meshlab.notebook.charts.offline import OfflineChart


def comms_chart(frame: pd.DataFrame) -> OfflineChart:
    """The payload each rank moved, one bar per rank, stacked by collective and mesh axis in
    the legend's order (the most bytes first)."""
    data = frame.assign(collective=frame["op"] + " on " + frame["axis"])
    data = data.assign(collective=data["collective"].replace(thin_names(data, "collective", WIDTH)))
    totals = data.groupby("collective")["bytes"].sum().sort_values(ascending=False, kind="stable")
    order = list(totals.index)
    unit, size = byte_unit(data.groupby("rank")["bytes"].sum().max() if len(data) else 0)
    data = with_stack_index(data.assign(rank=data["rank"].astype(int), amount=data["bytes"] / size,
                                wire=data["wire_bytes"] / size), "collective", order)
    ranks = sorted(data["rank"].unique())
    chart = alt.Chart(data).mark_bar(stroke="white", strokeWidth=0.5).encode(
        y=alt.Y("rank:O", title="rank", sort=ranks, axis=alt.Axis(labelAngle=0)),
        x=alt.X("amount:Q", title=f"payload ({unit})", stack="zero", axis=value_axis()),
        color=alt.Color("collective:N", sort=order, scale=alt.Scale(scheme="tableau10"),
                        legend=chart_legend("collective on mesh axis")),
        order=alt.Order("stack_index:Q"),
        tooltip=[alt.Tooltip("rank:O"), alt.Tooltip("op:N", title="collective"),
                 alt.Tooltip("axis:N", title="mesh axis"), alt.Tooltip("group:N"),
                 alt.Tooltip("count:Q", title="calls", format=","),
                 alt.Tooltip("amount:Q", title=f"payload ({unit})", format=",.3~r"),
                 alt.Tooltip("wire:Q", title=f"sent on the wire ({unit})", format=",.3~r")],
    ).properties(width=WIDTH, height=max(60, ROW * len(ranks)),
                 title=alt.TitleParams(f"collective payload per rank ({unit}), by collective",
                                       subtitle="hover a bar for its calls, group and the "
                                                "bytes a ring algorithm sends", anchor="start"))
    return OfflineChart(chart)
