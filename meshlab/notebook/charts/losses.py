"""The picture of ``%mesh losses``: runs' loss curves over steps, and each run's relative
difference from the first run's, beside tables/losses.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.lines import (
    OVER_NOTE,
    Axis,
    labelled,
    panel,
    same_as,
    series_colour,
)
from meshlab.notebook.charts.offline import OfflineChart

WIDTH, HEIGHT = 300, 200  # each of the two panels


def losses_chart(frame: pd.DataFrame, first: str) -> OfflineChart:
    """``frame``: one row per (run, step) with its loss and its relative difference from
    ``first``'s. Left the curves, right the differences (log scale; a bit-equal step is
    left out there, as log scale cannot draw 0), one colour per run. A run whose curve lies
    on an earlier run's is named so in the legend and drawn over it in dashes."""
    step, loss = Axis("step", "step"), Axis("loss", "loss")
    order = list(dict.fromkeys(frame["run"]))
    same = same_as(frame, step, loss, "run", (), order, WIDTH, HEIGHT)
    labels = labelled(order, [step], [same])
    data = frame.assign(series=frame["run"].map(labels))
    colour = series_colour([labels[r] for r in order], "run")
    curves = panel(data, x=step, y=loss, series="run", same=same, colour=colour, points=True,
                   tooltip=["run", "layout", "code", "step",
                            alt.Tooltip("loss:Q", format=".10g")], width=WIDTH, height=HEIGHT)
    difference = data["difference"]  # a NaN loss's is infinite: no point on a log scale
    apart = data[(data["run"] != first) & (difference > 0) & (difference < float("inf"))]
    heading = f"relative difference from {first}"
    if apart.empty:
        heading = f"every run bit-equal to {first} at every step: no difference to draw"
    differences = panel(apart, x=step, y=Axis("difference", f"|loss - {first}'s| / {first}'s",
                                              log=True),
                        series="run", same={}, colour=colour, points=True,
                        tooltip=["run", "step", alt.Tooltip("difference:Q", format=".2e")],
                        width=WIDTH, height=HEIGHT)
    title = alt.TitleParams(f"{frame['run'].nunique()} runs' losses, and each beside "
                            f"{first}'s", anchor="start", subtitle=OVER_NOTE if same else [])
    return OfflineChart(alt.hconcat(curves.properties(title="loss"),
                                    differences.properties(title=heading)).properties(
        title=title))
