"""The mesh as a grid of ranks with their coordinates, and its process groups as a table."""

from __future__ import annotations

import html
from itertools import product

import pandas as pd

from meshlab.mesh import MeshSpec, coordinates
from meshlab.notebook.ranks import format_ranks

_PALETTE = ["#e8f1fb", "#fdf1e3", "#eaf7ea", "#f6e9f7", "#fbf8dd", "#e6f6f7", "#f9e6e6"]


def group_table(spec: MeshSpec, host_of: list[str] | None = None) -> pd.DataFrame:
    """One row per axis or view: its size, how many groups, and each group's ranks; on
    several hosts, how many hosts a group spans."""
    dims = spec.mesh_axes()
    several = host_of is not None and len(set(host_of)) > 1
    rows = []
    for name, groups in spec.groups().items():
        spans = spec.views().get(name, (name,))
        row = {
            "axis": name,
            "size": len(groups[0]),
            "spans": " x ".join(spans) if name not in dims else "",
            "groups": len(groups),
            "ranks": "  ".join(f"[{format_ranks(g)}]" for g in groups),
        }
        if several and host_of is not None:
            row["hosts"] = max(len({host_of[r] for r in g}) for g in groups)
        rows.append(row)
    return pd.DataFrame(rows).set_index("axis")


class MeshView:
    """Ranks laid out on the mesh grid: last axis across, the one before down, others as panels."""

    def __init__(self, spec: MeshSpec) -> None:
        self.spec = spec

    def _repr_html_(self) -> str:
        dims = self.spec.mesh_axes()
        names, shape = list(dims), list(dims.values())
        coords = coordinates(self.spec)
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
                    label = " ".join(f"{n}={v}" for n, v in coords[rank].items())
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
        coords = coordinates(self.spec)
        return "\n".join(f"rank {r}: " + " ".join(f"{n}={v}" for n, v in c.items())
                         for r, c in coords.items())
