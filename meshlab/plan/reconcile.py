"""The planner's prediction beside a dry run's measurement, category by category.

``planner_beside(dry)`` runs ``estimate`` on the layout, model shape and hardware a
``meshlab.dry_run.run.DryRun`` stood for, and returns rows: memory per category and bytes per
mesh axis, the dry run's figure, the planner's, and the planner's with each known
difference applied (``explained``), each named with its bytes. A difference is a fact of
how torch (or meshlab) does a thing that the planner counts as Megatron or a fused kernel
would; where the named differences do not yet account for a category (MoE layers'
activations, ...), the row says so and is not compared. Pure Python (the DryRun is plain
data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshlab.plan.activation_differences import (
    HAND_WRITTEN,
    TRANSFORMERS_MOE_UNSPLIT,
    not_reconciled,
)
from meshlab.plan.differences import NOT_COMPARED, Differences, axis_name, signed
from meshlab.plan.estimate import Estimate, estimate
from meshlab.plan.hardware import HARDWARE, Hardware
from meshlab.plan.hardware import hardware as find_hardware
from meshlab.plan.layout import Layout
from meshlab.plan.shapes import ModelShape

if TYPE_CHECKING:
    from meshlab.dry_run.report import DryRun, RankRun

MEMORY = ("params", "grads", "optimizer", "activations", "buffers", "total", "host")
RECEIVED = ("recv",)
"""Ops whose bytes are another rank's send (a pipeline hop counts once, at its sender)."""
TOTAL = ("the step's peak, where each category is what it is then; explained: the "
         "categories' explained figures summed, which peak at different moments (an upper "
         "bound; each category is compared above)")


@dataclass(kw_only=True, slots=True)
class Row:
    """One figure, measured and predicted."""

    rank: int
    what: str
    """memory (bytes per GPU) or bytes (sent per step on a mesh axis)."""
    name: str
    """The memory category, or the mesh axis (tp, dp_shard+cp, ...)."""
    dry_run: int
    planner: float
    explained: float
    """The planner's figure with the known differences applied: what the two should agree
    on once each counts what the other does."""
    difference: str = ""
    """What the two count differently, each with its bytes; empty when they count alike."""
    comparable: bool = True
    """False where the dry run cannot run what the planner counts (see ``difference``)."""

    @property
    def ratio(self) -> float | None:
        """planner / dry run (None where the dry run measured nothing)."""
        return self.planner / self.dry_run if self.dry_run else None

    @property
    def error(self) -> float | None:
        """explained / dry run - 1 (None where the dry run measured nothing)."""
        return self.explained / self.dry_run - 1 if self.dry_run else None

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "what": self.what, "name": self.name,
                "dry_run": self.dry_run, "planner": self.planner, "ratio": self.ratio,
                "explained": self.explained, "error": self.error,
                "difference": self.difference, "comparable": self.comparable}


def planner_estimate(dry: DryRun, hardware: Hardware | None = None) -> Estimate:
    """The planner's estimate of what ``dry`` ran (its planned layout, shape, hardware)."""
    if dry.shape is None:
        raise ValueError(f"the dry run of {dry.model} has no planner shape (a model whose "
                         "config the planner cannot read): nothing to set beside it")
    hw = hardware or (find_hardware(dry.hardware) if dry.hardware in HARDWARE
                      else HARDWARE["h100-sxm"])
    return estimate(ModelShape(**dry.shape), Layout.parse(dry.planned), hw)


def planner_beside(dry: DryRun, hardware: Hardware | None = None) -> list[Row]:
    """Rows of memory per category and bytes per mesh axis, for each representative rank:
    the dry run's (the step's peak for the total, each category's own peak over the forward
    and backward), the planner's (for its busiest stage: the same for every rank), the
    planner's with the known differences applied, and what they are."""
    est = planner_estimate(dry, hardware)
    planned = planner_bytes(est)
    rows = []
    for run in dry.ranks:
        known = Differences(dry, est, run)
        memory = {name: run.peaks.get(name, 0) for name in MEMORY}
        memory["total"] = run.memory["total"]
        explained = 0.0
        for name in MEMORY:
            if name == "host" and not memory[name] and not est.memory[name]:
                continue
            row = _row(known, "memory", name, memory[name], est.memory[name], explained)
            if name not in ("total", "host"):
                explained += row.explained - row.planner
            rows.append(row)
        sent = dry_bytes(run)
        for axis in sorted(set(sent) | set(planned)):
            rows.append(_row(known, "bytes", axis, sent.get(axis, 0), planned.get(axis, 0.0)))
    return rows


def dry_bytes(run: RankRun) -> dict[str, int]:
    """Bytes per axis the rank's collectives moved in the step (a hop counted at its
    sender)."""
    out: dict[str, int] = {}
    for t in run.collectives:
        if t.op not in RECEIVED:
            out[t.axis] = out.get(t.axis, 0) + t.bytes
    return out


def planner_bytes(est: Estimate) -> dict[str, float]:
    """The planner's bytes per step per axis, the axes named as the dry run names them."""
    out: dict[str, float] = {}
    for c in est.collectives:
        if c.collective == "copy":  # host copies: no collective
            continue
        axis = axis_name(c.axis, est.layout)
        out[axis] = out.get(axis, 0.0) + c.nbytes * c.calls
    return out


def _row(known: Differences, what: str, name: str, dry_run: int, planner: float,
         categories: float = 0.0) -> Row:
    """One figure beside the planner's, with the known differences applied (for the
    total, ``categories``: the categories' differences, summed)."""
    if what == "memory" and name == "total":
        return Row(rank=known.run.rank, what=what, name=name, dry_run=dry_run,
                   planner=planner, explained=planner + categories, comparable=False,
                   difference=TOTAL if known.dry.kernels == "fused" else
                   "the step's peak, activations included (see activations)")
    terms = (known.bytes_terms(name, planner) if what == "bytes"
             else known.memory_terms(name, planner))
    why = ""
    if what == "memory" and name == "activations":
        why = NOT_COMPARED if known.dry.kernels != "fused" else not_reconciled(known)
    elif what == "memory" and name == "buffers" and known.dry.family == "other":
        why = HAND_WRITTEN
    elif (what == "memory" and name == "buffers" and known.fsdp and known.model.experts
          and known.dry.family == "transformers"):
        why = TRANSFORMERS_MOE_UNSPLIT
    if why:
        terms = [(why, 0.0)]
    return Row(rank=known.run.rank, what=what, name=name, dry_run=dry_run, planner=planner,
               explained=planner + sum(b for _, b in terms),
               difference="; ".join(f"{t} ({signed(b)})" if b else t
                                    for t, b in terms),
               comparable=not why)
