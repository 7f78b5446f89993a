"""The sharding widget: a tensor drawn as blocks coloured by the ranks that hold them.

It renders plain report data (meshlab.sharding) and never calls torch.distributed. The
blocks are computed here, in Python, so the widget and its HTML fallback draw the same
thing; the front end (sharding.js) only draws and reports clicks.
"""

from __future__ import annotations

import html
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from meshlab.notebook.palette import rank_colour, text_colour
from meshlab.notebook.ranks import format_ranks, label
from meshlab.sharding import ModuleReport, RankShard, ShardingReport

# diagonal stripes over the rank colours: a Partial value still owes a reduction
HATCH = "repeating-linear-gradient(45deg, rgba(255,255,255,.55) 0 4px, transparent 4px 8px)"


def blocks(report: ShardingReport, dims: tuple[int, ...]) -> list[dict[str, Any]]:
    """The tensor projected on ``dims`` (one or two tensor dims), as rectangles with owners.

    Ranks whose pieces cover the same rectangle share a block: replicated (or held by
    several groups); pieces that differ only in undrawn dims share it too, and the detail
    lists each rank's full offsets.
    """
    ndim = len(report.global_shape)
    by_box: dict[tuple[int, int, int, int], list[RankShard]] = {}
    for shard in report.shards:
        if 0 in shard.local_shape and ndim:
            continue  # holds nothing
        r0, r1 = _span(shard, dims[0]) if ndim else (0, 1)
        c0, c1 = _span(shard, dims[1]) if len(dims) > 1 else (0, 1)
        by_box.setdefault((r0, r1, c0, c1), []).append(shard)
    out = []
    for (r0, r1, c0, c1), group in sorted(by_box.items()):
        ranks = [s.rank for s in group]
        colours = [rank_colour(r) for r in ranks]  # rank r has one colour in every picture
        out.append({
            "r0": r0, "r1": r1, "c0": c0, "c1": c1, "ranks": ranks, "label": label(ranks),
            "ranges": _ranges(r0, r1, c0, c1, ndim),
            "color": colours[0], "colors": colours, "text": text_colour(colours[0]),
            # plain tensors of the same shape on several ranks may hold different values
            "replicated": len(ranks) > 1 and report.kind == "dtensor",
            "partial": report.partial,
            "detail": [asdict(s) for s in group],
        })
        out[-1]["fill"] = background(out[-1])
    return out


def _ranges(r0: int, r1: int, c0: int, c1: int, ndim: int) -> str:
    """``rows 0-3 · cols 3-5`` (inclusive), as far as the tensor has rows and columns."""
    def span(a: int, b: int) -> str:
        return f"{a}" if b - a == 1 else f"{a}-{b - 1}"

    if ndim == 0:
        return "the scalar"
    return f"rows {span(r0, r1)}" + (f" · cols {span(c0, c1)}" if ndim > 1 else "")


def background(block: dict[str, Any]) -> dict[str, str]:
    """CSS of a block: its rank's colour, equal bands when several ranks hold it, and the
    hatch over them when the value is Partial (widget and HTML fallback alike)."""
    colours = block["colors"]
    images = [HATCH] if block["partial"] else []
    if len(colours) > 1:
        n = len(colours)
        stops = ", ".join(f"{c} {i * 100 / n:.2f}% {(i + 1) * 100 / n:.2f}%"
                          for i, c in enumerate(colours))
        images.append(f"linear-gradient(to right, {stops})")
    css = {"background-color": colours[0]}
    if images:
        css["background-image"] = ", ".join(images)
    return css


