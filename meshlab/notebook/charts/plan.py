"""The charts of ``%mesh plan``: memory and communication per planned layout, beside
tables/plan.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import (
    ROW,
    byte_unit,
    chart_legend,
    fit_width,
    second_unit,
    value_axis,
    with_stack_index,
)
from meshlab.notebook.charts.offline import OfflineChart


def plan_memory_chart(frame: pd.DataFrame) -> OfflineChart:
    """Memory per GPU of each planned layout, stacked by part, in a unit that fits the
    bars; the usable memory as a dashed rule when it is on the bars' scale, else named in
    the title (a rule at 80 GiB would flatten a tiny model's bars to nothing)."""
    parts = list(dict.fromkeys(frame["part"]))
    order = list(dict.fromkeys(frame["layout"]))
    largest = frame.groupby("layout")["gib"].sum().max() * 2**30 if len(frame) else 0
    usable_gib = float(frame["usable_gib"].iloc[0]) if len(frame) else 0.0
    unit, size = byte_unit(max(largest, 1))
    data = with_stack_index(frame.assign(amount=frame["gib"] * 2**30 / size,
                                 usable=frame["usable_gib"] * 2**30 / size), "part", parts)
    bars = alt.Chart(data).mark_bar().encode(
        y=alt.Y("layout:N", sort=order, title=None, axis=alt.Axis(labelLimit=0)),
        x=alt.X("sum(amount):Q", title=f"{unit} per GPU", axis=value_axis()),
        color=alt.Color("part:N", sort=parts, legend=chart_legend()),
        order=alt.Order("stack_index:Q"),
        tooltip=["layout", "part", alt.Tooltip("amount:Q", title=unit, format=".3~g")],
    )
    on_scale = largest > 0 and usable_gib * 2**30 <= 10 * largest
    title = f"memory per GPU ({unit}); usable {usable_gib:.3g} GiB"
    layers: list[alt.Chart] = [bars]
    if on_scale:
        layers.append(alt.Chart(data.head(1)).mark_rule(color="black", strokeDash=[4, 3])
                      .encode(x="usable:Q"))
        title += " (dashed)"
    else:
        title += ", far off this scale"
    height = max(60, ROW * len(order))
    return OfflineChart(alt.layer(*layers).properties(
        title=title, width=fit_width(order, parts), height=height))



def plan_comm_chart(frame: pd.DataFrame) -> OfflineChart:
    """Time per step of each axis's collectives, coloured by whether compute hides it
    (overlapped) or the step waits for it (exposed); the axis label names its link."""
    unit, size = second_unit(frame.groupby("axis")["seconds"].sum().max() if len(frame) else 0)
    links = frame.groupby("axis")["link"].agg(lambda s: ", ".join(dict.fromkeys(s)))
    data = frame.assign(
        kind=frame["overlapped"].map({True: "overlapped", False: "exposed"}),
        amount=frame["seconds"] / size,
        row=[f"{a} ({links[a]})" for a in frame["axis"]])
    chart = alt.Chart(data, title=f"communication per step by axis ({unit})").mark_bar().encode(
        y=alt.Y("row:N", title=None, axis=alt.Axis(labelLimit=0)),
        x=alt.X("sum(amount):Q", title=f"{unit} per step", axis=value_axis()),
        color=alt.Color("kind:N", title=None, sort=["exposed", "overlapped"],
                        scale=alt.Scale(domain=["exposed", "overlapped"],
                                        range=["#e45756", "#9ecae9"])),
        order=alt.Order("kind:N", sort="ascending"),
        tooltip=["axis", "what", "collective", "ranks", "link", "calls",
                 alt.Tooltip("mib_each:Q", title="MiB each", format=".3~g"),
                 alt.Tooltip("amount:Q", title=f"{unit} per step", format=".3~g"), "kind"],
    ).properties(width=fit_width(data["row"], ["overlapped"]),
                 height=max(60, 24 * data["axis"].nunique()))
    return OfflineChart(chart)
