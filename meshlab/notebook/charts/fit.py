"""What every chart shares to read true and fit: units that suit the values, value axes,
sizes within JupyterLab's output area, stacking in the legend's order, uncut legends."""

from __future__ import annotations

from typing import Any

import altair as alt
import pandas as pd

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


def value_axis(**kwargs: Any) -> alt.Axis:
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


def with_stack_index(data: pd.DataFrame, field: str, order: list[str]) -> pd.DataFrame:
    """``data`` with ``stack_index``: the place of ``field``'s value in ``order``, for the
    order channel. Vega-Lite stacks in the field's alphabetical order unless told, so a legend
    sorted any other way would list the parts in another order than the bars show them."""
    return data.assign(stack_index=[order.index(v) for v in data[field]])


def fit_width(labels: Any = (), legend: Any = ()) -> int:
    """A plot width that, with its longest y-axis label on the left and its longest legend
    label on the right, fills the output area without running past it."""
    left = max((len(str(v)) for v in labels), default=4) * PX_PER_LABEL_CHAR + 30
    right = max((len(str(v)) for v in legend), default=0) * PX_PER_LABEL_CHAR + 50
    return int(max(280, min(WIDTH + 80, OUTPUT - left - right)))


def bytes_text(nbytes: float) -> str:
    """``nbytes`` in the unit that fits it, 3 significant digits: ``16 B``, ``1.5 KiB``."""
    unit, size = byte_unit(nbytes)
    return f"{nbytes / size:.3g} {unit}"


def thin_names(data: pd.DataFrame, field: str, width: float, bar: str = "rank") -> dict[str, str]:
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
