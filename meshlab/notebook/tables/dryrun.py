"""A dry run as the notebook shows it: a few lines per representative rank, memory by
category and bytes per mesh axis beside the planner's, and the planner's search checked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pandas as pd

from meshlab.notebook.tables.table import Lines, Table, in_byte_unit, sig
from meshlab.plan.reconcile import Row, planner_beside
from meshlab.plan.report import Plan, count_text

if TYPE_CHECKING:
    from meshlab.dry_run.run import DryRun
    from meshlab.plan.hardware import Hardware

GIB = 2**30
AT_PEAK = "dry run, at the step's peak"


def dryrun_views(dry: DryRun, hardware: str | Hardware | None = None) -> list[Any]:
    """What ``%mesh dryrun`` shows: the summary, then (for a model the planner can describe)
    memory and bytes beside the planner's, and the memory chart."""
    from meshlab.notebook.charts import dryrun_memory_chart
    from meshlab.plan.hardware import hardware as find_hardware

    hw = find_hardware(hardware) if hardware is not None else None
    rows = planner_beside(dry, hw) if dry.shape is not None else []
    if not rows:
        return [dryrun_summary(dry)]
    usable = hw.usable_bytes / GIB if hw is not None else None
    return [dryrun_summary(dry, rows), dryrun_memory_table(dry, rows),
            dryrun_bytes_table(dry, rows),
            dryrun_memory_chart(dryrun_memory_frame(dry, rows), usable_gib=usable)]


def dryrun_summary(dry: DryRun, rows: list[Row] | None = None) -> Lines:
    """What ran, and per rank: parameters held, peak memory beside the planner's, the fit."""
    planned = _totals(rows or [])
    lines = [f"{dry.model} on {dry.world_size:,} fake ranks ({dry.planned}), {dry.batch} "
             f"sequences of {dry.seq:,} tokens per data-parallel rank: "
             f"{len(dry.ranks)} representative rank{'s' if len(dry.ranks) > 1 else ''} ran a "
             f"training step in {dry.seconds:.1f} s; activations as "
             + ("fused GPU kernels hold them (--kernels eager: the code op by op)"
                if dry.kernels == "fused" else "the code holds them op by op")]
    from meshlab.notebook.charts import byte_unit

    for run in dry.ranks:
        peak = run.memory["total"]
        unit, size = byte_unit(peak)
        line = (f"rank {run.rank} ({run.role}): holds {count_text(run.params)} parameters, peak "
                f"{peak / size:.3g} {unit}")
        if run.rank in planned and peak:
            line += (f" (planner {planned[run.rank] / size:.3g} {unit}, "
                     f"x{planned[run.rank] / peak:.2f})")
        if run.fits is not None:
            line += f"; fits {dry.hardware}: {'yes' if run.fits else 'NO'}"
        lines.append(line)
    lines += [f"note: {note}" for note in dry.notes]
    return Lines("\n".join(lines))


def dryrun_memory_table(dry: DryRun, rows: list[Row]) -> Table:
    """Memory per category and rank: the dry run's own peak of each, what each held at the
    step's peak (these sum to it: the chart's bar), the planner's, the planner's with the
    differences it knows of applied, and what is left between them."""
    table = _beside(rows, "memory", "category",
                    "memory per GPU: each category's own peak in the step (the dry run, torch's "
                    "tracker) beside the planner's, and what each held at the step's peak",
                    at_peak=_at_peak(dry), measured="dry run, own peak")
    table.note += ("; the categories peak at different moments: their own peaks add up to "
                   "more than the step's peak, what each held at it adds up to it")
    return table


def dryrun_bytes_table(dry: DryRun, rows: list[Row]) -> Table:
    """Bytes each rank sent per mesh axis in the step, beside the planner's, with the
    collectives the dry run saw there."""
    ops: dict[tuple[int, str], list[str]] = {}
    for run in dry.ranks:
        for t in run.collectives:
            ops.setdefault((run.rank, t.axis), []).append(f"{t.op} x{t.calls}")
    table = _beside(rows, "bytes", "axis",
                    "bytes per step on each mesh axis: the dry run (every collective traced) "
                    "beside the planner")
    table.frame.insert(2, "collectives", [", ".join(ops.get((r, a), []))
                                          for r, a in zip(table.frame["rank"],
                                                          table.frame["axis"], strict=True)])
    return table


