"""Altair charts, shown as SVG so they render offline (no JavaScript from a CDN)."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd


class OfflineChart:
    """An altair chart that displays as SVG rendered here, with the spec kept alongside."""

    def __init__(self, chart: alt.TopLevelMixin) -> None:
        self.chart = chart

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        import vl_convert

        spec = self.chart.to_dict()
        return {"image/svg+xml": vl_convert.vegalite_to_svg(spec),
                "text/plain": f"<{spec.get('mark', 'layered')} chart: {spec.get('title', '')}>"}


def comms_chart(frame: pd.DataFrame) -> OfflineChart:
    """Bytes each rank moved, one bar per rank, coloured by collective and axis."""
    data = frame.assign(collective=frame["op"] + " on " + frame["axis"])
    chart = alt.Chart(data, title="bytes per rank by collective").mark_bar().encode(
        x=alt.X("rank:O", title="rank"),
        y=alt.Y("sum(bytes):Q", title="bytes (payload)"),
        color=alt.Color("collective:N", title="collective"),
        tooltip=["rank", "op", "axis", "group", "count", "bytes", "wire_bytes"],
    )
    return OfflineChart(chart)


def memory_chart(frame: pd.DataFrame) -> OfflineChart:
    """Stacked bytes per rank: parameters, gradients, optimizer states, activations; and
    the formula's bar beside them."""
    parts = [p for p in ("params", "grads", "optimizer", "activations") if p in frame]
    data = frame.reset_index().melt(id_vars=["rank", "source"], value_vars=parts,
                                    var_name="part", value_name="bytes")
    chart = alt.Chart(data, title="bytes per rank").mark_bar().encode(
        x=alt.X("rank:N", title=None, sort=None),
        y=alt.Y("sum(bytes):Q", title="bytes"),
        color=alt.Color("part:N", sort=parts),
        opacity=alt.condition(alt.datum.source == "formula", alt.value(0.55), alt.value(1.0)),
        tooltip=["rank", "part", "bytes"],
    )
    return OfflineChart(chart)


KIND_COLOURS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b"}


def timeline_chart(frame: pd.DataFrame, *, title: str = "pipeline schedule") -> OfflineChart:
    """A Gantt chart: ranks as rows, actions as bars coloured by kind and labelled with
    their micro-batch. Optional columns: ``view`` (one panel per value, e.g. two schedules,
    or plan vs measured) and ``state`` (pending actions faded)."""
    data = frame.assign(mid=(frame["start"] + frame["end"]) / 2,
                        label=frame["microbatch"].astype(str))
    if "state" not in data:
        data = data.assign(state="done")
    kinds = [k for k in KIND_COLOURS if k in set(data["kind"])]
    x_title = "time" if "unit" not in data else str(data["unit"].iloc[0])
    bars = alt.Chart().mark_bar(stroke="white", strokeWidth=0.5).encode(
        x=alt.X("start:Q", title=x_title), x2="end:Q",
        y=alt.Y("rank:O", title="rank"),
        color=alt.Color("kind:N", title="action",
                        scale=alt.Scale(domain=kinds, range=[KIND_COLOURS[k] for k in kinds])),
        opacity=alt.condition(alt.datum.state == "pending", alt.value(0.25), alt.value(1.0)),
        tooltip=["rank", "action", "start", "end", "state"],
    )
    labels = alt.Chart().mark_text(color="white", fontSize=9).encode(
        x="mid:Q", y="rank:O", text="label:N")
    size = {"width": 560, "height": max(50, 22 * data["rank"].nunique())}
    layers = alt.layer(bars, labels, data=data).properties(**size)
    if "view" not in data:
        return OfflineChart(layers.properties(title=title))
    views = list(dict.fromkeys(data["view"]))
    header = alt.Header(labelAngle=0, labelAlign="left", labelAnchor="start",
                        labelOrient="top", labelFontWeight="bold")
    chart = layers.facet(row=alt.Row("view:N", title=None, sort=views, header=header))
    return OfflineChart(chart.resolve_scale(x="independent").properties(title=title))


def bench_chart(frame: pd.DataFrame) -> OfflineChart:
    """GB/s (or time, where bytes are unknown) against size, a line per provider, a panel
    per rank: a slow rank stands out beside the others."""
    data = frame[frame["median_ms"].notna()]  # timed, right or wrong
    y = "gbps" if data["gbps"].notna().any() else "median_ms"
    title = {"gbps": "GB/s", "median_ms": "median ms"}[y]
    timer = ", ".join(sorted(set(data["timer"])))
    sizes = sorted(set(data["size"].tolist()))
    chart = alt.Chart(data).mark_line(point=True).encode(
        x=alt.X("size:Q", scale=alt.Scale(type="log", base=2), title="size (row length)",
                axis=alt.Axis(values=sizes)),
        # log: interpreter and compiled rows differ by orders of magnitude
        y=alt.Y(f"{y}:Q", scale=alt.Scale(type="log"), title=f"{title} (log)"),
        color=alt.Color("provider:N"),
        tooltip=["rank", "provider", "size", "median_ms", "gbps", "correct"],
    ).properties(width=220, height=160).facet(column=alt.Column("rank:N", title="rank"))
    return OfflineChart(chart.properties(
        title=f"{data['kernel'].iloc[0] if len(data) else ''} ({timer})"))


def plan_memory_chart(frame: pd.DataFrame) -> OfflineChart:
    """GiB per GPU of each planned layout, stacked by part, with the usable memory as a
    rule: the layouts past the line do not fit."""
    parts = list(dict.fromkeys(frame["part"]))
    order = list(dict.fromkeys(frame["layout"]))
    bars = alt.Chart(frame).mark_bar().encode(
        y=alt.Y("layout:N", sort=order, title=None, axis=alt.Axis(labelLimit=0)),
        x=alt.X("sum(gib):Q", title="GiB per GPU"),
        color=alt.Color("part:N", sort=parts, title=None),
        tooltip=["layout", "part", alt.Tooltip("gib:Q", format=".2f")],
    )
    usable = alt.Chart(frame.head(1)).mark_rule(color="black", strokeDash=[4, 3]).encode(
        x="usable_gib:Q")
    height = max(60, 22 * len(order))
    return OfflineChart(alt.layer(bars, usable).properties(
        title="memory per GPU (dashed: usable)", width=480, height=height))


def plan_comm_chart(frame: pd.DataFrame) -> OfflineChart:
    """Seconds per step of each axis's collectives, split into those hidden behind compute
    and those on the critical path, coloured by link."""
    data = frame.assign(kind=frame["overlapped"].map({True: "overlapped", False: "exposed"}))
    chart = alt.Chart(data, title="communication per step by axis").mark_bar().encode(
        y=alt.Y("axis:N", title=None),
        x=alt.X("sum(seconds):Q", title="seconds per step"),
        color=alt.Color("link:N", title=None),
        opacity=alt.Opacity("kind:N", title=None, sort=["exposed", "overlapped"],
                            scale=alt.Scale(range=[1.0, 0.45])),
        tooltip=["axis", "what", "collective", "ranks", "link", "calls", "mib_each",
                 alt.Tooltip("seconds:Q", format=".4f"), "kind"],
    ).properties(width=480, height=max(60, 24 * data["axis"].nunique()))
    return OfflineChart(chart)
