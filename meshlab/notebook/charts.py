"""Altair charts that render offline and stay in the notebook: interactive (tooltips) through
JupyterLab's own Vega-Lite renderer, which draws them again from the saved notebook without a
kernel, and as SVG drawn here for nbconvert and viewers without Vega. No JavaScript is fetched
from a CDN, and no widget state has to be saved."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

from meshlab.notebook.palette import rank_colour, text_colour

# JupyterLab 4 and VS Code render Vega-Lite 5 themselves (vega bundled with the front end);
# altair 6 writes Vega-Lite 6, which they do not render. The charts here use nothing v6 added.
VEGALITE = "application/vnd.vegalite.v5+json"
VEGALITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v5.json"  # a name, never fetched
EMBED = {"renderer": "svg", "actions": False}  # crisp, searchable; no menu of web links
interactive = True
"""False: every chart is plain SVG (no Vega-Lite spec in the output)."""


class OfflineChart:
    """An altair chart shown as a Vega-Lite spec (interactive in JupyterLab, live or saved)
    with an SVG beside it for viewers that do not render Vega-Lite."""

    def __init__(self, chart: alt.TopLevelMixin) -> None:
        self.chart = chart

    def svg(self) -> str:
        """The chart drawn here by vl-convert (no network)."""
        import vl_convert

        return str(vl_convert.vegalite_to_svg(self.chart.to_dict()))

    def spec(self) -> dict[str, Any]:
        """The chart as the Vega-Lite 5 spec front ends render, its data inline."""
        return {**self.chart.to_dict(), "$schema": VEGALITE_SCHEMA}

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = self.chart.to_dict()
        title = spec.get("title", "")
        mark = spec.get("mark") or next((k for k in ("layer", "facet", "hconcat", "vconcat")
                                         if k in spec), "layered")
        kind = {"layer": "layered", "facet": "faceted", "hconcat": "panelled",
                "vconcat": "panelled"}.get(mark, mark) if isinstance(mark, str) else mark["type"]
        text = f"<{kind} chart: {title.get('text', '') if isinstance(title, dict) else title}>"
        try:
            bundle: dict[str, Any] = {"image/svg+xml": self.svg(), "text/plain": text}
        except ImportError:  # a broken install: say so beside the chart, not as a traceback
            bundle = {"text/plain": f"{text} (no SVG drawn: vl-convert-python is not "
                                    "installed; pip install vl-convert-python)"}
        if not interactive:
            return bundle, {}
        bundle[VEGALITE] = self.spec()
        return bundle, {VEGALITE: {"embed_options": EMBED}}


# -- units ------------------------------------------------------------------------------------

BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
SECOND_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6))


def byte_unit(largest: float) -> tuple[str, float]:
    """The unit (and its size in bytes) that shows ``largest`` bytes as 1 to 1023."""
    return next(((u, s) for u, s in BYTE_UNITS if largest >= s), BYTE_UNITS[-1])


def second_unit(largest: float) -> tuple[str, float]:
    """s, ms or µs: the one that shows ``largest`` seconds as 1 or more."""
    return next(((u, s) for u, s in SECOND_UNITS if largest >= s), SECOND_UNITS[-1])


# three significant digits, trailing zeros dropped: 20, 0.0009, 12,300 (never 2e+1)
AXIS_FORMAT = ",.3~r"


def _axis(**kwargs: Any) -> alt.Axis:
    """A value axis whose labels neither crowd (``0.000.01``) nor show needless zeros."""
    return alt.Axis(format=AXIS_FORMAT, tickCount=5, labelOverlap="greedy", **kwargs)


# -- sizes, orders and labels that fit ----------------------------------------------------------

# JupyterLab's output area is about 1,000 px wide: a plot this wide, with its axis labels and
# a legend beside it, fills it without running past it
WIDTH = 560
ROW = 22  # px per bar row: room for an 11 px label with air above and below
OUTPUT = 940  # px a chart may take in all: JupyterLab's ~1,000 px output area, less its margin
PX_PER_LABEL_CHAR = 6.5  # an 11 px label, in the front ends' sans-serif
THIN_PX = 2.0  # a stacked segment narrower than this draws as nothing


def _stacked(data: pd.DataFrame, field: str, order: list[str]) -> pd.DataFrame:
    """``data`` with ``stack_index``: the place of ``field``'s value in ``order``, for the
    order channel. Vega-Lite stacks in the field's alphabetical order unless told, so a legend
    sorted any other way would list the parts in another order than the bars show them."""
    return data.assign(stack_index=[order.index(v) for v in data[field]])


def _fit(labels: Any = (), legend: Any = ()) -> int:
    """A plot width that, with its longest y-axis label on the left and its longest legend
    label on the right, fills the output area without running past it."""
    left = max((len(str(v)) for v in labels), default=4) * PX_PER_LABEL_CHAR + 30
    right = max((len(str(v)) for v in legend), default=0) * PX_PER_LABEL_CHAR + 50
    return int(max(280, min(WIDTH + 80, OUTPUT - left - right)))


def bytes_text(nbytes: float) -> str:
    """``nbytes`` in the unit that fits it, 3 significant digits: ``16 B``, ``1.5 KiB``."""
    unit, size = byte_unit(nbytes)
    return f"{nbytes / size:.3g} {unit}"


def _thin(data: pd.DataFrame, field: str, width: float, bar: str = "rank") -> dict[str, str]:
    """New legend names for the values of ``field`` whose every segment of the stacked bars
    (one per value of ``bar``) would draw under THIN_PX wide on a ``width`` px axis: a legend
    entry with no bar beside it says why."""
    longest = float(data.groupby(bar)["bytes"].sum().max()) if len(data) else 0.0
    if longest <= 0:
        return {}
    largest = data.groupby(field)["bytes"].max()
    return {str(v): f"{v} (at most {bytes_text(b)} per rank: too thin to see)"
            for v, b in largest.items() if b * width / longest < THIN_PX}


def chart_legend(title: str | None = None, **kwargs: Any) -> alt.Legend:
    """A legend whose labels are never cut short (a cut label reads as another name)."""
    return alt.Legend(title=title, labelLimit=0, **kwargs)


# -- cells and the session --------------------------------------------------------------------

def comms_chart(frame: pd.DataFrame) -> OfflineChart:
    """The payload each rank moved, one bar per rank, stacked by collective and mesh axis in
    the legend's order (the most bytes first)."""
    data = frame.assign(collective=frame["op"] + " on " + frame["axis"])
    data = data.assign(collective=data["collective"].replace(_thin(data, "collective", WIDTH)))
    totals = data.groupby("collective")["bytes"].sum().sort_values(ascending=False, kind="stable")
    order = list(totals.index)
    unit, size = byte_unit(data.groupby("rank")["bytes"].sum().max() if len(data) else 0)
    data = _stacked(data.assign(rank=data["rank"].astype(int), amount=data["bytes"] / size,
                                wire=data["wire_bytes"] / size), "collective", order)
    ranks = sorted(data["rank"].unique())
    chart = alt.Chart(data).mark_bar(stroke="white", strokeWidth=0.5).encode(
        y=alt.Y("rank:O", title="rank", sort=ranks, axis=alt.Axis(labelAngle=0)),
        x=alt.X("amount:Q", title=f"payload ({unit})", stack="zero", axis=_axis()),
        color=alt.Color("collective:N", sort=order, scale=alt.Scale(scheme="tableau10"),
                        legend=chart_legend("collective on mesh axis")),
        order=alt.Order("stack_index:Q"),
        tooltip=[alt.Tooltip("rank:O"), alt.Tooltip("op:N", title="collective"),
                 alt.Tooltip("axis:N", title="mesh axis"), alt.Tooltip("group:N"),
                 alt.Tooltip("count:Q", title="calls", format=","),
                 alt.Tooltip("amount:Q", title=f"payload ({unit})", format=",.3~r"),
                 alt.Tooltip("wire:Q", title=f"sent on the wire ({unit})", format=",.3~r")],
    ).properties(width=WIDTH, height=max(60, ROW * len(ranks)),
                 title=alt.TitleParams(f"collective payload per rank ({unit}), by collective",
                                       subtitle="hover a bar for its calls, group and the "
                                                "bytes a ring algorithm sends", anchor="start"))
    return OfflineChart(chart)


MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
PLACES = {"device": "#4c566a", "host": "#e5a50a"}  # slate on the device, amber offloaded


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
    x = alt.X("amount:Q", title=f"{unit} per rank", stack="zero", axis=_axis())
    # the formula's row faded: a prediction beside the measurements
    opacity = alt.Opacity("source:N", scale=alt.Scale(domain=["measured", "formula"],
                                                      range=[1.0, 0.45]), legend=None)

    def bars(column: str, names: list[str], colours: alt.Scale, title: str) -> alt.Chart:
        data = rows.melt(id_vars=["row", "source"], value_vars=names, var_name=column,
                         value_name="bytes")
        thin = _thin(data, column, WIDTH, bar="row")
        names = [thin.get(n, n) for n in names]
        data = data.assign(**{column: data[column].replace(thin)})
        colours = alt.Scale(domain=names, range=colours.range) if colours.range is not \
            alt.Undefined else alt.Scale(domain=names, scheme=colours.scheme)
        data = _stacked(data.assign(amount=data["bytes"] / size), column, names)
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


# -- pipeline schedules -----------------------------------------------------------------------

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
              axis=_axis())
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
        stroke=alt.Stroke("kind:N", scale=scale, legend=None), tooltip=tooltip)
    labels = alt.Chart().transform_filter(alt.datum.width_px >= alt.datum.label_px) \
        .mark_text(fontSize=9).encode(
        x="mid:Q", y="rank:O", text="label:N", color=alt.Color("text_fill:N", scale=None),
        tooltip=tooltip)
    size = {"width": WIDTH, "height": max(50, 22 * data["rank"].nunique())}
    layered = [done, pending, labels] if (data["state"] == "pending").any() else [done, labels]
    layers = alt.layer(*layered, data=data).properties(**size)
    notes = ["bar labels: micro-batch"]
    if (data["chunk"] > 0).any():
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


