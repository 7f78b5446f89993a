"""Runs' losses as the notebook shows them (``%mesh losses``): the verdict, the steps side by
side, and the curves (charts/losses.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from meshlab.notebook.tables.layout_diff import sci
from meshlab.notebook.tables.table import Lines, Table
from meshlab.verify.loss_curves import relative

if TYPE_CHECKING:
    from meshlab.verify.loss_curves import LossComparison


def losses_frame(comparison: LossComparison) -> pd.DataFrame:
    """One row per (run, step) of the steps every run has: its loss and its relative
    difference from the first run's."""
    base = comparison.runs[0]
    return pd.DataFrame([{"run": r.name, "layout": r.layout, "code": r.code, "step": s,
                          "loss": r.losses[s],
                          "difference": relative(r.losses[s], base.losses[s])}
                         for r in comparison.runs for s in comparison.steps])


def losses_views(comparison: LossComparison) -> list[Any]:
    """What ``%mesh losses`` shows: the verdict, a table of the steps, the curves."""
    from meshlab.notebook.charts import losses_chart

    views: list[Any] = [Lines(str(comparison))]
    if comparison.steps:
        rows = pd.DataFrame(comparison.rows())
        views.append(Table(rows, caption="each run's loss by step, and the largest relative "
                           f"difference from {comparison.runs[0].name}'s",
                           formats={"largest difference": sci}))
        views.append(losses_chart(losses_frame(comparison), comparison.runs[0].name))
    return views
