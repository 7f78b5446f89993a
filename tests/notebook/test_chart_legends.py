"""A chart never disagrees with the text beside it (issue 61, item 1): every legend entry has
a mark one can see, one legend shows one field, a colour means one thing, axes span their
data, and labels are promised only where drawn. Checked on Vega's own layout
(chart_truth.py on drawn.py), first for the cases a reviewer found running the tour, then
for every chart function on small inputs of its own.

The tour's charts are drawn by their notebook cells, run here on data shaped as the cells
before them pull it (the cells after a `%mesh pull` are plain Python)."""

from __future__ import annotations

from typing import Any

import pandas as pd
from chart_truth import assert_axes_fit, assert_legends_true
from drawn import drawing

from meshlab.notebook import charts


def assert_true_to_its_data(chart: Any) -> None:
    assert_legends_true(chart)
    assert_axes_fit(chart)


def _curves(runs: dict[str, float], steps: int = 12, column: str = "run",
            start: int = 0) -> pd.DataFrame:
    """Loss curves falling from about 5.5, each run ``offset`` (relative) from the first."""
    return pd.DataFrame([{column: run, "step": s, "loss": (5.5 - 0.2 * s) * (1 + offset)}
                         for run, offset in runs.items() for s in range(start, start + steps)])


# -- chart functions, in the cases the tour showed ------------------------------------------

def _losses(offsets: dict[str, float]) -> pd.DataFrame:
    curves = _curves(offsets, steps=6)
    first = curves[curves["run"] == next(iter(offsets))].set_index("step")["loss"]
    return curves.assign(layout=curves["run"], code="abc123",
                         difference=[abs(v - first[s]) / abs(first[s]) for s, v in
                                     zip(curves["step"], curves["loss"], strict=True)])


def test_two_runs_with_identical_losses_are_both_in_sight() -> None:
    # %mesh losses of notebook 18: ddp and zero3 bit-equal, one curve hidden under the other
    chart = charts.losses_chart(_losses({"ddp": 0.0, "zero3": 0.0, "tp": 0.02}), "ddp")
    assert_true_to_its_data(chart)
    assert "zero3 (same as ddp)" in [e.label for e in drawing(chart).entries]
