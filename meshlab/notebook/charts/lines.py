"""Line charts whose legends never lie: one line per series, axes fitted to the data (a log
axis is not rounded out to whole powers of ten), and a series drawn on the pixels of another
said so in the legend ("HSDP, grad_accum=2 (same as HSDP)") and drawn over it in dashes
whose gaps show the line under it. The loss curves of ``%mesh losses`` and the tour's
curves (loss by method, precision, optimizer; all-reduce time by size) are drawn here."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import altair as alt
import pandas as pd

from meshlab.notebook.charts.fit import WIDTH, chart_legend, value_axis
from meshlab.notebook.charts.offline import OfflineChart

SAME_PX = 2.0  # two series closer than a line's width at every point are drawn as one
OVER = 5  # px: the dash of a series drawn over another; the gaps between leave room for it


@dataclass(frozen=True)
class Axis:
    """A quantitative axis of a lines chart: its field, its title, log or linear."""

    field: str
    title: str
    log: bool = False


def fitted(values: Iterable[float], log: bool = False) -> list[float]:
    """A domain that spans ``values`` with a little room (5% of the span, or of the
    decades on a log axis) instead of rounding out: Vega rounds a log axis to whole powers
    of ten, which can leave a third of it empty."""
    finite = [float(v) for v in values if math.isfinite(v) and (v > 0 or not log)]
    if not finite:
        return [1.0, 10.0] if log else [0.0, 1.0]
    lo, hi = min(finite), max(finite)
    if log:
        room = max(math.log10(hi / lo) * 0.05, 0.02)
        return [lo / 10**room, hi * 10**room]
    room = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    return [lo - room, hi + room]


def _scale(values: Iterable[float], log: bool) -> alt.Scale:
    if log:
        return alt.Scale(type="log", domain=fitted(values, log), nice=False)
    return alt.Scale(type="linear", domain=fitted(values, log), nice=False, zero=False)


def _px(value: float, domain: list[float], log: bool, length: float) -> float:
    if log:
        value, domain = math.log10(value), [math.log10(d) for d in domain]
    return (value - domain[0]) / (domain[1] - domain[0]) * length


def _placed(axis: Axis, values: pd.Series) -> pd.Series:
    """Which of ``values`` the axis can place."""
    numbers = pd.to_numeric(values, errors="coerce")
    finite = numbers.notna() & (numbers.abs() != float("inf"))
    return finite & (numbers > 0) if axis.log else finite


def _difference(a: list[float], b: list[float]) -> float:
    """The largest relative difference of two series' values."""
    top = max((abs(v) for v in a), default=0.0) or 1.0
    return max((abs(p - q) for p, q in zip(a, b, strict=True)), default=0.0) / top


def same_as(data: pd.DataFrame, x: Axis, y: Axis, series: str, lines: Sequence[str],
            order: list[str], width: float, height: float) -> dict[str, tuple[str, float]]:
    """Per series drawn on another's pixels (every line of it within SAME_PX of a line of an
    earlier series, at the same x): that series and their largest relative difference."""
    xd, yd = fitted(data[x.field], x.log), fitted(data[y.field], y.log)
    drawn: dict[str, list[tuple[list[float], list[float], list[float]]]] = {}
    for name in order:
        mine = data[data[series] == name]
        drawn[name] = []
        for _, line in mine.groupby(list(lines), sort=False) if lines else [(None, mine)]:
            # a point a scale cannot place (NaN, or not above 0 on a log axis) draws nothing
            line = line[_placed(x, line[x.field]) & _placed(y, line[y.field])]
            line = line.sort_values(x.field)
            xs = [_px(v, xd, x.log, width) for v in line[x.field]]
            ys = [_px(v, yd, y.log, height) for v in line[y.field]]
            drawn[name].append((xs, ys, list(line[y.field])))
    same: dict[str, tuple[str, float]] = {}
    for i, name in enumerate(order):
        for earlier in order[:i]:
            if earlier in same or not drawn[name]:
                continue
            matched = []
            for xs, ys, values in drawn[name]:
                match = next((v for xo, yo, v in drawn[earlier] if len(xo) == len(xs)
                              and all(abs(p - q) < 0.5 for p, q in zip(xs, xo, strict=True))
                              and all(abs(p - q) < SAME_PX for p, q in zip(ys, yo,
                                                                           strict=True))),
                             None)
                if match is None:
                    break
                matched.append(_difference(match, values))
            else:
                same[name] = (earlier, max(matched))
                break
    return same


def _label(name: str, same: tuple[str, float] | None) -> str:
    if same is None:
        return name
    earlier, apart = same
    if apart == 0:
        return f"{name} (same as {earlier})"
    return f"{name} (same as {earlier} to {apart:.0e})".replace("e-0", "e-")


def labelled(order: list[str], axes: Sequence[Axis],
             found: Sequence[dict[str, tuple[str, float]]]) -> dict[str, str]:
    """Each series' legend label: its name, and what it lies on (against which x, when
    only against some)."""
    labels = {}
    for name in order:
        where = [i for i, f in enumerate(found) if name in f]
        labels[name] = _label(name, found[where[0]][name] if where else None)
        if where and len(where) < len(axes):  # named by field: titles run long
            against = ", ".join(axes[i].field for i in where)
            labels[name] = labels[name][:-1] + f", against {against})"
    return labels


