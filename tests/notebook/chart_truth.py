"""Checks that hold a chart to its legend and its data, on what Vega draws (drawn.py):

- ``assert_legends_true``: one legend shows one field; every legend entry has a mark of its
  style (colour, shape, dash) one can see: not thinner than a pixel, not wholly under a mark
  drawn later (a solid line on the same pixels, a dashed one whose gaps are too short to show
  it, a bar that holds it), unless its label says why ("same as X", "too thin to see"); the
  entries of one legend are drawn apart; no colour of one legend is near a colour of
  another, and every colour the marks are painted in is in a legend;
- ``assert_axes_fit``: no continuous axis leaves a quarter of its length or more empty (both
  ends together), as a log axis rounded out to whole powers of ten can.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Any

from drawn import Entry, Item, drawing, spec_of

EXCUSED = ("same as", "too thin to see")  # a label that says why its mark cannot be seen
NEAR_PX = 1.0  # two points closer than this (in both x and y) are drawn on the same pixels
GAP_PX = 4.0  # a dashed line drawn over another shows it through gaps this long, not shorter
THIN_PX = 1.0  # a bar or an area thinner than this draws as nothing one can see
CLASH = 40.0  # CIE76 distance under which two colours read as one (red #e15759 vs #c00000: 33)
EMPTY = 0.25  # the part of an axis that may stay empty, both ends together
NAMED = {"white": "#ffffff", "black": "#000000", "#fff": "#ffffff", "#000": "#000000"}


# -- styles ------------------------------------------------------------------------------------

def colour(value: Any) -> str | None:
    """A colour as ``#rrggbb``; None for no paint."""
    if not isinstance(value, str) or value in ("transparent", "none", ""):
        return None
    value = NAMED.get(value.lower(), value.lower())
    if re.fullmatch(r"#[0-9a-f]{3}", value):
        value = "#" + "".join(c * 2 for c in value[1:])
    return value


def dash(value: Any) -> tuple[float, ...] | None:
    """A stroke dash; None for a solid stroke (no dash, or ``[1, 0]``)."""
    if not value or (len(value) == 2 and value[1] == 0):
        return None
    return tuple(value)


def shape_of(item: Item) -> str | None:
    if item.marktype == "symbol":
        return str(item.style.get("shape", "circle"))
    return "stroke" if item.marktype in ("line", "trail", "rule") else None


