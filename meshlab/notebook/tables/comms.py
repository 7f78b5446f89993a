"""Tables of the collectives a cell issued, per rank and in total, with mesh axis names."""

from __future__ import annotations

import pandas as pd

from meshlab.comms import CommRecord
from meshlab.mesh import MeshSpec
from meshlab.notebook.ranks import format_ranks

COLUMNS = ["rank", "op", "axis", "group", "count", "bytes", "wire_bytes"]


def axis_of(group: list[int], spec: MeshSpec | None, world_size: int) -> str:
    """The mesh axis (or view) whose groups include this one; else 'world' or the ranks."""
    if spec is not None:
        for name, groups in spec.groups().items():
            if sorted(group) in groups:
                return name
    return "world" if len(group) == world_size else f"ranks {format_ranks(group)}"


def comms_frame(per_rank: dict[int, list[CommRecord]], spec: MeshSpec | None,
                world_size: int) -> pd.DataFrame:
    """One row per (rank, op, group): how many calls and how many bytes."""
    rows = [{"rank": rank, "op": r.op, "axis": axis_of(r.group, spec, world_size),
             "group": f"[{format_ranks(r.group)}]", "count": 1, "bytes": r.bytes,
             "wire_bytes": r.wire_bytes}
            for rank, records in sorted(per_rank.items()) for r in records]
    frame = pd.DataFrame(rows, columns=COLUMNS)
    keys = ["rank", "op", "axis", "group"]
    return frame.groupby(keys, as_index=False, sort=True)[["count", "bytes", "wire_bytes"]].sum()


def comms_totals(frame: pd.DataFrame) -> pd.DataFrame:
    """Calls and bytes per (op, axis), summed over ranks."""
    totals = frame.groupby(["op", "axis"], as_index=False)[["count", "bytes", "wire_bytes"]].sum()
    return totals.sort_values("bytes", ascending=False, ignore_index=True)
