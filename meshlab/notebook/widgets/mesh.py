"""The mesh as a grid of ranks with their coordinates, and its process groups as a table."""

from __future__ import annotations

import html
from itertools import product

import pandas as pd

from meshlab.mesh import MeshSpec, coordinates
from meshlab.notebook.ranks import format_ranks

_PALETTE = ["#e8f1fb", "#fdf1e3", "#eaf7ea", "#f6e9f7", "#fbf8dd", "#e6f6f7", "#f9e6e6"]


# ep's split of dp_shard: mesh dimensions meshlab builds, not axes a user asks for
INTERNAL = ("dp_shard_mod_ep", "dp_shard_in_ep")


def shown_groups(spec: MeshSpec) -> dict[str, list[list[int]]]:
    """The axes and views a user sees, with their groups: the axes they asked for (and ep),
    then each view whose groups no row above has (``dp`` on a plain ``dp=4`` mesh is
    dp_shard again). Every name in ``spec.groups()`` still works as ``mesh[name]``."""
    groups = spec.groups()
    shown = {name: groups[name] for name in _asked(spec)}
    for name, g in groups.items():
        if name not in shown and name not in INTERNAL and g not in shown.values():
            shown[name] = g
    return shown


def group_table(spec: MeshSpec, host_of: list[str] | None = None) -> pd.DataFrame:
    """One row per axis asked for and per view that groups the ranks differently: its size,
    how many groups, and each group's ranks; on several hosts, how many hosts a group
    spans."""
    several = host_of is not None and len(set(host_of)) > 1
    asked = _asked(spec)
    views = spec.views()
    rows = []
    for name, groups in shown_groups(spec).items():
        spans = dict.fromkeys("dp_shard" if d in INTERNAL else d for d in views.get(name, ()))
        row = {
            "axis": name,
            "size": len(groups[0]),
            "spans": " x ".join(spans) if name not in asked else "",
            "groups": len(groups),
            "ranks": "  ".join(f"[{format_ranks(g)}]" for g in groups),
        }
        if several and host_of is not None:
            row["hosts"] = max(len({host_of[r] for r in g}) for g in groups)
        rows.append(row)
    return pd.DataFrame(rows).set_index("axis")


def user_coordinates(spec: MeshSpec) -> dict[int, dict[str, int]]:
    """rank -> {axis: index} along the axes the user asked for (and ep): its place in its
    group of each (ep's split of dp_shard folded back into dp_shard)."""
    groups = spec.groups()
    place = {name: {r: i for g in groups[name] for i, r in enumerate(g)} for name in _asked(spec)}
    return {rank: {name: at[rank] for name, at in place.items()} for rank in range(spec.size)}


def _asked(spec: MeshSpec) -> list[str]:
    """The axes the user asked for, and ep."""
    return [*spec.axes(), *(["ep"] if spec.ep > 1 else [])]


def _dim_name(spec: MeshSpec, dim: str) -> str:
    """A mesh dimension as the grid's directions name it: ep's split of dp_shard in words."""
    if dim == "dp_shard_in_ep":
        return "ep" if spec.cp == 1 else "dp_shard in ep"
    return "ep group" if dim == "dp_shard_mod_ep" else dim


class MeshView:
    """Ranks laid out on the mesh grid: last axis across, the one before down, others as panels."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec

    def _repr_html_(self) -> str:
        dims = self.spec.mesh_axes()
        names = [_dim_name(self.spec, d) for d in dims]
        shape = list(dims.values())
        coords = coordinates(self.spec)
        labels = user_coordinates(self.spec)
        rank_at = {tuple(c.values()): r for r, c in coords.items()}
        cols = shape[-1]
        rows = shape[-2] if len(shape) > 1 else 1
        outer = shape[:-2] if len(shape) > 2 else []
        panels = []
        for i, fixed in enumerate(product(*[range(n) for n in outer])):
            title = ", ".join(f"{n}={v}" for n, v in zip(names, fixed, strict=False))
            cells = []
            for r in range(rows):
                tds = []
                for c in range(cols):
                    key = (*fixed, r, c) if len(shape) > 1 else (c,)
                    rank = rank_at[key]
                    label = " ".join(f"{n}={v}" for n, v in labels[rank].items())
                    tds.append(
                        f'<td class="meshlab-rank" data-rank="{rank}" title="{html.escape(label)}"'
                        f' style="border:1px solid #999;padding:4px 8px;text-align:center;'
                        f'background:{_PALETTE[i % len(_PALETTE)]}">'
                        f"<b>rank {rank}</b><br><small>{html.escape(label)}</small></td>")
                cells.append(f"<tr>{''.join(tds)}</tr>")
            head = (f"<caption style='text-align:left'>{html.escape(title)}</caption>"
                    if title else "")
            panels.append(f"<table style='border-collapse:collapse;margin:4px'>{head}"
                          f"{''.join(cells)}</table>")
        directions = f"{names[-1]} →" + (f", {names[-2]} ↓" if len(names) > 1 else "")
        return (f"<div class='meshlab-mesh'><div><b>mesh</b> {html.escape(str(self.spec))}"
                f" <small>({directions})</small></div>"
                f"<div style='display:flex;flex-wrap:wrap'>{''.join(panels)}</div></div>")

    def __repr__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(f"{n}={v}" for n, v in c.items())
                         for r, c in user_coordinates(self.spec).items())
