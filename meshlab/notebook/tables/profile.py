"""What ``%%mesh --profile`` shows: the timeline, the time per rank by kind of work, the
collectives that made ranks wait, and who the stragglers were."""

from __future__ import annotations

from typing import Any

import pandas as pd

from meshlab.notebook.cell_profile import CellProfile
from meshlab.notebook.charts import profile_chart
from meshlab.notebook.tables.table import Table, in_byte_unit, sig

DRAWN_SPANS = 600  # per rank: neighbouring ops closer than the window / this are one bar


def clock_note(profile: CellProfile) -> str:
    """How the ranks' clocks were put on one axis, and how far off that can be."""
    hows = {c.how for c in profile.clocks.values()}
    if hows == {"same machine"}:
        return "every rank runs on the notebook's machine: one clock, no offset to measure"
    drift = max(abs(c.drift_ns) for c in profile.clocks.values()) / 1e6
    return (f"ranks on other machines: clock offsets measured before and after the cell "
            f"(as NTP does), drift {drift:.3f} ms; two ranks' instants may be off by up to "
            f"{profile.clock_error_ms:.3f} ms")


def summary_table(profile: CellProfile) -> Table:
    """Per rank, in ms: compute, copies, communication hidden and exposed (per axis too),
    idle, and waits at collectives."""
    frame = profile.summary()
    stragglers = profile.stragglers()
    return Table(frame.reset_index(), formats={c: sig(3) for c in frame.columns
                                               if c != "last to arrive"},
                 caption="time per rank (ms): work, communication hidden behind it and "
                         "exposed, idle. " + ("Straggler: " + "; ".join(stragglers) if
                                               stragglers else "No straggler."),
                 note="comm hidden: a collective in flight while the rank computed or copied; "
                      "exposed: in flight with nothing else to do (waiting included); idle: "
                      "neither (Python between ops on a CPU rank, a pipeline bubble); waited "
                      "for others: at collectives, until the group's last member arrived. "
                      + clock_note(profile))


def waits_table(profile: CellProfile, top: int = 10) -> Table | None:
    """The collectives whose members waited longest for their last one."""
    frame = profile.collectives()
    if not len(frame):
        return None
    frame = frame.assign(longest=[max(w.values(), default=0.0) for w in frame["waits"]])
    frame = frame.sort_values("longest", ascending=False).head(top)
    rows = pd.DataFrame({
        "at (ms)": frame["first"], "op": frame["op"], "axis": frame["axis"],
        "group": frame["group"], "payload": frame["bytes"], "last to arrive": frame["last"],
        "others waited (ms)": [", ".join(f"{r}: {w:,.2f}" for r, w in sorted(ws.items()))
                               for ws in frame["waits"]],
        "done (ms)": frame["done"]})
    shown = in_byte_unit(rows, ["payload"])
    return Table(shown.frame, formats={"at (ms)": sig(4), "done (ms)": sig(4), **shown.formats},
                 caption=f"the {len(rows)} collectives with the longest waits for their "
                         "last rank")


def profile_views(profile: CellProfile) -> list[Any]:
    """The chart, the per-rank table, the longest waits and a line per straggler."""
    window = max(p.end_ns - p.start_ns for p in profile.ranks.values()) / 1e6
    views: list[Any] = [profile_chart(profile.spans(merge_ms=window / DRAWN_SPANS)),
                        summary_table(profile)]
    waits = waits_table(profile)
    if waits is not None:
        views.append(waits)
    return views
