"""The chart of ``%mesh dryrun``: each representative rank's memory at the step's peak,
the dry run's beside the planner's, beside tables/dryrun.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import ROW, byte_unit, chart_legend, fit_width, value_axis
from meshlab.notebook.charts.offline import OfflineChart


def dryrun_memory_chart(frame: pd.DataFrame, *, usable_gib: float | None = None
                        ) -> OfflineChart:
    """Each representative rank's memory at the step's peak, stacked by category: the dry
    run's bar above the planner's, in a unit that fits them; the usable memory dashed when
    it is on the bars' scale."""
    parts = list(dict.fromkeys(frame["category"]))
    data = frame.assign(row=[f"rank {r}: {s}" for r, s in zip(frame["rank"], frame["source"],
                                                               strict=True)])
    order = list(dict.fromkeys(data["row"]))
    largest = data.groupby("row")["gib"].sum().max() * 2**30 if len(data) else 0
    unit, size = byte_unit(max(largest, 1))
    data = data.assign(amount=data["gib"] * 2**30 / size)
    bars = alt.Chart(data).mark_bar().encode(
        y=alt.Y("row:N", sort=order, title=None, axis=alt.Axis(labelLimit=0)),
        x=alt.X("sum(amount):Q", title=f"{unit} per GPU", axis=value_axis()),
        color=alt.Color("category:N", sort=parts, legend=chart_legend()),
        order=alt.Order("category_index:Q"),
        tooltip=["row", "category", alt.Tooltip("amount:Q", title=unit, format=".3~g")],
    ).transform_calculate(category_index=f"indexof({parts!r}, datum.category)")
    title = f"memory per GPU at the step's peak ({unit}): dry run and planner"
    layers: list[alt.Chart] = [bars]
    if usable_gib and largest and usable_gib * 2**30 <= 10 * largest:
        rule = pd.DataFrame({"usable": [usable_gib * 2**30 / size]})
        layers.append(alt.Chart(rule).mark_rule(color="black", strokeDash=[4, 3])
                      .encode(x="usable:Q"))
        title += f"; usable {usable_gib:.3g} GiB dashed"
    height = max(60, ROW * len(order))
    return OfflineChart(alt.layer(*layers).properties(
        title=title, width=fit_width(order, parts), height=height))
