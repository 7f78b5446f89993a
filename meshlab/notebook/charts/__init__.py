"""Altair charts that render offline and stay in the notebook: interactive (tooltips) through
JupyterLab's own Vega-Lite renderer, which draws them again from the saved notebook without a
kernel, and as SVG drawn here for nbconvert and viewers without Vega. No JavaScript is fetched
from a CDN, and no widget state has to be saved.

Each feature's charts are in a module named as the tables beside them (tables/): comms,
memory (and memory_timeline), schedule, profile, plan, dryrun, layout_diff, losses; lines
draws line charts whose every series stays in sight (the losses' and the tour's curves);
offline holds OfflineChart, fit the units and sizes they share. The magics, tables/, bench.py,
activation_chart.py and the notebooks import every name from here.
"""

from __future__ import annotations

from meshlab.notebook.charts.comms import comms_chart
from meshlab.notebook.charts.dryrun import dryrun_memory_chart
from meshlab.notebook.charts.fit import (
    AXIS_FORMAT,
    BYTE_UNITS,
    OUTPUT,
    PX_PER_LABEL_CHAR,
    ROW,
    SECOND_UNITS,
    THIN_PX,
    WIDTH,
    byte_unit,
    bytes_text,
    chart_legend,
    second_unit,
)
from meshlab.notebook.charts.layout_diff import layout_diff_chart
from meshlab.notebook.charts.lines import Axis, lines_chart
from meshlab.notebook.charts.losses import losses_chart
from meshlab.notebook.charts.memory import MEMORY_PARTS, PLACES, memory_chart
from meshlab.notebook.charts.memory_timeline import memory_timeline_chart
from meshlab.notebook.charts.offline import EMBED, VEGALITE, VEGALITE_SCHEMA, OfflineChart
from meshlab.notebook.charts.plan import plan_comm_chart, plan_memory_chart
from meshlab.notebook.charts.profile import AXIS_COLOURS, WORK_COLOURS, profile_chart
from meshlab.notebook.charts.schedule import (
    KIND_COLOURS,
    PX_PER_CHAR,
    chunk_labels,
    timeline_chart,
)

interactive = True
"""False: every chart is plain SVG (no Vega-Lite spec in the output)."""

__all__ = [
    "AXIS_COLOURS", "AXIS_FORMAT", "BYTE_UNITS", "EMBED", "KIND_COLOURS", "MEMORY_PARTS",
    "OUTPUT", "PLACES", "PX_PER_CHAR", "PX_PER_LABEL_CHAR", "ROW", "SECOND_UNITS", "THIN_PX",
    "VEGALITE", "VEGALITE_SCHEMA", "WIDTH", "WORK_COLOURS", "Axis", "OfflineChart", "byte_unit",
    "bytes_text", "chart_legend", "chunk_labels", "comms_chart", "dryrun_memory_chart",
    "interactive", "layout_diff_chart", "lines_chart", "losses_chart", "memory_chart",
    "memory_timeline_chart", "plan_comm_chart", "plan_memory_chart", "profile_chart",
    "second_unit", "timeline_chart",
]
