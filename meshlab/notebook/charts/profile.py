"""The chart of a profiled cell: every rank on one time axis, beside tables/profile.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import WIDTH, byte_unit, value_axis
from meshlab.notebook.charts.offline import OfflineChart
from meshlab.notebook.palette import rank_colour

WORK_COLOURS = {"compute": "#6b7a8f", "copy": "#d9a21b", "idle": "#ececec",
                "wait": "#f2a7a7"}  # grey work, amber copies, pale idle, pink waiting
AXIS_COLOURS = ("#1f5fbf", "#c2185b", "#6a3fb5", "#00838f", "#2e7d32", "#ad5a00",
                "#37474f")  # collectives, one per mesh axis; none is a work colour


def profile_chart(frame: pd.DataFrame, *, title: str = "what every rank did") -> OfflineChart:
    """Every rank on one time axis (``CellProfile.spans``): its work in one lane, its
    collectives under it coloured by mesh axis, the wait for a later rank in pink; rank labels
    in the rank colours. Hovering a bar names the op, its time, bytes and whom it waited on."""
    data = frame.assign(
        lane=["comm" if k in ("comm", "wait") else "work" for k in frame["kind"]],
        what=[f"comm on {a}" if k == "comm" else
              ("waiting for a later rank" if k == "wait" else k)
              for k, a in zip(frame["kind"], frame["axis"], strict=True)],
        ms=frame["end"] - frame["start"])
    unit, size = byte_unit(float(data["bytes"].max()) if len(data) and data["bytes"].notna().any()
                           else 0)
    data = data.assign(payload=data["bytes"] / size)
    axes = list(dict.fromkeys(a for k, a in zip(data["kind"], data["axis"], strict=True)
                              if k == "comm"))
    named = {"compute": WORK_COLOURS["compute"], "copy": WORK_COLOURS["copy"],
             "idle": WORK_COLOURS["idle"], "waiting for a later rank": WORK_COLOURS["wait"]}
    named |= {f"comm on {a}": AXIS_COLOURS[i % len(AXIS_COLOURS)] for i, a in enumerate(axes)}
    shown = [w for w in named if w in set(data["what"])]
    ranks = sorted(data["rank"].unique())
    colours = "[" + ",".join(f"'{rank_colour(int(r))}'" for r in ranks) + "]"
    order = "[" + ",".join(str(int(r)) for r in ranks) + "]"
    tooltip = [alt.Tooltip("rank:O"), alt.Tooltip("what:N", title="kind"),
               alt.Tooltip("name:N", title="op"), alt.Tooltip("axis:N"),
               alt.Tooltip("start:Q", title="start (ms)", format=",.3f"),
               alt.Tooltip("ms:Q", title="duration (ms)", format=",.3f"),
               alt.Tooltip("payload:Q", title=f"payload ({unit})", format=",.3~r"),
               alt.Tooltip("waited on:N")]
    chart = alt.Chart(data).mark_bar(stroke="white", strokeWidth=0.3).encode(
        x=alt.X("start:Q", title="ms from the cell's start (one clock for all ranks)",
                scale=alt.Scale(nice=False, zero=True), axis=value_axis()),
        x2="end:Q",
        y=alt.Y("rank:O", title="rank", sort=ranks, axis=alt.Axis(
            labelColor=alt.ExprRef(f"{colours}[indexof({order}, datum.value)]"),
            labelFontWeight="bold")),
        yOffset=alt.YOffset("lane:N", sort=["work", "comm"], title=None),
        color=alt.Color("what:N", title="kind", scale=alt.Scale(
            domain=shown, range=[named[w] for w in shown]), legend=alt.Legend(labelLimit=220)),
        tooltip=tooltip)
    subtitle = "upper lane: compute, copies, idle; lower lane: collectives, pink while " \
               "waiting for a later rank"
    return OfflineChart(chart.properties(
        width=WIDTH + 40, height=max(60, 34 * len(ranks)),
        title=alt.TitleParams(title, subtitle=subtitle)))
