"""``%mesh schedule``'s comparison as the notebook shows it: one row per schedule."""

from __future__ import annotations

import pandas as pd

from meshlab.notebook.tables.table import Table, percent, sig

HEADERS = {"makespan": "makespan (cost units)", "bubble_fraction": "bubble",
           "peak_inflight": "peak in flight"}


def schedule_table(table: pd.DataFrame) -> Table:
    """Simulated schedules (``Timeline.summary`` rows): the makespan in the units of the
    costs given (``--costs``), the bubble as a percentage of the ranks' time."""
    shown = table.reset_index().rename(columns=HEADERS)
    return Table(shown, formats={"makespan (cost units)": sig(4), "bubble": percent(3)},
                 note="peak in flight: the most micro-batches any rank holds activations for at "
                      "once")
