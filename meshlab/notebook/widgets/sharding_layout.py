"""What the sharding widget draws, as plain data: a tensor's blocks with their ranks, pixel
boxes, styles and labels, one part per holder of a different tensor, and the same as text.

Computed here, in Python, so the widget (sharding.js) and its static HTML (sharding.py's
``render_html``) draw the same thing. Only the ranks of one DTensor share a part; a block
several of them hold is a replica.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from meshlab.measure.sharding import ModuleReport, RankShard, ShardingReport
from meshlab.notebook.palette import rank_colour, text_colour
from meshlab.notebook.ranks import format_ranks, label

# diagonal stripes over the rank colour: a Partial value still owes a reduction
HATCH = "repeating-linear-gradient(45deg, rgba(255,255,255,.55) 0 4px, transparent 4px 8px)"

# Text widths in em, wide enough for DejaVu Sans (headless browsers' fallback font, wider
# than the usual UI fonts): a label that fits by this measure fits on screen.
_EM = {**dict.fromkeys(" ·,.'", 0.32), **dict.fromkeys(":;", 0.34), "-": 0.36,
       **dict.fromkeys("ijlI", 0.3), **dict.fromkeys("frt[]()", 0.42), "m": 0.98, "w": 0.82,
       "M": 0.87, "W": 0.99}
# a line of 12px (label) or 11px (ranges, note) text, and a block's border + padding + the
# label's own padding, across and down
_LINE = {12: 15, 11: 14, 10: 12}
_PAD_X, _PAD_Y, _BAND = 8, 6, 4
_BORDER = "1px solid #fff"


def blocks(report: ShardingReport, dims: tuple[int, ...] | None = None
           ) -> list[dict[str, Any]]:
    """Every distinct tensor's blocks (``part``: which one), projected on ``dims`` (one or
    two tensor dims; a tensor they do not fit is drawn on its own default dims), with their
    pixel boxes and labels.

    Within one tensor, ranks whose pieces cover the same rectangle share a block: replicas
    when their pieces are the same (same offsets and shape, no pending reduction); pieces
    that differ only in undrawn dims share it too, noted "split on dim d".
    """
    parts = report.distinct()
    box = _box(len(parts))
    out: list[dict[str, Any]] = []
    for index, part in enumerate(parts):
        out += _part_blocks(part, _dims_for(part, dims), index, box)
    return out


def _part_blocks(part: ShardingReport, dims: tuple[int, ...], index: int, box: float
                 ) -> list[dict[str, Any]]:
    ndim = len(part.global_shape)
    width, height, n_rows, n_cols = _grid(part.global_shape, dims, box)
    by_box: dict[tuple[int, int, int, int], list[RankShard]] = {}
    for shard in part.shards:
        if 0 in shard.local_shape and ndim:
            continue  # holds nothing
        r0, r1 = _span(shard, dims[0]) if dims else (0, 1)
        c0, c1 = _span(shard, dims[1]) if len(dims) > 1 else (0, 1)
        by_box.setdefault((r0, r1, c0, c1), []).append(shard)
    out = []
    for (r0, r1, c0, c1), group in sorted(by_box.items()):
        ranks = [s.rank for s in group]
        colours = [rank_colour(r) for r in ranks]  # rank r has one colour in every picture
        same = all((s.offsets, s.local_shape) == (group[0].offsets, group[0].local_shape)
                   for s in group)
        replicated = len(ranks) > 1 and part.kind == "dtensor" and same and not part.partial
        split = sorted({d for d in range(ndim) if d not in dims
                        and len({s.offsets[d] for s in group}) > 1})
        note = ("partial: pending reduction" if part.partial else "replicated" if replicated
                else f"split on dim {', '.join(map(str, split))}" if split else "")
        block: dict[str, Any] = {
            "part": index, "r0": r0, "r1": r1, "c0": c0, "c1": c1, "ranks": ranks,
            "data_ranks": format_ranks(ranks), "label": label(ranks),
            "short": f"r{format_ranks(ranks)}", "ranges": _ranges(r0, r1, c0, c1, ndim),
            "note": note, "color": colours[0], "colors": colours,
            "text": text_colour(colours[0]), "replicated": replicated,
            "partial": part.partial, "detail": [_detail(s) for s in group],
            "x": c0 / n_cols * width, "y": r0 / n_rows * height,
            "w": (c1 - c0) / n_cols * width, "h": (r1 - r0) / n_rows * height,
        }
        block["fill"] = background(block)
        _fit(block)
        out.append(block)
    return out


def _detail(shard: Any) -> dict[str, Any]:
    """One holder's shard for the hover line; its mesh coordinates as ``[axis, index]`` pairs
    in the mesh's order (a saved notebook's JSON sorts an object's keys)."""
    return {**asdict(shard), "place": [[a, i] for a, i in shard.place.items()]}


