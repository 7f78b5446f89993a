"""The planner's results as the notebook shows them: the summary and the layouts table."""

from __future__ import annotations

from meshlab.notebook.tables.table import Lines, Table, sig
from meshlab.plan.report import Plan


def plan_summary(plan: Plan) -> Lines:
    """The few lines on the best layout, wrapping between words."""
    return Lines(plan.text())


def plan_table(plan: Plan) -> Table:
    """One row per layout, numbers to three significant figures with thousands separated."""
    three = sig(3)
    formats = {c: three for c in ("memory_gib", "step_s", "exposed_comm_s", "tokens_per_s",
                                  "tflops_per_gpu", "mfu", "hw_tflops_per_gpu", "hfu",
                                  "gpu_hours")}
    return Table(plan.table(), formats={**formats, "bubble": "{:.1%}", "days": "{:,.1f}"},
                 caption=f"{plan.model.name} on {plan.gpus} x {plan.hardware.name}: "
                         "layouts, best first")
