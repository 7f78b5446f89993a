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
