"""Tables of the collectives a cell issued, per rank and in total, with mesh axis names."""

from __future__ import annotations

from typing import Any

import pandas as pd

from meshlab.measure.comms import CommRecord, op_label
from meshlab.mesh import MeshSpec
from meshlab.notebook.ranks import format_ranks
from meshlab.notebook.tables.table import Table, in_byte_unit

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
    """One row per (rank, op, group): how many calls and how many bytes; the send/recv of a
    meshlab all-reduce algorithm name it (``send (ring)``)."""
    rows = [{"rank": rank, "op": op_label(r.op, r.algorithm),
             "axis": axis_of(r.group, spec, world_size),
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


def comms_by_ranks(frame: pd.DataFrame) -> pd.DataFrame:
    """The per-rank table with ranks whose rows are all identical folded into one row per
    collective, ``ranks`` naming them (``0-3``), as cell output groups identical ranks.

    ``group`` differs from rank to rank (rank 1's tp group is not rank 3's), so ranks are
    compared on what they issued: op, axis, calls and bytes."""
    same = ["op", "axis", "count", "bytes", "wire_bytes"]
    rows = {int(str(rank)): tuple(map(tuple, part[same].itertuples(index=False)))
            for rank, part in frame.groupby("rank", sort=True)}
    by_rows: dict[tuple[tuple[Any, ...], ...], list[int]] = {}
    for rank, key in rows.items():
        by_rows.setdefault(key, []).append(rank)
    out = []
    for key, ranks in by_rows.items():
        groups = frame[frame["rank"].isin(ranks)].groupby(["op", "axis"], sort=False)["group"]
        group_text = groups.agg(lambda g: " ".join(dict.fromkeys(g)))
        for op, axis, count, nbytes, wire in key:
            out.append({"ranks": format_ranks(ranks), "op": op, "axis": axis,
                        "groups": group_text[(op, axis)], "count": count, "bytes": nbytes,
                        "wire_bytes": wire})
    return pd.DataFrame(out, columns=["ranks", "op", "axis", "groups", "count", "bytes",
                                      "wire_bytes"])


def comms_tables(frame: pd.DataFrame) -> tuple[Table, Table]:
    """What ``%%mesh --comms`` shows: identical ranks folded into one row, and the totals,
    each with a caption, the bytes in the unit of the chart (the frames keep bytes)."""
    wire = ("on the wire: what a ring algorithm sends per rank (e.g. 2(n-1)/n of an "
            "all_reduce)")
    per_rank = _in_unit(comms_by_ranks(frame), note=wire,
                        caption="collectives per rank (ranks that issued the same ones share a "
                                "row)")
    totals = _in_unit(comms_totals(frame),
                      caption="totals over all ranks, by collective and mesh axis")
    return per_rank, totals


def _in_unit(frame: pd.DataFrame, *, caption: str, note: str = "") -> Table:
    """Payload and wire bytes in one unit, as ``payload (KiB)`` and ``on the wire (KiB)``."""
    shown = in_byte_unit(frame.rename(columns={"bytes": "payload", "wire_bytes": "on the wire"}),
                         ["payload", "on the wire"])
    return Table(shown.frame, formats={"count": "{:,}", **shown.formats}, caption=caption,
                 note=note)
