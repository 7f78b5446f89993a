"""A chart never disagrees with the text beside it (issue 61, item 1): every legend entry has
a mark one can see, one legend shows one field, a colour means one thing, axes span their
data, and labels are promised only where drawn. Checked on Vega's own layout
(chart_truth.py on drawn.py), first for the cases a reviewer found running the tour, then
for every chart function on small inputs of its own.

The tour's charts are drawn by their notebook cells, run here on data shaped as the cells
before them pull it (the cells after a `%mesh pull` are plain Python)."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import altair as alt
import nbformat
import pandas as pd
import pytest
from chart_truth import assert_axes_fit, assert_legends_true, legend_fields, legend_problems
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


# -- the tour, as the reviewer saw it -------------------------------------------------------

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"


def cell_chart(notebook: str, marker: str, **names: Any) -> Any:
    """What the notebook's code cell holding ``marker`` shows (its last expression), run on
    ``names`` and the imports the notebooks' first cells make."""
    nb = nbformat.read(NOTEBOOKS / notebook, as_version=4)
    (source,) = [c.source for c in nb.cells if c.cell_type == "code" and marker in c.source]
    tree = ast.parse(source)
    last = tree.body.pop()
    assert isinstance(last, ast.Expr), source
    scope = {"alt": alt, "pd": pd, "OfflineChart": charts.OfflineChart, **names}
    exec(compile(tree, notebook, "exec"), scope)
    return eval(compile(ast.Expression(last.value), notebook, "eval"), scope)


def test_playbook_shows_accumulation_on_hsdps_curve() -> None:
    # notebook 13: grad_accum=2 trains like HSDP (to 1e-4), its line drawn exactly on HSDP's
    losses = _curves({"HSDP": 0.0, "HSDP, grad_accum=2": 1e-7, "local SGD, H=4": 0.05,
                      "DiLoCo, H=4": 0.09}, steps=24, column="method", start=1)
    chart = cell_chart("13-the-rest-of-the-playbook.ipynb", "training loss, 4 CPU ranks",
                       losses=losses)
    assert_true_to_its_data(chart)
    labels = [e.label for e in drawing(chart).entries]
    assert labels[:2] == ["HSDP", "HSDP, grad_accum=2 (same as HSDP to 1e-7)"]


def test_precision_curves_show_all_four_runs() -> None:
    # notebook 17: bf16 lies on fp32's line at this scale
    curves = _curves({"fp32": 0.0, "bf16": 2e-4, "fp16, loss scale from 2^24": 0.04,
                      "QAT int8 act. / int4 weights": 0.08})
    chart = cell_chart("17-long-context-precision-and-optimizers.ipynb",
                       "training loss by precision", curves=curves)
    assert_true_to_its_data(chart)
    assert len(drawing(chart).entries) == 4


def test_optimizer_curves_show_all_five_optimizers() -> None:
    # notebook 17: the three AdamWs on one line
    opt_curves = _curves({"adamw": 0.0, "adamw_bf16": 1e-4, "adamw8bit": 3e-4,
                          "adafactor": 0.06, "sgd": 0.12})
    chart = cell_chart("17-long-context-precision-and-optimizers.ipynb",
                       "training loss by optimizer", opt_curves=opt_curves)
    assert_true_to_its_data(chart)
    labels = [e.label for e in drawing(chart).entries]
    assert sum("same as adamw" in label for label in labels) == 2, labels


def _long_context() -> pd.DataFrame:
    """Notebook 17's table: three methods at two lengths on meshlab's model, three on
    transformers' eager Llama at 1,024 tokens (its Ulysses, one chunk, named as meshlab's)."""
    rows = [{"model": "meshlab", "context_parallel": impl, "seq": seq, "cp": seq // 256,
             "traced (bytes)": traced * seq, "peak (MiB)": peak * seq / 1024}
            for seq in (1024, 512)
            for impl, traced, peak in (("meshlab", 96, 4.21), ("ulysses", 48, 4.03),
                                       ("chunked, 4 chunks", 48, 3.9))]
    rows += [{"model": "llama (eager)", "context_parallel": impl, "seq": 1024, "cp": 4,
              "traced (bytes)": 40_000, "peak (MiB)": peak}
             for impl, peak in (("ulysses", 68.25), ("chunked, 4 chunks", 30.5),
                                ("chunked, 8 chunks", 21.0))]
    return pd.DataFrame(rows)