def lab(value: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of ``#rrggbb``."""
    def linear(c: float) -> float:
        return c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (linear(int(value[i:i + 2], 16) / 255) for i in (1, 3, 5))
    x = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047
    y = 0.2126 * r + 0.7152 * g + 0.0722 * b
    z = (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883

    def f(t: float) -> float:
        return t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def distance(a: str, b: str) -> float:
    """CIE76 colour difference of two ``#rrggbb`` colours."""
    return math.dist(lab(a), lab(b))


def _varying(entries: list[Entry]) -> set[str]:
    """The symbol properties that tell this legend's entries apart."""
    keys = ("fill", "stroke", "shape", "strokeDash")
    norm = {"fill": colour, "stroke": colour, "strokeDash": dash, "shape": lambda v: v}
    return {k for k in keys
            if len({repr(norm[k](e.style.get(k))) for e in entries}) > 1}


def _key(entry: Entry, varying: set[str]) -> dict[str, Any]:
    key: dict[str, Any] = {}
    colours = {colour(entry.style.get(k)) for k in ("fill", "stroke") if k in varying}
    key["colours"] = {c for c in colours if c}
    if "shape" in varying:
        key["shape"] = entry.style.get("shape", "circle")
    if "strokeDash" in varying and entry.style.get("shape") == "stroke":
        key["dash"] = dash(entry.style.get("strokeDash"))  # a dash shows on a line, not a dot
    return key


def _matches(item: Item, key: dict[str, Any]) -> bool:
    painted = {colour(item.style.get(k)) for k in ("fill", "stroke")}
    if not key["colours"] <= painted:
        return False
    if "shape" in key and shape_of(item) != key["shape"]:
        return False
    return not ("dash" in key and dash(item.style.get("strokeDash")) != key["dash"])


# -- what one can see -------------------------------------------------------------------------

def _opaque(item: Item) -> float:
    paint = item.style.get("strokeOpacity" if item.marktype in ("line", "rule") else
                           "fillOpacity", 1.0)
    return float(item.style.get("opacity", 1.0)) * float(paint)


def _near(p: tuple[float, float], q: tuple[float, float]) -> bool:
    return abs(p[0] - q[0]) <= NEAR_PX and abs(p[1] - q[1]) <= NEAR_PX


def _covers(top: Item, under: Item) -> bool:
    """Whether ``top``, drawn later, hides every pixel of ``under``."""
    if top.order <= under.order or _opaque(top) < 0.99:
        return False
    if under.marktype == "line" and top.marktype == "line":
        pattern = dash(top.style.get("strokeDash"))
        if pattern is not None and max(pattern[1::2], default=0) >= GAP_PX:
            return False  # its gaps show what is under it (a 2 px gap reads as one line)
        if float(top.style.get("strokeWidth", 2)) < float(under.style.get("strokeWidth", 2)):
            return False
        return all(any(_near(p, q) for q in top.points) for p in under.points)
    if under.marktype == "symbol" and top.marktype == "symbol":
        return (_near(under.points[0], top.points[0]) and colour(top.style.get("fill"))
                is not None and shape_of(top) == shape_of(under)
                and float(top.style.get("size", 64)) >= float(under.style.get("size", 64)))
    if under.marktype == "rect" and top.marktype == "rect":
        if colour(top.style.get("fill")) is None:
            return False
        a, b = under.box, top.box
        return b[0] <= a[0] + 0.5 and b[1] <= a[1] + 0.5 and b[2] >= a[2] - 0.5 \
            and b[3] >= a[3] - 0.5
    return False


def visible(item: Item, items: list[Item]) -> bool:
    """Whether some of ``item`` can be seen: painted, big enough, not under a later mark."""
    if _opaque(item) < 0.05:
        return False
    if item.marktype == "line" and len(item.points) < 2:
        return False  # a line through one point draws nothing
    if item.marktype == "rect":
        x0, y0, x1, y1 = item.box
        if x1 - x0 < THIN_PX or y1 - y0 < THIN_PX:
            return False
    if item.marktype == "area":
        half = len(item.points) // 2
        if all(abs(a[1] - b[1]) < THIN_PX and abs(a[0] - b[0]) < THIN_PX
               for a, b in zip(item.points[:half], item.points[half:], strict=True)):
            return False
    return not any(_covers(other, item) for other in items)


def legend_problems(chart: Any) -> list[str]:
    """What ``assert_legends_true`` finds, one sentence each."""
    drawn = drawing(chart)
    problems = []
    legends: dict[int, list[Entry]] = {}
    for entry in drawn.entries:
        legends.setdefault(entry.legend, []).append(entry)
    keys: dict[int, list[tuple[Entry, dict[str, Any]]]] = {}
    for index, entries in legends.items():
        varying = _varying(entries)
        keys[index] = [(e, _key(e, varying)) for e in entries]
        seen: dict[str, str] = {}
        for entry, key in keys[index]:
            said = repr(sorted((k, sorted(v) if isinstance(v, set) else v)
                               for k, v in key.items()))
            if len(entries) > 1 and said in seen:
                problems.append(f"legend {entry.title!r}: {entry.label!r} is drawn as "
                                f"{seen[said]!r} is")
            seen.setdefault(said, entry.label)
        for entry, key in keys[index]:
            if any(words in entry.label for words in EXCUSED):
                continue
            if not key["colours"] and "shape" not in key and "dash" not in key:
                continue  # a legend of one entry: nothing to tell it apart by
            mine = [i for i in drawn.items if _matches(i, key)]
            if not mine:
                problems.append(f"legend {entry.title!r}: {entry.label!r} has no mark")
            elif not any(visible(i, drawn.items) for i in mine):
                problems.append(f"legend {entry.title!r}: {entry.label!r} has no mark one "
                                "can see (hidden under another, or too thin)")
    # a colour the marks are painted in says something: a legend must say what
    if not drawn.gradient:
        named = {c for e in drawn.entries for k in ("fill", "stroke")
                 if (c := colour(e.style.get(k)))}
        painted = {c for i in drawn.items if i.marktype != "rule" and _opaque(i) >= 0.05
                   for k in ("fill", "stroke") if (c := colour(i.style.get(k)))}
        for c in sorted(painted - named):
            if math.hypot(*lab(c)[1:]) >= 10 and all(distance(c, n) > 1 for n in named):
                problems.append(f"marks painted {c} are in no legend")
    # a colour with one meaning in a legend must not look like a colour with another
    for a, b in itertools.combinations(keys, 2):
        for (ea, ka), (eb, kb) in itertools.product(keys[a], keys[b]):
            for ca, cb in itertools.product(ka["colours"], kb["colours"]):
                if distance(ca, cb) < CLASH and "#ffffff" not in (ca, cb):
                    problems.append(f"{ea.title!r}: {ea.label!r} ({ca}) looks like "
                                    f"{eb.title!r}: {eb.label!r} ({cb})")
    return problems


LEGEND_CHANNELS = ("color", "fill", "stroke", "shape", "strokeDash", "opacity", "size")
COMPOSITES = ("layer", "hconcat", "vconcat", "concat")


def legend_fields(chart: Any) -> list[str]:
    """Legends that merge two fields: views sharing a scale (the default across layers,
    concatenated and faceted views) that encode one channel by different fields."""
    fields: dict[tuple[int, str], set[str]] = {}
    scopes = iter(range(1, 10**6))

    def walk(node: dict[str, Any], scope: dict[str, int]) -> None:
        for channel, encoding in node.get("encoding", {}).items():
            if channel in LEGEND_CHANNELS and isinstance(encoding, dict) \
                    and "field" in encoding and encoding.get("legend", {}) is not None \
                    and encoding.get("scale", {}) is not None:  # no scale: no legend
                fields.setdefault((scope[channel], channel), set()).add(str(encoding["field"]))
        resolve = node.get("resolve", {})
        apart = {c for c in LEGEND_CHANNELS
                 if "independent" in (resolve.get("scale", {}).get(c),
                                      resolve.get("legend", {}).get(c))}
        children = [c for k in COMPOSITES for c in node.get(k, [])]
        if "spec" in node:
            children.append(node["spec"])
        for child in children:
            walk(child, {c: next(scopes) if c in apart else s for c, s in scope.items()})

    walk(spec_of(chart), dict.fromkeys(LEGEND_CHANNELS, 0))
    return [f"one {channel} legend shows {sorted(names)}"
            for (_, channel), names in fields.items() if len(names) > 1]


def assert_legends_true(chart: Any) -> None:
    """Every legend entry of ``chart`` has a mark of its style one can see, unless its
    label says why; entries of one legend are drawn apart; colours of two legends differ."""
    problems = legend_fields(chart) + legend_problems(chart)
    assert not problems, "\n".join(problems)


# -- axes --------------------------------------------------------------------------------------

NUMBER = re.compile(r"^[-−+]?[\d,]*\.?\d+(e[-+]?\d+)?[kMGTmµunp%]?$")


def axis_problems(chart: Any, empty: float = EMPTY) -> list[str]:
    """What ``assert_axes_fit`` finds, one sentence each."""
    drawn = drawing(chart)
    problems = []
    for index, panel in enumerate(drawn.panels):
        mine = [i for i in drawn.items if i.panel == index]
        if not mine:
            continue
        for orient, shown in panel.axes:
            labels = [t.strip() for t in shown if t.strip()]  # a log axis blanks some ticks
            if not labels or not all(NUMBER.match(t) for t in labels):
                continue  # bands (ranks, layouts) or nothing to read
            across = orient in ("bottom", "top")
            start, length = (panel.x, panel.width) if across else (panel.y, panel.height)
            values = [(p[0] if across else p[1]) - start for i in mine for p in i.points]
            lo, hi = min(values), max(values)
            if hi - lo < 1:
                continue  # one value (a flat line): nothing to span
            if lo + (length - hi) > empty * length + 0.5:
                before, after = ("left", "right") if across else ("above", "below")
                problems.append(f"panel {index}: its {'x' if across else 'y'} axis ("
                                f"{labels[0]} to {labels[-1]}) is {lo / length:.0%} empty "
                                f"{before} the data and {(length - hi) / length:.0%} {after}")
    return problems


def assert_axes_fit(chart: Any, empty: float = EMPTY) -> None:
    """No continuous axis of ``chart`` leaves more than ``empty`` of its length empty (both
    ends together): the axis spans its data (a log axis rounded out to powers of ten does
    not)."""
    problems = axis_problems(chart, empty)
    assert not problems, "\n".join(problems)