def _fit(block: dict[str, Any]) -> None:
    """Choose what the block shows so that nothing is cut: its label, ranges and note; or
    less, the rest going to the key under the grid (the short label ``r0-3`` across, then
    upright, then smaller; a block too small for any text has only its key line)."""
    band = _BAND if len(block["ranks"]) > 1 else 0
    note = [(block["note"], 11, "meshlab-note")] if block["note"] else []
    label_line = (block["label"], 12, "meshlab-label")
    short, small = (block["short"], 12, "meshlab-label"), (block["short"], 10, "meshlab-label")
    tries: list[tuple[str, list[tuple[str, int, str]], bool]] = [
        ("full", [label_line, (block["ranges"], 11, "meshlab-range"), *note], False),
        ("label", [label_line, *note], False), ("short", [short], False),
        ("upright", [short], True), ("small", [small], False), ("small upright", [small], True)]
    fit, lines, upright = next(((f, lines, up) for f, lines, up in tries
                                if _fits(lines, block["w"], block["h"] - band, up)),
                               ("none", [], False))
    block["fit"] = fit
    block["key"] = None if fit == "full" else {
        "swatch": _swatch(block["color"]),
        "text": f"{block['label'][1:-1]} · {block['ranges']}"
                + (f" · {block['note']}" if block["note"] else "")}
    block["style"] = {
        "position": "absolute", "box-sizing": "border-box", "left": f"{block['x']:.1f}px",
        "top": f"{block['y']:.1f}px", "width": f"{block['w']:.1f}px",
        "height": f"{block['h']:.1f}px", "border": _BORDER, "padding": f"{band + 2}px 2px 2px",
        "overflow": "visible", "display": "flex", "flex-direction": "column",
        "align-items": "flex-start", **block["fill"]}
    # the label sits on its block's colour, in black or white, over the hatch and the band
    block["lines"] = [{"text": text, "class": cls, "style": {
        "color": block["text"], "background-color": block["color"], "padding": "0 1px",
        "white-space": "nowrap", "font-size": f"{size}px", "line-height": f"{_LINE[size]}px",
        **({"writing-mode": "vertical-rl"} if upright else {})}} for text, size, cls in lines]
    # every holder's colour, in equal segments along the top edge: never stripes that read
    # like columns of the tensor
    block["band"] = [{"position": "absolute", "top": "0", "height": f"{band}px",
                      "left": f"{i * 100 / len(block['colors']):.2f}%",
                      "width": f"{100 / len(block['colors']):.2f}%", "background-color": c,
                      "border-bottom": _BORDER, "box-sizing": "content-box"}
                     for i, c in enumerate(block["colors"])] if band else []


def _fits(lines: list[tuple[str, int, str]], w: float, h: float, upright: bool) -> bool:
    across = max(_text_px(text, size) for text, size, _ in lines) + _PAD_X
    down = sum(_LINE[size] for _, size, _ in lines) + _PAD_Y
    return (down <= w and across <= h) if upright else (across <= w and down <= h)


