"""Costs measured on the ranks for the schedule simulator: one time per action kind.

Below both stepping (the step re-simulated with them) and pipeline_bubbles (the bubble
beside the simulator's), so neither imports the other to get them.
"""

from __future__ import annotations

import pandas as pd

from meshlab.schedules import Costs, Schedule


def measured_costs(measured: pd.DataFrame, schedule: Schedule) -> Costs:
    """Median measured time per kind, scaled back to a rank's whole share of the model."""
    per_kind = (measured["end"] - measured["start"]).groupby(measured["kind"]).median()
    scale = schedule.stages / schedule.ranks
    kinds = {k: float(v) * scale for k, v in per_kind.items()}
    if "I" in kinds:
        return Costs(forward=kinds["F"], backward_input=kinds["I"],
                     backward_weight=kinds.get("W", 0.0))
    return Costs(forward=kinds["F"], backward=kinds.get("B", 2 * kinds["F"]))
