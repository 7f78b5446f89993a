"""The planner's results as the notebook shows them: the summary and the layouts table."""

from __future__ import annotations

from meshlab.notebook.tables.table import Lines, Table, in_byte_unit, in_second_unit, percent, sig
from meshlab.plan.hardware import GIB
from meshlab.plan.report import Plan

# Plan.table()'s columns as the table names them; the units come with the values
HEADERS = {"memory_gib": "memory", "host_gib": "host", "step_s": "step",
           "exposed_comm_s": "exposed comm", "tokens_per_s": "tokens/s",
           "tflops_per_gpu": "TFLOP/s per GPU", "mfu": "MFU",
           "hw_tflops_per_gpu": "hw TFLOP/s per GPU", "hfu": "HFU", "gpu_hours": "GPU-hours"}


def plan_summary(plan: Plan) -> Lines:
    """The few lines on the best layout, wrapping between words."""
    return Lines(plan.text())


def plan_table(plan: Plan) -> Table:
    """One row per layout: memory in the unit of the memory chart, times in s or ms, MFU,
    HFU and the bubble as percentages, other numbers to three significant figures."""
    frame = plan.table()
    frame = frame.assign(**{c: frame[c] * GIB for c in ("memory_gib", "host_gib")
                            if c in frame}).rename(columns=HEADERS)
    memory = in_byte_unit(frame, ["memory", "host"])
    times = in_second_unit(memory.frame, ["step", "exposed comm"])
    three, share = sig(3), percent(3)
    formats = {**memory.formats, **times.formats,
               **{c: three for c in ("tokens/s", "TFLOP/s per GPU", "hw TFLOP/s per GPU",
                                     "GPU-hours")},
               **{c: share for c in ("MFU", "HFU", "bubble")}, "days": "{:,.1f}"}
    return Table(times.frame, formats=formats,
                 caption=f"{plan.model.name} on {plan.gpus} x {plan.hardware.name}: "
                         "layouts, best first")