# -- profiled cells ---------------------------------------------------------------------------

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
                scale=alt.Scale(nice=False, zero=True), axis=_axis()),
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


# -- planning ---------------------------------------------------------------------------------

def plan_memory_chart(frame: pd.DataFrame) -> OfflineChart:
    """Memory per GPU of each planned layout, stacked by part, in a unit that fits the
    bars; the usable memory as a dashed rule when it is on the bars' scale, else named in
    the title (a rule at 80 GiB would flatten a tiny model's bars to nothing)."""
    parts = list(dict.fromkeys(frame["part"]))
    order = list(dict.fromkeys(frame["layout"]))
    largest = frame.groupby("layout")["gib"].sum().max() * 2**30 if len(frame) else 0
    usable_gib = float(frame["usable_gib"].iloc[0]) if len(frame) else 0.0
    unit, size = byte_unit(max(largest, 1))
    data = _stacked(frame.assign(amount=frame["gib"] * 2**30 / size,
                                 usable=frame["usable_gib"] * 2**30 / size), "part", parts)
    bars = alt.Chart(data).mark_bar().encode(
        y=alt.Y("layout:N", sort=order, title=None, axis=alt.Axis(labelLimit=0)),
        x=alt.X("sum(amount):Q", title=f"{unit} per GPU", axis=_axis()),
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
        title=title, width=_fit(order, parts), height=height))


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
        x=alt.X("sum(amount):Q", title=f"{unit} per GPU", axis=_axis()),
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
        title=title, width=_fit(order, parts), height=height))


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
        x=alt.X("sum(amount):Q", title=f"{unit} per step", axis=_axis()),
        color=alt.Color("kind:N", title=None, sort=["exposed", "overlapped"],
                        scale=alt.Scale(domain=["exposed", "overlapped"],
                                        range=["#e45756", "#9ecae9"])),
        order=alt.Order("kind:N", sort="ascending"),
        tooltip=["axis", "what", "collective", "ranks", "link", "calls",
                 alt.Tooltip("mib_each:Q", title="MiB each", format=".3~g"),
                 alt.Tooltip("amount:Q", title=f"{unit} per step", format=".3~g"), "kind"],
    ).properties(width=_fit(data["row"], ["overlapped"]),
                 height=max(60, 24 * data["axis"].nunique()))
    return OfflineChart(chart)
