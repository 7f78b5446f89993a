"""The chart of ``%%mesh --memory``: each rank's bytes over the cell, stacked by category, the
module running at each moment at hover, the peak marked and named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import WIDTH, byte_unit, chart_legend, value_axis
from meshlab.notebook.charts.offline import OfflineChart

ORDER = ("parameters", "buffers", "gradients", "optimizer states", "activations",
         "temporaries", "other")
COLOURS = {"parameters": "#4c78a8", "buffers": "#9ecae9", "gradients": "#f58518",
           "optimizer states": "#54a24b", "activations": "#e45756", "temporaries": "#b279a2",
           "other": "#bab0ac"}
SHOWN = 400  # points drawn per rank: each the largest of its stretch of time, so the peak stays


def peak_text(point: Any) -> str:
    """Where a peak was: "backward of layers.1.attention", "the optimizer step"."""
    if point.phase == "optimizer":
        return "the optimizer step"
    if point.module:
        return f"{point.phase or 'inside'} of {point.module}"
    return "between modules"


def memory_timeline_chart(timelines: dict[int, Any], out_of_memory: Sequence[int] = ()
                          ) -> OfflineChart:
    """One panel per rank (meshlab.measure.memory_timeline.MemoryTimeline): bytes by
    category over the cell's time; a rule and a label at the peak; ``out_of_memory``:
    ranks whose panel ends where they ran out."""
    largest = max((sum(p.bytes.values()) for t in timelines.values() for p in t.points),
                  default=0)
    unit, size = byte_unit(float(largest))
    used = [c for c in ORDER if any(p.bytes.get(c) for t in timelines.values()
                                    for p in t.points)]
    panels = [_panel(r, timelines[r], used, unit, size, r in out_of_memory)
              for r in sorted(timelines) if timelines[r].points]
    if not panels:
        return OfflineChart(alt.Chart(pd.DataFrame({"x": []})).mark_text().properties(
            title="no memory was tracked: the cell allocated nothing torch's tracker saw"))
    chart = alt.vconcat(*panels, spacing=14)
    return OfflineChart(chart.properties(title=alt.TitleParams(
        f"memory over the cell per rank ({unit})", anchor="start",
        subtitle="torch's MemTracker: the models and optimizers the cell names; hover for "
                 "the module running")))


def _panel(rank: int, timeline: Any, used: list[str], unit: str, size: float,
           ran_out: bool) -> alt.LayerChart | alt.FacetChart:
    points = _thin(timeline.points)
    rows = [{"ms": p.ns / 1e6, "category": c, "amount": p.bytes.get(c, 0) / size,
             "module": p.module or "(none)", "phase": p.phase or "-",
             "total": sum(p.bytes.values()) / size}
            for p in points for c in used]
    data = pd.DataFrame(rows)
    order = {c: i for i, c in enumerate(used)}
    data = data.assign(stack_index=data["category"].map(order))
    peak = timeline.peak
    title = f"rank {rank}" + (" (ran out of memory: the panel ends at the failure)"
                              if ran_out else "")
    x = alt.X("ms:Q", title="ms since the cell began", axis=value_axis())
    area = alt.Chart(data).mark_area(interpolate="step-after").encode(
        x=x, y=alt.Y("amount:Q", stack="zero", title=unit, axis=value_axis()),
        color=alt.Color("category:N", sort=used, legend=chart_legend("category"),
                        scale=alt.Scale(domain=used, range=[COLOURS[c] for c in used])),
        order=alt.Order("stack_index:Q"))
    totals = data.drop_duplicates("ms")
    hover = alt.Chart(totals).mark_point(opacity=0, size=60).encode(
        x=x, y="total:Q",
        tooltip=[alt.Tooltip("ms:Q", format=",.2f"), alt.Tooltip("total:Q", title=unit,
                                                                  format=",.3~r"),
                 alt.Tooltip("phase:N"), alt.Tooltip("module:N")])
    layers = [area, hover]
    if peak is not None:
        top = sum(peak.bytes.values()) / size
        mark = pd.DataFrame([{"ms": peak.ns / 1e6, "total": top,
                              "label": f"peak {top:,.3g} {unit}: {peak_text(peak)}"}])
        layers += [alt.Chart(mark).mark_rule(color="black", strokeDash=[3, 3]).encode(x=x),
                   alt.Chart(mark).mark_text(align="left", dx=4, dy=-6, fontSize=11).encode(
                       x=x, y="total:Q", text="label:N")]
    return alt.layer(*layers).properties(
        width=WIDTH, height=110, title=alt.TitleParams(title, anchor="start", fontSize=12))


def _thin(points: list[Any]) -> list[Any]:
    """At most SHOWN points: in each stretch of time the one with the most bytes."""
    if len(points) <= SHOWN:
        return points
    step = len(points) / SHOWN
    kept = []
    for i in range(SHOWN):
        stretch = points[int(i * step):int((i + 1) * step)]
        if stretch:
            kept.append(max(stretch, key=lambda p: sum(p.bytes.values())))
    return kept