def _text_px(text: str, size: int) -> float:
    return 1.05 * size * sum(_EM.get(ch, 0.72 if ch.isupper() else 0.64) for ch in text)


def _grid(shape: list[int], dims: tuple[int, ...], box: float
          ) -> tuple[float, float, int, int]:
    """Pixel width and height of a tensor's grid, and its rows and columns: the tensor's
    aspect ratio within box x box, up to 4:1 (a thinner tensor is drawn 4:1, so that its
    blocks keep room for their labels; the caption says its shape)."""
    n_rows = max(shape[dims[0]], 1) if dims else 1
    n_cols = max(shape[dims[1]], 1) if len(dims) > 1 else 1
    scale = min(box / n_cols, box / n_rows)
    return max(box / 4, n_cols * scale), max(box / 4, n_rows * scale), n_rows, n_cols


def _box(parts: int) -> float:
    """The largest side of one grid: smaller when several tensors are drawn side by side."""
    return 360.0 if parts == 1 else 240.0 if parts == 2 else 180.0 if parts <= 4 else 120.0


def _ranges(r0: int, r1: int, c0: int, c1: int, ndim: int) -> str:
    """``rows 0-3 · cols 3-5`` (inclusive), as far as the tensor has rows and columns."""
    def span(a: int, b: int) -> str:
        return f"{a}" if b - a == 1 else f"{a}-{b - 1}"

    if ndim == 0:
        return "the scalar"
    return f"rows {span(r0, r1)}" + (f" · cols {span(c0, c1)}" if ndim > 1 else "")


def background(block: dict[str, Any]) -> dict[str, str]:
    """CSS of a block: its first rank's colour, and the hatch over it when the value is
    Partial (widget and HTML fallback alike; never the `background` shorthand, which would
    reset the hatch)."""
    css = {"background-color": block["colors"][0]}
    if block["partial"]:
        css["background-image"] = HATCH
    return css


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


def _dims_for(report: ShardingReport, dims: tuple[int, ...] | None) -> tuple[int, ...]:
    n = len(report.global_shape)
    if dims is None or len(dims) != min(n, 2) or len(set(dims)) != len(dims) or \
            not all(0 <= d < n for d in dims):
        return default_dims(report)
    return tuple(dims)


def _layout(report: ShardingReport) -> str:
    """``Shard(0), Replicate() on mesh [2, 2] (dp_shard, tp)``, or a plain tensor's owner."""
    if report.kind != "dtensor":
        ranks = sorted({s.rank for s in report.shards})
        return (f"local tensor of {label(ranks)[1:-1]}" if ranks
                else "local tensor (one per rank)")
    return (", ".join(report.placements)
            + (f" on mesh {list(report.mesh_shape)} ({', '.join(report.mesh_axes)})"
               if report.mesh_shape else ""))


def _where(report: ShardingReport) -> str:
    """The session-mesh coordinates every holder of the tensor shares: ``pp 1, tp 0``."""
    places = [s.place for s in report.shards if s.place]
    if not places:
        return ""
    common = {k: v for k, v in places[0].items() if all(p.get(k) == v for p in places)}
    return ", ".join(f"{k} {v}" for k, v in common.items())