def test_long_context_bars_are_each_models_own_peak() -> None:
    # notebook 17: the memory bars stacked two models' peaks (72 MiB drawn for 68.25 + 4.03)
    # and the sequence legend listed the models
    chart = cell_chart("17-long-context-precision-and-optimizers.ipynb", "bytes as sequence",
                       long=_long_context())
    assert not legend_fields(chart)
    assert_true_to_its_data(chart)
    drawn = drawing(chart)
    bars = [i for i in drawn.items if i.marktype == "rect"]
    for panel in {b.panel for b in bars}:
        mine = [b.box for b in bars if b.panel == panel]
        stacked = [(a, b) for i, a in enumerate(mine) for b in mine[i + 1:]
                   if min(a[2], b[2]) - max(a[0], b[0]) > 0.5]
        assert not stacked, stacked  # side by side, never one on another


def _race() -> pd.DataFrame:
    """Notebook 16's race: 6 modes x 4 ranks, 24 steps each, MSE falling from ~0.17; EDiT
    takes DiLoCo's steps (its outer step lands a forward later), at its own times."""
    modes = ["synchronous DP", "local SGD (H=4)", "DiLoCo (H=4)", "EDiT (H=4)",
             "A-EDiT (0.2 s)", "parameter server (staleness 2)"]
    rate = {mode: 0.06 + 0.01 * (2 if mode.startswith("EDiT") else m)
            for m, mode in enumerate(modes)}
    return pd.DataFrame([
        {"mode": mode, "rank": "rank 3 (throttled x3)" if r == 3 else f"rank {r}", "step": s,
         "seconds": s * (0.15 if r == 3 else 0.05) * (1 + m / 10),
         "loss": 0.17 * math.exp(-s * rate[mode]) * (1 + 0.1 * r)}
        for m, mode in enumerate(modes) for r in range(4) for s in range(1, 25)])


def test_race_axes_span_the_losses() -> None:
    # notebook 16: 24 lines on a log axis rounded out to 0.01-1, its upper part empty
    curves = _race()
    chart = cell_chart("16-asynchronous-training-and-collectives.ipynb",
                       "training loss (MSE", curves=curves, modes=list(dict.fromkeys(
                           curves["mode"])))
    assert_true_to_its_data(chart)
    labels = [e.label for e in drawing(chart).entries]
    assert "EDiT (H=4) (same as DiLoCo (H=4), against step)" in labels, labels


def _sweep() -> Any:
    from meshlab.calibrate.algorithms import SWEEP, AllreduceSweep

    sizes = list(SWEEP)

    def times(latency: float, per_byte: float) -> list[float]:
        return [latency + b * per_byte for b in sizes]

    measured = {"ring": times(4e-4, 2e-9), "halving_doubling": times(2e-4, 2.5e-9),
                "tree": times(2e-4, 4e-9), "gloo": times(1e-4, 1e-9)}
    model = {"ring": times(3e-4, 1.5e-9), "halving_doubling": times(1.5e-4, 1.5e-9),
             "tree": times(1.5e-4, 3e-9)}
    return AllreduceSweep(ranks=4, hosts=[0, 0, 0, 0], backend="gloo", nbytes=sizes,
                          seconds=measured, model_seconds=model)


def test_allreduce_legend_tells_measured_from_modelled() -> None:
    # notebook 16: the dash legend drew both as dots; 4 KiB-16 MiB on an axis of 1 KB-100 MB
    chart = cell_chart("16-asynchronous-training-and-collectives.ipynb", "all-reduce on 4 CPU",
                       sweep=_sweep())
    assert_true_to_its_data(chart)
    dashed = {e.label: e.style.get("strokeDash") for e in drawing(chart).entries
              if e.style.get("shape") == "stroke" and "strokeDash" in e.style}
    assert len({str(d) for d in dashed.values()}) == 2, dashed


# -- every chart function ------------------------------------------------------------------

def _comms() -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "op": op, "axis": axis, "group": "[0-1]", "count": 1,
                          "bytes": nbytes, "wire_bytes": nbytes}
                         for r in range(4) for op, axis, nbytes in (
                             ("all_reduce", "tp", 2**19), ("all_gather", "dp", 2**18),
                             ("all_reduce", "world", 16))])


