"""The picture of ``%mesh compare``: every module's error at every step, one panel per phase,
the first difference outlined, beside tables/layout_diff.py."""

from __future__ import annotations

import math

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import ROW, chart_legend
from meshlab.notebook.charts.offline import OfflineChart


def layout_diff_chart(frame: pd.DataFrame, against: str = "one process") -> OfflineChart:
    """A module x step heat map per phase of each tensor's error over its tolerance (log10:
    0 is the tolerance, above it red), the first difference outlined in black; hovering
    gives the module, shape, error, tolerance and the ranks beyond it. ``against``: what
    the run was set beside (one process, itself, another layout)."""
    # run against itself the tolerance is 0: any difference is beyond it
    data = frame.assign(
        level=[math.log10(max(e, 1e-300) / t) if t else (6.0 if e else -6.0)
               for e, t in zip(frame["error"], frame["tolerance"], strict=True)])
    data = data.assign(level=data["level"].clip(-6, 6))
    born = data.sort_values("born")  # the frame's rows in the order differences are born
    modules, phases = (list(dict.fromkeys(born[c])) for c in ("module", "phase"))
    cells = alt.Chart(data).mark_rect(strokeWidth=2).encode(
        x=alt.X("step:O", title="step"),
        y=alt.Y("module:N", sort=modules, title=None, axis=alt.Axis(labelLimit=0)),
        color=alt.Color("level:Q",
                        scale=alt.Scale(scheme="redblue", reverse=True, domain=[-6, 6],
                                        domainMid=0),
                        legend=chart_legend("log10(error / tolerance)")),
        stroke=alt.condition("datum.first", alt.value("black"), alt.value(None)),
        tooltip=["module", "phase", "step", "shape",
                 alt.Tooltip("error:Q", format=".2e"), alt.Tooltip("tolerance:Q", format=".0e"),
                 "ranks beyond"],
    ).properties(width=max(60, 30 * data["step"].nunique()),
                 height=max(60, ROW * len(modules) // 2))
    first = data[data["first"]]
    title = ("every tensor within its tolerance" if first.empty else
             f"first difference: step {first['step'].iloc[0]}, {first['phase'].iloc[0]} of "
             f"{first['module'].iloc[0]} (outlined)")
    return OfflineChart(cells.facet(column=alt.Column("phase:N", sort=phases, title=None))
                        .properties(title=f"error beside {against}, by module and step: "
                                          f"{title}"))
