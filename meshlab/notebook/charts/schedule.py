"""Pipeline schedules as Gantt charts: planned, compared, stepped and measured, beside
tables/schedule.py."""

from __future__ import annotations

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import WIDTH, value_axis
from meshlab.notebook.charts.offline import OfflineChart
from meshlab.notebook.palette import text_colour

KIND_COLOURS = {"F": "#4c78a8", "B": "#e45756", "I": "#f58518", "W": "#54a24b"}
PX_PER_CHAR = 6  # fontSize 9 digits and primes, with a little room either side


def chunk_labels(frame: pd.DataFrame) -> pd.DataFrame:
    """``chunk``: which of its rank's stages an action belongs to (0 for the rank's first
    stage, 1 for its second in interleaved and V schedules), and ``label``: the micro-batch,
    primed once per chunk (``3``, ``3'``, ``3''``)."""
    keys = ["view", "rank"] if "view" in frame else ["rank"]
    if "stage" in frame:
        chunk = frame.groupby(keys)["stage"].rank(method="dense").astype(int) - 1
    else:
        chunk = pd.Series(0, index=frame.index)
    label = [f"{m}{chr(39) * c}" for m, c in zip(frame["microbatch"], chunk, strict=True)]
    return frame.assign(chunk=chunk, label=label)


def timeline_chart(frame: pd.DataFrame, *, title: str = "pipeline schedule") -> OfflineChart:
    """A Gantt chart: ranks as rows, actions as bars coloured by kind and labelled with
    their micro-batch (primed for a rank's later chunks). Optional columns: ``view`` (one
    panel per value, e.g. two schedules, or plan vs measured), ``state`` (pending actions
    outlined) and ``unit`` (the time unit; panels in one unit share one time axis)."""
    data = chunk_labels(frame)
    if "state" not in data:
        data = data.assign(state="done")
    if "unit" not in data:
        data = data.assign(unit="cost units")
    views = list(dict.fromkeys(data["view"])) if "view" in data else []
    shared = data["unit"].nunique() == 1
    # label only bars wide enough for it: px per time unit from each panel's own domain
    span = data["end"].max() if shared else data.groupby(
        data["view"] if views else data["unit"])["end"].transform("max")
    data = data.assign(
        mid=(data["start"] + data["end"]) / 2,
        width_px=(data["end"] - data["start"]) * WIDTH / span,
        label_px=data["label"].str.len() * PX_PER_CHAR + 4,
        text_fill=[text_colour(KIND_COLOURS.get(k, "#888888")) if s != "pending" else "#000000"
                   for k, s in zip(data["kind"], data["state"], strict=True)])
    kinds = [k for k in KIND_COLOURS if k in set(data["kind"])]
    scale = alt.Scale(domain=kinds, range=[KIND_COLOURS[k] for k in kinds])
    unit = " / ".join(dict.fromkeys(data["unit"].astype(str))) + ("" if shared else " by panel")
    x = alt.X("start:Q", title=f"time ({unit})", scale=alt.Scale(nice=False, zero=True),
              axis=value_axis())
    fields = {"rank": "O", "action": "N", "stage": "Q", "chunk": "Q", "microbatch": "Q",
              "start": "Q", "end": "Q", "state": "N"}
    tooltip = [alt.Tooltip(f"{c}:{t}", format=".3~g") if c in ("start", "end")
               else alt.Tooltip(f"{c}:{t}") for c, t in fields.items() if c in data]
    tooltip.append(alt.Tooltip("unit:N", title="time unit"))
    done = alt.Chart().transform_filter(alt.datum.state != "pending").mark_bar(
        stroke="white", strokeWidth=0.5).encode(
        x=x, x2="end:Q", y=alt.Y("rank:O", title="rank"),
        color=alt.Color("kind:N", title="action", scale=scale), tooltip=tooltip)
    # pending: outlined in the kind's colour on white, so its black label reads (21:1)
    pending = alt.Chart().transform_filter(alt.datum.state == "pending").mark_bar(
        fill="white", strokeWidth=1.5, strokeDash=[3, 2]).encode(
        x=x, x2="end:Q", y="rank:O",
        # a legend of its own, merged with the fill's (with none, it took the fill's away)
        stroke=alt.Stroke("kind:N", title="action", scale=scale), tooltip=tooltip)
    labels = alt.Chart().transform_filter(alt.datum.width_px >= alt.datum.label_px) \
        .mark_text(fontSize=9).encode(
        x="mid:Q", y="rank:O", text="label:N", color=alt.Color("text_fill:N", scale=None),
        tooltip=tooltip)
    size = {"width": WIDTH, "height": max(50, 22 * data["rank"].nunique())}
    layered = [done, pending, labels] if (data["state"] == "pending").any() else [done, labels]
    layers = alt.layer(*layered, data=data).properties(**size)
    # promise the labels the text layer draws, no more (32 stages: no bar is wide enough)
    labelled = data[data["width_px"] >= data["label_px"]]
    notes = ["bar labels: micro-batch" if len(labelled) == len(data) else
             "bar labels: micro-batch, where a bar is wide enough; hover any bar for it"
             if len(labelled) else "bars too narrow to label: hover one for its micro-batch"]
    if (labelled["chunk"] > 0).any():
        notes.append("' marks a rank's second chunk (virtual stage), '' its third")
    if (data["state"] == "pending").any():
        notes.append("outlined: not run yet")
    heading = alt.TitleParams(title, subtitle="; ".join(notes))
    if not views:
        return OfflineChart(layers.properties(title=heading))
    header = alt.Header(labelAngle=0, labelAlign="left", labelAnchor="start",
                        labelOrient="top", labelFontWeight="bold")
    chart = layers.facet(row=alt.Row("view:N", title=None, sort=views, header=header))
    if not shared:  # slots beside milliseconds: one axis would compare apples to pears
        chart = chart.resolve_scale(x="independent")
    return OfflineChart(chart.properties(title=heading))
