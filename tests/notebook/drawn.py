"""What a chart draws, read back from Vega's own scenegraph (vl-convert lays a chart out as
JupyterLab's renderer does): its legends' entries, the marks in drawing order, the panels'
axes and every text. Read from the scenegraph, not the spec, so filters, aggregates,
stacking, layering and Vega's draw order count as they do on screen; chart_truth.py holds
charts to it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import vl_convert

DATA_MARKS = ("line", "area", "rect", "symbol", "rule", "trail")


@dataclass
class Item:
    """A mark as drawn: a line or an area is one item (all its points), a bar or a point one
    item each. Coordinates are the chart's, in px; ``order`` is the drawing order."""

    marktype: str
    style: dict[str, Any]
    points: list[tuple[float, float]]
    order: int
    panel: int
    box: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # x0, y0, x1, y1
    description: str = ""


@dataclass
class Entry:
    """One legend entry: its legend's title, its label and its symbol's style."""

    legend: int
    title: str
    label: str
    style: dict[str, Any]


@dataclass
class Panel:
    """A plot area: its size, and per axis orientation the tick labels it shows."""

    x: float
    y: float
    width: float
    height: float
    axes: list[tuple[str, list[str]]] = field(default_factory=list)


@dataclass
class Drawing:
    """Everything a chart draws that the checks read."""

    items: list[Item] = field(default_factory=list)
    entries: list[Entry] = field(default_factory=list)
    panels: list[Panel] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # every text drawn: titles, labels, marks
    labels: list[str] = field(default_factory=list)  # the texts drawn as marks (bar labels)
    gradient: bool = False  # a legend of a continuous colour scale


def spec_of(chart: Any) -> dict[str, Any]:
    """The Vega-Lite spec of an OfflineChart, an altair chart or a spec."""
    inner = getattr(chart, "chart", chart)  # an OfflineChart or an altair chart
    return dict(inner.to_dict()) if hasattr(inner, "to_dict") else dict(chart)


def drawing(chart: Any) -> Drawing:
    """``chart`` (an OfflineChart, an altair chart or a spec) as Vega draws it."""
    root = vl_convert.vegalite_to_scenegraph(spec_of(chart))["scenegraph"]
    out = Drawing()
    _walk(root, 0.0, 0.0, -1, out)
    return out


def _style(item: dict[str, Any]) -> dict[str, Any]:
    keep = ("fill", "stroke", "strokeDash", "shape", "size", "strokeWidth", "opacity",
            "fillOpacity", "strokeOpacity")
    return {k: item[k] for k in keep if k in item}


def _walk(mark: dict[str, Any], ox: float, oy: float, panel: int, out: Drawing) -> None:
    role, kind = mark.get("role"), mark.get("marktype")
    items = mark.get("items", [])
    if role == "legend":
        for legend in items:
            out.gradient |= "legend-gradient" in repr(legend)
            _legend(legend, out)
        return
    if kind == "text":
        out.texts += [str(i.get("text", "")) for i in items]
        if role == "mark":
            out.labels += [str(i.get("text", "")) for i in items]
        return
    if kind == "group":
        for item in items:
            x, y = ox + item.get("x", 0.0), oy + item.get("y", 0.0)
            children = item.get("items", [])
            here = panel
            if any(c.get("role") == "axis" for c in children) and "width" in item:
                out.panels.append(Panel(x, y, item["width"], item.get("height", 0.0)))
                here = len(out.panels) - 1
            for child in children:
                if child.get("role") == "axis" and here >= 0:
                    _axis(child, out.panels[here], out)
                else:
                    _walk(child, x, y, here, out)
        return
    if role != "mark" or kind not in DATA_MARKS or not items:
        return
    if kind in ("line", "area", "trail"):  # one path: the items are its points
        points = [(ox + i.get("x", 0.0), oy + i.get("y", 0.0)) for i in items
                  if i.get("defined", True)]
        if kind == "area":
            points += [(ox + i.get("x2", i.get("x", 0.0)), oy + i.get("y2", i.get("y", 0.0)))
                       for i in items if i.get("defined", True)]
        out.items.append(Item(kind, _style(items[0]), points, len(out.items), panel,
                              description=str(items[0].get("description", ""))))
        return
    for i in items:
        x, y = ox + i.get("x", 0.0), oy + i.get("y", 0.0)
        if kind == "rect":
            x2 = ox + i["x2"] if "x2" in i else x + i.get("width", 0.0)
            y2 = oy + i["y2"] if "y2" in i else y + i.get("height", 0.0)
            box = (min(x, x2), min(y, y2), max(x, x2), max(y, y2))
            points = [(box[0], box[1]), (box[2], box[3])]
        elif kind == "rule":
            x2, y2 = ox + i.get("x2", i.get("x", 0.0)), oy + i.get("y2", i.get("y", 0.0))
            box, points = (x, y, x2, y2), [(x, y), (x2, y2)]
        else:  # symbol
            r = math.sqrt(i.get("size", 64)) / 2
            box, points = (x - r, y - r, x + r, y + r), [(x, y)]
        out.items.append(Item(kind, _style(i), points, len(out.items), panel, box,
                              str(i.get("description", ""))))


def _legend(legend: dict[str, Any], out: Drawing) -> None:
    index = 1 + max((e.legend for e in out.entries), default=-1)
    title = ""
    for child in legend.get("items", []):
        if child.get("role") == "legend-title":
            title = " ".join(str(i.get("text", "")) for i in child.get("items", []))
    for child in legend.get("items", []):
        if child.get("role") != "legend-entry":
            continue
        for group in child.get("items", []):
            for scope in group.get("items", []):
                for entry in scope.get("items", []):
                    symbol = label = None
                    for part in entry.get("items", []):
                        if part.get("role") == "legend-symbol" and part.get("items"):
                            symbol = part["items"][0]
                        if part.get("role") == "legend-label" and part.get("items"):
                            label = part["items"][0].get("text", "")
                    if symbol is not None:
                        out.entries.append(Entry(index, title, str(label), _style(symbol)))


def _axis(axis: dict[str, Any], panel: Panel, out: Drawing) -> None:
    for group in axis.get("items", []):
        labels: list[str] = []
        for part in group.get("items", []):
            if part.get("role") == "axis-label":
                labels += [str(i.get("text", "")) for i in part.get("items", [])]
            if part.get("role") == "axis-title":
                out.texts += [str(i.get("text", "")) for i in part.get("items", [])]
        panel.axes.append((str(group.get("orient", "")), labels))
