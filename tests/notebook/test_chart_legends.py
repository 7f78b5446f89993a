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
from chart_truth import assert_axes_fit, assert_legends_true, legend_problems
from drawn import drawing

from meshlab.notebook import charts
from meshlab.notebook.bench import bench_chart
from meshlab.notebook.stepping import compare, grid_frame, plan_frame
from meshlab.schedules import Costs, build


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


def test_a_bound_pipeline_has_a_legend_for_its_outlines() -> None:
    # %mesh pipeline (05, 15): every action outlined, not run yet, and no legend at all
    grid = grid_frame(build("zb_h1", ranks=4, microbatches=4))
    for done in (0, 4):  # bound, and 4 slots stepped
        frame = grid.assign(state=["done" if s < done else "pending" for s in grid["slot"]],
                            view="the grid being stepped", unit="slots")
        chart = charts.timeline_chart(frame)
        assert [e.label for e in drawing(chart).entries] == ["F", "I", "W"]
        assert_true_to_its_data(chart)


def test_a_schedule_too_dense_to_label_promises_no_labels() -> None:
    # notebook 11: GPipe on 32 stages, 8 micro-batches: no bar wide enough for its label
    timelines = compare([build("gpipe", ranks=32, microbatches=8)], Costs(forward=1,
                                                                         backward=2))[0]
    drawn = drawing(charts.timeline_chart(plan_frame(timelines)))
    assert not drawn.labels
    assert not any("bar labels" in t for t in drawn.texts), drawn.texts
    wide = drawing(charts.timeline_chart(plan_frame(compare(
        [build("gpipe", ranks=2, microbatches=2)], Costs())[0])))
    assert wide.labels and any("bar labels: micro-batch" in t for t in wide.texts)


def _bench(ranks: int = 4) -> pd.DataFrame:
    """%mesh bench of a wrong kernel on ``ranks`` ranks: Triton wrong, torch the reference."""
    return pd.DataFrame([
        {"rank": r, "provider": p, "size": s, "median_ms": (1 + r / 10) * s / 256,
         "gbps": 1.0, "p20_ms": 0.9, "p80_ms": 1.1, "kernel": "forgot_the_relu",
         "mode": "fwd", "dtype": "float32", "max_error": 0.0 if p == "torch" else 1.0,
         "timer": "cpu wall clock" if p == "torch" else "interpreter",
         "correct": p == "torch", "error": None}
        for r in range(ranks) for p in ("triton", "torch") for s in (256, 1024)])


def test_a_wrong_results_cross_is_no_ranks_colour() -> None:
    # notebook 06: rank 3's red beside the red of the wrong-result cross
    assert_true_to_its_data(bench_chart(_bench(ranks=10)))


def _memory(offloaded: bool) -> pd.DataFrame:
    parts = {"params": 2**20, "grads": 2**20, "optimizer": 2**21, "activations": 2**19}
    rows = [{"rank": str(r), "source": "measured", **parts,
             "device": 2**20 if offloaded else 4.5 * 2**20,
             "host": 3.5 * 2**20 if offloaded else 0} for r in range(2)]
    rows.append({"rank": "ZeRO-3 formula", "source": "formula", **parts, "device": 0,
                 "host": 0})
    return pd.DataFrame(rows).set_index("rank")


def test_offloaded_memory_places_are_not_the_parts_colours() -> None:
    # slate "device" read as the parameters' blue, amber "host" as the gradients' orange
    assert not legend_problems(charts.memory_chart(_memory(offloaded=True)))