def series_colour(names: list[str], title: str | None) -> alt.Color:
    """The colour of each labelled series, in the legend's order (``series`` field)."""
    return alt.Color("series:N", sort=names, scale=alt.Scale(domain=names, scheme="tableau10"),
                     legend=chart_legend(title, symbolType="stroke"))


def panel(data: pd.DataFrame, *, x: Axis, y: Axis, series: str,
          same: dict[str, tuple[str, float]], colour: alt.Color, tooltip: Sequence[Any],
          extra: dict[str, Any] | None = None, points: bool = False, width: int = WIDTH,
          height: int = 240) -> alt.LayerChart | alt.FacetChart:
    """One plot: ``data``'s lines (coloured by its ``series`` labels) on axes fitted to
    them; those in ``same`` drawn over the line they lie on."""
    extra = extra or {}
    encode = dict(x=alt.X(f"{x.field}:Q", title=x.title, axis=value_axis(),
                          scale=_scale(data[x.field], x.log)),
                  y=alt.Y(f"{y.field}:Q", title=y.title, axis=value_axis(),
                          scale=_scale(data[y.field], y.log)),
                  color=colour, tooltip=list(tooltip))
    under = data[~data[series].isin(list(same))]
    layers = [alt.Chart(under).mark_line(strokeWidth=2).encode(**encode, **extra)]
    # the k series on one line each take one stretch of a dash pattern k + 1 stretches
    # long, leaving the last for the line under them: all of them stay in sight
    on: dict[str, list[str]] = {}
    for name, (earlier, _) in same.items():
        on.setdefault(earlier, []).append(name)
    detail = {"detail": extra["detail"]} if "detail" in extra else {}
    for over in on.values():
        period = OVER * (len(over) + 1)
        for j, name in enumerate(over):
            layers.append(alt.Chart(data[data[series] == name]).mark_line(
                strokeWidth=2, strokeDash=[OVER, period - OVER],
                strokeDashOffset=period - OVER * j).encode(**encode, **detail))
    if points:  # a run of one step is a point, not a line
        layers.append(alt.Chart(data).mark_point(filled=True, size=24, opacity=1)
                      .encode(**encode))
    return alt.layer(*layers).properties(width=width, height=height)


OVER_NOTE = "dashed: a series on the pixels of another (the legend names which), drawn over it"


def lines_chart(frame: pd.DataFrame, *, x: Axis | Sequence[Axis], y: Axis, series: str,
                title: str, series_title: str | None = None, dash: str | None = None,
                dashes: dict[str, list[int]] | None = None, detail: str | None = None,
                points: bool = False, tooltip: Sequence[Any] = (), width: int = WIDTH,
                height: int = 240) -> OfflineChart:
    """One line per value of ``series`` (and of ``detail``: several lines of one colour),
    against each of ``x`` (one panel each, stacked). ``dash``: a field drawn in the dash
    patterns ``dashes`` gives its values ([1, 0] is solid), with a legend of its own. A
    series that lies on the pixels of an earlier one is named so in the legend and drawn
    over it in dashes."""
    axes = [x] if isinstance(x, Axis) else list(x)
    order = list(dict.fromkeys(frame[series]))
    lines = [c for c in (dash, detail) if c]
    found = [same_as(frame, a, y, series, lines, order, width, height) for a in axes]
    labels = labelled(order, axes, found)
    data = frame.assign(series=frame[series].map(labels))
    names = [labels[n] for n in order]
    extra: dict[str, Any] = {}
    if dash:
        values = list(dashes) if dashes else list(dict.fromkeys(frame[dash]))
        extra["strokeDash"] = alt.StrokeDash(
            f"{dash}:N", sort=values, scale=alt.Scale(domain=values, range=[
                (dashes or {}).get(v, [1, 0]) for v in values]),
            legend=chart_legend(None, symbolType="stroke", symbolStrokeWidth=2))
    if detail:
        extra["detail"] = f"{detail}:N"
    hover = list(tooltip) or [alt.Tooltip("series:N", title=series_title or series),
                              *(alt.Tooltip(f"{a.field}:Q", title=a.title, format=",.4~g")
                                for a in axes),
                              alt.Tooltip(f"{y.field}:Q", title=y.title, format=",.6~g")]
    panels = [panel(data, x=a, y=y, series=series, same=f, colour=series_colour(
                  names, series_title), tooltip=hover, extra=extra, points=points,
                    width=width, height=height).properties(
                  title=a.title if len(axes) > 1 else "")
              for a, f in zip(axes, found, strict=True)]
    chart: alt.TopLevelMixin = panels[0] if len(panels) == 1 else alt.vconcat(*panels)
    heading = alt.TitleParams(title, anchor="start")
    if any(found):
        heading = alt.TitleParams(title, anchor="start", subtitle=OVER_NOTE)
    return OfflineChart(chart.properties(title=heading))