def _spans() -> pd.DataFrame:
    return pd.DataFrame([
        {"rank": r, "kind": kind, "axis": axis, "start": start + r / 10, "end": start + 1.0,
         "bytes": nbytes, "name": name, "waited on": on}
        for r in range(4) for kind, axis, start, nbytes, name, on in (
            ("compute", None, 0.0, None, "aten::mm", None),
            ("comm", "tp", 1.0, 4096, "all_reduce", None),
            ("wait", "dp", 2.0, None, "all_reduce", "rank 3"),
            ("comm", "dp", 3.0, 4096, "all_reduce", None),
            ("idle", None, 4.0, None, "", None))])


def _memory_timelines() -> dict[int, Any]:
    from meshlab.measure.memory_timeline import MemoryPoint, MemoryTimeline

    def point(i: int) -> MemoryPoint:
        return MemoryPoint(ns=i * 10**6, bytes={"parameters": 4096, "gradients": 4096 * (i > 4),
                                                 "activations": 512 * i * (i <= 4)},
                           module="layers.0", phase="forward" if i <= 4 else "backward")

    return {r: MemoryTimeline(rank=r, device="cpu", points=[point(i) for i in range(9)],
                              snapshot={}) for r in range(2)}


def _layout_diff() -> pd.DataFrame:
    rows = [{"phase": phase, "module": module, "step": step, "shape": "4x4",
             "error": 1e-9 * 10 ** (step + j), "tolerance": 1e-6, "ranks beyond": ""}
            for phase in ("loss", "parameter gradient") for j, module in enumerate(("a", "b"))
            for step in range(3)]
    frame = pd.DataFrame(rows)
    return frame.assign(born=range(len(frame)), first=[i == 4 for i in range(len(frame))])


def _dryrun() -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, "source": s, "category": c, "gib": g * (1.1 if s ==
                                                                              "planner" else 1)}
                         for r in (0, 512) for s in ("dry run", "planner")
                         for c, g in (("params", 1.0), ("grads", 1.0), ("activations", 3.0))])


def _plan_memory() -> pd.DataFrame:
    """%mesh plan's memory frame: three layouts' parts per GPU, 76 GiB usable."""
    return pd.DataFrame([{"layout": layout, "part": part, "gib": gib * scale,
                          "usable_gib": 76.0}
                         for layout, scale in (("tp=8 zero=1", 1.0), ("tp=4 pp=2", 0.8),
                                               ("dp_shard=8 zero=3", 0.5))
                         for part, gib in (("weights", 2.0), ("gradients", 2.0),
                                           ("optimizer states", 12.0), ("activations", 30.0))])


def _chart(name: str) -> Any:
    from meshlab.plan.report import plan

    schedules = [build("gpipe", ranks=4, microbatches=8), build("zb_h1", ranks=4,
                                                                microbatches=8),
                 build("interleaved_1f1b", ranks=4, microbatches=8, virtual=2)]
    return {
        "comms": lambda: charts.comms_chart(_comms()),
        "memory": lambda: charts.memory_chart(_memory(offloaded=False)),
        "memory offloaded": lambda: charts.memory_chart(_memory(offloaded=True)),
        "schedules": lambda: charts.timeline_chart(plan_frame(compare(schedules, Costs())[0])),
        "plan memory": lambda: charts.plan_memory_chart(_plan_memory()),
        "plan comms": lambda: charts.plan_comm_chart(plan("llama3-8b", gpus=16,
                                                          top=1).comm_frame()),
        "profile": lambda: charts.profile_chart(_spans()),
        "dry run": lambda: charts.dryrun_memory_chart(_dryrun(), usable_gib=76.0),
        "layout diff": lambda: charts.layout_diff_chart(_layout_diff()),
        "losses": lambda: charts.losses_chart(_losses({"a": 0.0, "b": 0.01}), "a"),
        "memory timeline": lambda: charts.memory_timeline_chart(_memory_timelines()),
        "bench": lambda: bench_chart(_bench()),
        "bench, one size": lambda: bench_chart(_bench().query("size == 256")),
        "lines": lambda: charts.lines_chart(
            _curves({"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.1}), x=charts.Axis("step", "step"),
            y=charts.Axis("loss", "loss", log=True), series="run", title="three on one line"),
    }[name]()


@pytest.mark.parametrize("name", ["comms", "memory", "memory offloaded", "schedules",
                                  "plan memory", "plan comms", "profile", "dry run",
                                  "layout diff", "losses", "memory timeline", "bench",
                                  "bench, one size", "lines"])
def test_every_chart_function_is_true_to_its_data(name: str) -> None:
    assert_true_to_its_data(_chart(name))