def _part_state(part: ShardingReport, index: int, dims: tuple[int, ...], box: float,
                drawn: list[dict[str, Any]]) -> dict[str, Any]:
    ranks = sorted({s.rank for s in part.shards})
    who = label(ranks)[1:-1] if ranks else "no rank"
    where = _where(part)
    what = part.fqn or part.name or "tensor"
    experts = ""
    if part.experts:
        experts = f"experts {format_ranks(part.experts)}" + (
            f" of {part.n_experts}" if part.n_experts else "")
    width, height, _, _ = _grid(part.global_shape, dims, box)
    return {
        "index": index, "ranks": ranks, "data_ranks": format_ranks(ranks), "who": who,
        "where": where, "name": what,
        "fqn": part.fqn, "kind": part.kind, "shape": part.global_shape, "dtype": part.dtype,
        "placements": part.placements, "mesh_shape": part.mesh_shape,
        "mesh_axes": part.mesh_axes, "mesh_ranks": part.mesh_ranks, "dims": list(dims),
        "partial": part.partial, "empty": empty_ranks(part), "experts": part.experts,
        "n_experts": part.n_experts, "width": width, "height": height,
        "empty_text": (f"holding nothing: {label(empty_ranks(part))[1:-1]}"
                       if empty_ranks(part) else ""),
        "holder": who + (f" ({where})" if where else ""),
        "holds": f"{what} {list(part.global_shape)} {part.dtype} · {_layout(part)}"
                 + (f" · {experts}" if experts else ""),
        "key": [b["key"] for b in drawn if b["part"] == index and b["key"]],
        "panel_width": max(width, 200.0),
    }


def tensor_state(report: ShardingReport, dims: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Everything the front end needs to draw one tensor (or the several tensors the ranks
    hold under its name, ``parts``, each in its own grid)."""
    parts = report.distinct()
    box = _box(len(parts))
    drawn = blocks(report, dims)
    states = [_part_state(p, i, _dims_for(p, dims), box, drawn) for i, p in enumerate(parts)]
    first = states[0]
    if len(parts) == 1:
        head = (f"{list(report.global_shape)} {report.dtype} · {_layout(parts[0])}"
                + (f" · {report.fqn}" if report.fqn and report.fqn != report.name else ""))
    else:
        why = ("a plain tensor is its rank's own, never a replica"
               if all(p.kind != "dtensor" for p in parts)
               else "different tensors of the model or different meshes, not replicas")
        head = f"· {len(parts)} different tensors, drawn per holder: {why}"
    return {
        "name": report.name, "kind": report.kind, "shape": first["shape"],
        "dtype": report.dtype, "mesh_shape": report.mesh_shape, "mesh_axes": report.mesh_axes,
        "placements": report.placements, "dims": first["dims"], "blocks": drawn,
        "empty": [r for p in states for r in p["empty"]],
        "partial": any(p["partial"] for p in states), "head": head, "parts": states,
    }


def text_form(tensor: dict[str, Any]) -> str:
    """The drawing as lines to paste into a log: one per block (ranges inclusive), under a
    caption per holder when the ranks hold different tensors."""
    if not tensor:
        return "(no tensor)"
    lines = [f"{tensor['name'] or 'tensor'} {tensor['head']}"]
    several = len(tensor["parts"]) > 1
    indent = "    " if several else "  "
    for part in tensor["parts"]:
        if several:
            lines.append(f"  {part['holder']} · {part['holds']}")
        for b in (b for b in tensor["blocks"] if b["part"] == part["index"]):
            shard = b["detail"][0]
            lines.append(f"{indent}{b['ranges']}: {b['label'][1:-1]} · local "
                         f"{list(shard['local_shape'])}, {size_text(shard['bytes'])} each"
                         + (f" · {b['note']}" if b["note"] else ""))
        if part["empty_text"]:
            lines.append(f"{indent}{part['empty_text']}")
    return "\n".join(lines)


def module_rows(report: ModuleReport) -> list[dict[str, Any]]:
    """The module table: one row per parameter or buffer."""
    return [{"name": t.name, "shape": t.global_shape, "dtype": t.dtype,
             "placements": ", ".join(t.placements) or "(local)",
             "buffer": t.name in report.buffers,
             "bytes": {str(r): n for r, n in sorted(t.bytes_per_rank().items())}}
            for t in report.tensors]


def _swatch(colour: str) -> dict[str, str]:
    """A key line's square of its block's colour."""
    return {"display": "inline-block", "width": "10px", "height": "10px",
            "margin-right": "4px", "vertical-align": "-1px", "background-color": colour}


def size_text(n: int) -> str:
    """Bytes as the widget writes them: ``48 B``, ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)
