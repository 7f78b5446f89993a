"""The chart of ``%mesh memory``: what each rank holds and where, beside tables/memory.py."""

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

MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
# charcoal on the device, mustard offloaded: far from every part's colour in the panel above
# (slate and amber read as the parameters' blue and the gradients' orange)
PLACES = {"device": "#2f2f2f", "host": "#c9b600"}


def memory_chart(frame: pd.DataFrame) -> OfflineChart:
    """Bytes per rank (``memory_frame``): above, stacked by what they hold (parameters,
    gradients, optimizer states, activations) beside the ZeRO formula's row when there is
    one; below, the same totals split by where they live (on the device, or offloaded to
    host memory). Parts no row holds are left out of the bars and the legend."""
    rows = frame.reset_index()
    rows = rows.assign(row=[f"rank {r}" if str(r).isdigit() else str(r) for r in rows["rank"]])
    order = list(rows["row"])
    parts = [p for p in MEMORY_PARTS if p in rows and rows[p].sum() > 0]
    unit, size = byte_unit(float(rows[parts].sum(axis=1).max()) if len(rows) and parts else 0)
    formula = [r for r, s in zip(rows["row"], rows["source"], strict=True) if s == "formula"]
    y = alt.Y("row:N", sort=order, title=None, axis=alt.Axis(labelLimit=0))
    x = alt.X("amount:Q", title=f"{unit} per rank", stack="zero", axis=value_axis())
    # the formula's row faded: a prediction beside the measurements
    opacity = alt.Opacity("source:N", scale=alt.Scale(domain=["measured", "formula"],
                                                      range=[1.0, 0.45]), legend=None)

    def bars(column: str, names: list[str], colours: alt.Scale, title: str) -> alt.Chart:
        data = rows.melt(id_vars=["row", "source"], value_vars=names, var_name=column,
                         value_name="bytes")
        thin = thin_names(data, column, WIDTH, bar="row")
        names = [thin.get(n, n) for n in names]
        data = data.assign(**{column: data[column].replace(thin)})
        colours = alt.Scale(domain=names, range=colours.range) if colours.range is not \
            alt.Undefined else alt.Scale(domain=names, scheme=colours.scheme)
        data = with_stack_index(data.assign(amount=data["bytes"] / size), column, names)
        return alt.Chart(data, title=alt.TitleParams(title, anchor="start", fontSize=12)) \
            .mark_bar(stroke="white", strokeWidth=0.5).encode(
            y=y, x=x, opacity=opacity, order=alt.Order("stack_index:Q"),
            color=alt.Color(f"{column}:N", sort=names, scale=colours,
                            legend=chart_legend(column)),
            tooltip=[alt.Tooltip("row:N", title="rank"), alt.Tooltip(f"{column}:N"),
                     alt.Tooltip("amount:Q", title=unit, format=",.3~r"),
                     alt.Tooltip("bytes:Q", title="bytes", format=",")],
        ).properties(width=WIDTH, height=max(40, ROW * len(order)))

    what = bars("part", parts, alt.Scale(domain=parts, scheme="tableau10"),
                "what each rank holds")
    notes = []
    if formula:
        notes.append(f"{formula[0]}: the paper's per-device parameters, gradients and "
                     "optimizer states, faded")
    places = [p for p in PLACES if p in rows and rows[p].sum() > 0]
    if places == ["device"] or not places:  # a panel of one colour would say no more
        notes.append("all of it on the device (nothing offloaded)")
        chart: alt.TopLevelMixin = what
    else:
        where = bars("place", places, alt.Scale(domain=places,
                                                range=[PLACES[p] for p in places]),
                     "the same bytes by where they live: on the device, or offloaded to "
                     "host memory")
        chart = alt.vconcat(what, where, spacing=18).resolve_scale(color="independent")
    return OfflineChart(chart.properties(title=alt.TitleParams(
        f"memory per rank ({unit})", subtitle="; ".join(notes), anchor="start")))