def text_form(tensor: dict[str, Any]) -> str:
    """The drawing as lines to paste into a log: one per block (ranges inclusive)."""
    if not tensor:
        return "(no tensor)"
    head = (f"{tensor['name'] or 'tensor'} {list(tensor['shape'])} {tensor['dtype']} · "
            f"{', '.join(tensor['placements']) or 'local tensor (one per rank)'}"
            + (f" on mesh {list(tensor['mesh_shape'])} ({', '.join(tensor['mesh_axes'])})"
               if tensor["mesh_shape"] else ""))
    lines = [head]
    for b in tensor["blocks"]:
        shard = b["detail"][0]
        notes = (" · replicated" if b["replicated"] else "") + \
            (" · partial: pending reduction" if b["partial"] else "")
        lines.append(f"  {b['ranges']}: {label(b['ranks'])[1:-1]} · local "
                     f"{list(shard['local_shape'])}, {_size(shard['bytes'])} each{notes}")
    if tensor["empty"]:
        lines.append(f"  holding nothing: {label(tensor['empty'])[1:-1]}")
    return "\n".join(lines)


def _span(shard: RankShard, dim: int) -> tuple[int, int]:
    return shard.offsets[dim], shard.offsets[dim] + shard.local_shape[dim]


def empty_ranks(report: ShardingReport) -> list[int]:
    return [s.rank for s in report.shards if 0 in s.local_shape and s.local_shape]


def default_dims(report: ShardingReport) -> tuple[int, ...]:
    """The two dims worth drawing: sharded ones first, else the last two."""
    n = len(report.global_shape)
    if n <= 2:
        return tuple(range(n))
    sharded = sorted({int(m[1]) for p in report.placements
                      if (m := re.match(r"(?:Shard\(|strided shard on dim )(\d+)", p))})
    rest = [d for d in range(n) if d not in sharded]
    return tuple(sorted((sharded + rest[::-1])[:2]))