def _beside(rows: list[Row], what: str, name: str, caption: str,
            at_peak: dict[tuple[int, str], float] | None = None,
            measured: str = "dry run") -> Table:
    """The dry run (and, given ``at_peak``, what each row held at the step's peak), the
    planner and the planner with the differences applied, in the unit of their chart."""
    peak = {AT_PEAK: at_peak} if at_peak is not None else {}
    frame = pd.DataFrame([
        {"rank": r.rank, name: r.name, measured: r.dry_run,
         **{column: held[(r.rank, r.name)] for column, held in peak.items()},
         "planner": r.planner,
         "planner, differences applied": r.explained,
         "left over": r.error if r.comparable else None,
         "what differs": r.difference} for r in rows if r.what == what])
    shown = in_byte_unit(frame, [measured, *peak, "planner", "planner, differences applied"])
    return Table(shown.frame, caption=caption, formats={**shown.formats, "left over": _percent},
                 note="left over: the planner with the differences applied, against the dry "
                      "run (blank where a row is not compared: it says why)")


def _percent(value: Any) -> str:
    return "" if value is None or value != value else f"{value:+.1%}"


def dryrun_memory_frame(dry: DryRun, rows: list[Row]) -> pd.DataFrame:
    """Long format for the chart: rank, source (dry run or planner), category, gib. The dry
    run's bar is what each category held at the step's peak, so it ends at the peak the
    summary states; the planner's, its categories, which add up to its total."""
    at_peak = _at_peak(dry)
    return pd.DataFrame([
        {"rank": r.rank, "source": source, "category": r.name, "gib": value / GIB}
        for r in rows if r.what == "memory" and r.name != "total"
        for source, value in (("dry run", at_peak[(r.rank, r.name)]),
                              ("planner", r.planner))])


def _at_peak(dry: DryRun) -> dict[tuple[int, str], float]:
    """(rank, category) -> bytes it held at the rank's step peak (``total`` included)."""
    return {(run.rank, category): float(value) for run in dry.ranks
            for category, value in run.memory.items()}


def verified_table(plan: Plan, hardware: Hardware | None = None) -> Table:
    """The search's best layouts, each dry-run: the planner's memory per GPU beside the peak
    torch allocated on the busiest representative rank, and whether each says it fits."""
    rows = []
    for estimate, dry in zip(plan.estimates, plan.verified, strict=False):
        busiest = max(dry.ranks, key=lambda run: run.memory["total"])
        peak = busiest.memory["total"]
        beside = planner_beside(dry, hardware or plan.hardware)
        apart = [(r.name, error) for r in beside if r.rank == busiest.rank and r.comparable
                 and (error := r.error) is not None and abs(error) > 0.1]
        rows.append({"layout": estimate.layout.describe(),
                     "planner": estimate.memory["total"], "dry run peak": peak,
                     "planner / dry run": estimate.memory["total"] / peak if peak else None,
                     "fits (planner)": estimate.fits, "fits (dry run)": busiest.fits,
                     "left over, above 10%": ", ".join(
                         f"{name} {error:+.0%}" for name, error in
                         sorted(apart, key=lambda a: -abs(a[1]))[:2]),
                     "dry run (s)": dry.seconds})
    three = sig(3)
    shown = in_byte_unit(pd.DataFrame(rows), ["planner", "dry run peak"])
    return Table(shown.frame, caption=f"the best {len(rows)} layouts, dry-run on "
                 f"{plan.gpus:,} fake ranks (the busiest representative rank of each)",
                 formats={**shown.formats, "planner / dry run": three, "dry run (s)": three})


def _totals(rows: list[Row]) -> dict[int, float]:
    return {r.rank: r.planner for r in rows if r.what == "memory" and r.name == "total"}
