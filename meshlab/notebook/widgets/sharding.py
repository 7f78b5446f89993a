"""The sharding widget: a tensor drawn as blocks coloured by the ranks that hold them.

It renders plain report data (meshlab.measure.sharding) and never calls torch.distributed. What it
draws is computed in ``sharding_layout`` (blocks, boxes, styles, labels, one part per holder
of a different tensor); the front end (sharding.js) and ``render_html``, the static drawing
for front ends without widgets, both draw that, so they show the same thing.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from meshlab.measure.memory import gathered_note
from meshlab.measure.sharding import ModuleReport, ShardingReport
from meshlab.notebook.tables.table import Lines
from meshlab.notebook.widgets.sharding_layout import (
    module_rows,
    size_text,
    tensor_state,
    text_form,
)


def sharding_views(report: ShardingReport | ModuleReport) -> list[Any]:
    """What ``%mesh inspect`` shows: a note where FSDP had to be resharded to read the shards
    (meshlab.measure.memory.reshard), then the view."""
    note = gathered_note(getattr(report, "resharded", []), getattr(report, "reset", False))
    return [*([Lines(note)] if note else []), ShardingView(report)]


class ShardingView(anywidget.AnyWidget):
    """Which rank holds which block of a tensor (or of each parameter of a module)."""

    _esm = Path(__file__).with_name("sharding.js")
    _css = Path(__file__).with_name("sharding.css")

    tensor = traitlets.Dict(help="the drawn tensor: shape, placements, blocks").tag(sync=True)
    rows: traitlets.List[Any] = traitlets.List(
        help="module table rows; empty for a single tensor").tag(sync=True)
    totals = traitlets.Dict(help="bytes per rank over the whole module").tag(sync=True)
    tensors: traitlets.List[Any] = traitlets.List(
        help="every row's drawing (a module): a saved notebook redraws the row clicked "
             "without its kernel").tag(sync=True)
    selected = traitlets.Int(0, help="index of the module row being drawn").tag(sync=True)
    dims = traitlets.List(traitlets.Int(), help="the tensor dims drawn as rows, columns").tag(
        sync=True)

    def __init__(self, report: ShardingReport | ModuleReport, **kwargs: Any) -> None:
        self.report = report
        super().__init__(**kwargs)
        if isinstance(report, ModuleReport):
            self.rows = module_rows(report)
            self.totals = {str(r): n for r, n in sorted(report.bytes_per_rank().items())}
            self.tensors = [tensor_state(t) for t in report.tensors]
        self._draw()

    def _current(self) -> ShardingReport | None:
        if isinstance(self.report, ModuleReport):
            tensors = self.report.tensors
            return tensors[self.selected] if 0 <= self.selected < len(tensors) else None
        return self.report

    def _draw(self, dims: tuple[int, ...] | None = None) -> None:
        current = self._current()
        if current is None:
            self.tensor = {}
        elif dims is None and self.tensors:
            self.tensor = self.tensors[self.selected]
        else:
            self.tensor = tensor_state(current, dims)

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
    """A static drawing of the same blocks, for front ends without widget support: inline
    styles only, no script."""
    parts = []
    if rows:
        head = "".join(f"<th>rank {r}</th>" for r in totals)
        body = "".join(
            f"<tr><td>{html.escape(row['name'])}</td><td>{row['shape']}</td>"
            f"<td>{html.escape(row['placements'])}</td>"
            + "".join(f"<td>{size_text(row['bytes'].get(r, 0))}</td>" for r in totals) + "</tr>"
            for row in rows)
        total = "".join(f"<td><b>{size_text(n)}</b></td>" for n in totals.values())
        parts.append(f"<table class='meshlab-params'><tr><th>name</th><th>shape</th>"
                     f"<th>placements</th>{head}</tr>{body}<tr><td><b>total</b></td><td></td>"
                     f"<td></td>{total}</tr></table>")
    if tensor:
        parts.append(_tensor_html(tensor))
    return f"<div class='meshlab-sharding' style='font:12px/1.4 sans-serif'>{''.join(parts)}</div>"


def _css(style: dict[str, str]) -> str:
    return html.escape("".join(f"{k}:{v};" for k, v in style.items()), quote=True)


def _tensor_html(t: dict[str, Any]) -> str:
    several = len(t["parts"]) > 1
    caption = (f"<b>{html.escape(t['name'] or 'tensor')}</b> {html.escape(t['head'])}"
               + (f" &middot; drawing dims {t['dims']}" if len(t["shape"]) > 2 else ""))
    panels = []
    for part in t["parts"]:
        boxes = []
        for b in (b for b in t["blocks"] if b["part"] == part["index"]):
            title = f"{b['label']} {b['ranges']}" + (f" ({b['note']})" if b["note"] else "")
            band = "".join(f"<div style='{_css(s)}'></div>" for s in b["band"])
            text = "".join(f"<span class='{line['class']}' style='{_css(line['style'])}'>"
                           f"{html.escape(line['text'])}</span>" for line in b["lines"])
            classes = "meshlab-block" + (" replicated" if b["replicated"] else "") + \
                (" partial" if b["partial"] else "")
            boxes.append(f"<div class='{classes}' data-ranks='{b['data_ranks']}' "
                         f"title='{html.escape(title, quote=True)}' style='{_css(b['style'])}'"
                         f">{band}{text}</div>")
        holder = (f"<div class='meshlab-holder'><b>{html.escape(part['holder'])}</b><br>"
                  f"{html.escape(part['holds'])}</div>" if several else "")
        key = "".join(f"<div><span style='{_css(k['swatch'])}'></span>"
                      f"{html.escape(k['text'])}</div>" for k in part["key"])
        empty = (f"<div class='meshlab-empty'>{part['empty_text']}</div>"
                 if part["empty_text"] else "")
        panels.append(
            f"<div class='meshlab-part' data-ranks='{part['data_ranks']}' "
            f"style='width:{part['panel_width']:.0f}px'>{holder}"
            f"<div class='meshlab-grid' style='position:relative;border:1px solid #888;"
            f"margin:6px 0;width:{part['width']:.0f}px;height:{part['height']:.0f}px'>"
            f"{''.join(boxes)}</div>"
            + (f"<div class='meshlab-key' style='font-size:11px'>{key}</div>" if key else "")
            + f"{empty}</div>")
    return (f"<div class='meshlab-caption'>{caption}</div><div class='meshlab-parts' style='"
            f"display:flex;flex-wrap:wrap;gap:8px 16px;align-items:flex-start'>"
            f"{''.join(panels)}</div>")
