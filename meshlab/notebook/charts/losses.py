"""The picture of ``%mesh losses``: runs' loss curves over steps, and each run's relative
difference from the first run's, beside tables/losses.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import chart_legend
from meshlab.notebook.charts.offline import OfflineChart


def losses_chart(frame: pd.DataFrame, first: str) -> OfflineChart:
    """``frame``: one row per (run, step) with its loss and its relative difference from
    ``first``'s. Left the curves, right the differences (log scale; a bit-equal step is
    left out there, as log scale cannot draw 0), one colour per run."""
    colour = alt.Color("run:N", legend=chart_legend("run"))
    curves = alt.Chart(frame).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step"), y=alt.Y("loss:Q", title="loss", scale=alt.Scale(
            zero=False)),
        color=colour, tooltip=["run", "layout", "code", "step",
                               alt.Tooltip("loss:Q", format=".10g")],
    ).properties(width=300, height=200, title="loss")
    difference = frame["difference"]  # a NaN loss's is infinite: no point on a log scale
    apart = frame[(frame["run"] != first) & (difference > 0) & (difference < float("inf"))]
    differences = alt.Chart(apart).mark_line(point=True).encode(
        x=alt.X("step:Q", title="step"),
        y=alt.Y("difference:Q", title=f"|loss - {first}'s| / {first}'s",
                scale=alt.Scale(type="log")),
        color=colour, tooltip=["run", "step", alt.Tooltip("difference:Q", format=".2e")],
    ).properties(width=300, height=200, title=f"relative difference from {first}")
    return OfflineChart(alt.hconcat(curves, differences).properties(
        title=f"{frame['run'].nunique()} runs' losses, and each beside {first}'s"))