def tensor_state(report: ShardingReport, dims: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Everything the front end needs to draw one tensor."""
    dims = default_dims(report) if dims is None else dims
    return {
        "name": report.name, "kind": report.kind, "shape": report.global_shape,
        "dtype": report.dtype, "mesh_shape": report.mesh_shape, "mesh_axes": report.mesh_axes,
        "placements": report.placements, "dims": list(dims), "blocks": blocks(report, dims),
        "empty": empty_ranks(report), "partial": report.partial,
    }


def module_rows(report: ModuleReport) -> list[dict[str, Any]]:
    """The module table: one row per parameter or buffer."""
    return [{"name": t.name, "shape": t.global_shape, "dtype": t.dtype,
             "placements": ", ".join(t.placements) or "(local)",
             "buffer": t.name in report.buffers,
             "bytes": {str(r): n for r, n in sorted(t.bytes_per_rank().items())}}
            for t in report.tensors]


class ShardingView(anywidget.AnyWidget):
    """Which rank holds which block of a tensor (or of each parameter of a module)."""

    _esm = Path(__file__).with_name("sharding.js")
    _css = Path(__file__).with_name("sharding.css")

    tensor = traitlets.Dict(help="the drawn tensor: shape, placements, blocks").tag(sync=True)
    rows: traitlets.List[Any] = traitlets.List(
        help="module table rows; empty for a single tensor").tag(sync=True)
    totals = traitlets.Dict(help="bytes per rank over the whole module").tag(sync=True)
    selected = traitlets.Int(0, help="index of the module row being drawn").tag(sync=True)
    dims = traitlets.List(traitlets.Int(), help="the tensor dims drawn as rows, columns").tag(
        sync=True)

    def __init__(self, report: ShardingReport | ModuleReport, **kwargs: Any) -> None:
        self.report = report
        super().__init__(**kwargs)
        if isinstance(report, ModuleReport):
            self.rows = module_rows(report)
            self.totals = {str(r): n for r, n in sorted(report.bytes_per_rank().items())}
        self._draw()

    def _current(self) -> ShardingReport | None:
        if isinstance(self.report, ModuleReport):
            tensors = self.report.tensors
            return tensors[self.selected] if 0 <= self.selected < len(tensors) else None
        return self.report

    def _draw(self, dims: tuple[int, ...] | None = None) -> None:
        current = self._current()
        self.tensor = tensor_state(current, dims) if current is not None else {}

    @traitlets.observe("selected")
    def _on_select(self, change: dict[str, Any]) -> None:
        self._draw()

    @traitlets.observe("dims")
    def _on_dims(self, change: dict[str, Any]) -> None:
        current = self._current()
        dims = tuple(change["new"])
        if current is not None and dims != tuple(self.tensor.get("dims", ())) and \
                len(set(dims)) == len(dims) and all(0 <= d < len(current.global_shape)
                                                    for d in dims):
            self._draw(dims)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        data = bundle[0] if isinstance(bundle, tuple) else bundle
        if data is not None:
            data["text/html"] = self._repr_html_()  # for front ends without widgets
            data["text/plain"] = self.text()  # for a terminal, a log, a saved notebook's diff
        return bundle

    def text(self) -> str:
        """The drawn tensor as text: ranks, their rows and columns, local shapes."""
        return text_form(self.tensor)

    def __repr__(self) -> str:
        return self.text()

    def _repr_html_(self) -> str:
        return render_html(self.tensor, self.rows, self.totals)


def render_html(tensor: dict[str, Any], rows: list[dict[str, Any]],
                totals: dict[str, int]) -> str:
    """A static drawing of the same blocks, for front ends without widget support."""
    parts = []
    if rows:
        head = "".join(f"<th>rank {r}</th>" for r in totals)
        body = "".join(
            f"<tr><td>{html.escape(row['name'])}</td><td>{row['shape']}</td>"
            f"<td>{html.escape(row['placements'])}</td>"
            + "".join(f"<td>{_size(row['bytes'].get(r, 0))}</td>" for r in totals) + "</tr>"
            for row in rows)
        total = "".join(f"<td><b>{_size(n)}</b></td>" for n in totals.values())
        parts.append(f"<table class='meshlab-params'><tr><th>name</th><th>shape</th>"
                     f"<th>placements</th>{head}</tr>{body}<tr><td><b>total</b></td><td></td>"
                     f"<td></td>{total}</tr></table>")
    if tensor:
        parts.append(_tensor_html(tensor))
    return f"<div class='meshlab-sharding'>{''.join(parts)}</div>"


def _tensor_html(t: dict[str, Any]) -> str:
    shape, dims = t["shape"], t["dims"]
    n_rows = shape[dims[0]] if dims else 1
    n_cols = shape[dims[1]] if len(dims) > 1 else 1
    n_rows, n_cols = max(n_rows, 1), max(n_cols, 1)
    scale = min(360 / n_cols, 360 / n_rows)  # the tensor's aspect ratio, within 360 x 360
    width, height = max(40.0, n_cols * scale), max(24.0, n_rows * scale)
    boxes = []
    for b in t["blocks"]:
        x, w = b["c0"] / n_cols * width, (b["c1"] - b["c0"]) / n_cols * width
        y, h = b["r0"] / n_rows * height, (b["r1"] - b["r0"]) / n_rows * height
        note = " (replicated)" if b["replicated"] else ""
        note += " (partial: pending reduction)" if b["partial"] else ""
        fill = "".join(f"{k}:{v};" for k, v in b["fill"].items())
        boxes.append(
            f"<div class='meshlab-block' data-ranks='{format_ranks(b['ranks'])}' "
            f"title='{b['label']} {b['ranges']}{note}' style='position:absolute;"
            f"left:{x:.1f}px;top:{y:.1f}px;width:{w:.1f}px;height:{h:.1f}px;{fill}"
            f"border:1px solid #fff;box-sizing:border-box;font:12px sans-serif;"
            f"overflow:hidden'><span style='color:{b['text']};background-color:{b['color']};"
            f"padding:0 2px'>{b['label']}</span></div>")
    caption = (f"<b>{html.escape(t['name'] or 'tensor')}</b> {t['shape']} {t['dtype']}"
               f" &middot; {', '.join(t['placements']) or 'local tensor'}"
               + (f" on mesh {t['mesh_shape']} {t['mesh_axes']}" if t["mesh_shape"] else "")
               + f" &middot; drawing dims {dims}")
    empty = f"<div>holding nothing: {label(t['empty'])}</div>" if t["empty"] else ""
    return (f"<div>{caption}</div><div style='position:relative;width:{width:.0f}px;"
            f"height:{height:.0f}px'>{''.join(boxes)}</div>{empty}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
