"""Run a schedule against a cost model: when each action starts and ends on each rank.

Each rank runs its actions in list order as soon as the rank is free and the inputs have
arrived (a hop between ranks costs ``comm``). Costs are for one rank's share of the model
(a p-stage split); a schedule with v stages per rank spends 1/v of that per action.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshlab.schedules.actions import Action, Schedule, ScheduleError
from meshlab.schedules.validate import backward_kinds, dependencies, slots

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Time of each kind of action, in any unit (ms, or 1 for unit blocks)."""

    forward: float = 1.0
    """t_F."""
    backward: float | None = None
    """t_B of a full backward; default backward_input + backward_weight, else 2 * t_F."""
    backward_input: float | None = None
    """t_I; default half of t_B."""
    backward_weight: float | None = None
    """t_W; default t_B - t_I."""
    comm: float = 0.0
    """One hop between ranks (activation or gradient)."""
    stage_scale: tuple[float, ...] | None = None
    """Per-stage multipliers when stages are uneven (one per stage)."""

    def __post_init__(self) -> None:
        values = [self.forward, self.backward, self.backward_input, self.backward_weight,
                  self.comm, *(self.stage_scale or ())]
        if any(v is not None and v < 0 for v in values):
            raise ValueError(f"costs must not be negative: {self}")

    @classmethod
    def parse(cls, text: str, *, comm: float = 0.0) -> Costs:
        """``"F,B"`` (full backward) or ``"F,I,W"`` (split backward), e.g. "1,2" or "1,1,1"."""
        try:
            values = [float(v) for v in text.split(",")]
        except ValueError:
            values = []
        if len(values) == 2:
            return cls(forward=values[0], backward=values[1], comm=comm)
        if len(values) == 3:
            return cls(forward=values[0], backward_input=values[1],
                       backward_weight=values[2], comm=comm)
        raise ValueError(f"costs {text!r}: give F,B (e.g. 1,2) or F,I,W (e.g. 1,1,1)")

    def of(self, kind: str) -> float:
        """The time of one action of ``kind`` on a full p-stage chunk."""
        i, w, b = self.backward_input, self.backward_weight, self.backward
        if b is None:
            b = i + w if i is not None and w is not None else 2 * self.forward
        if i is None:
            i = b - w if w is not None else b / 2
        if w is None:
            w = b - i
        return {"F": self.forward, "B": b, "I": i, "W": w}[kind]


@dataclass
class Timeline:
    """Start and end of every action; the schedule's makespan and bubbles."""

    schedule: Schedule
    costs: Costs
    events: list[dict[str, Any]] = field(default_factory=list)
    """One dict per action: rank, slot, stage, kind, microbatch, action, start, end."""

    @property
    def makespan(self) -> float:
        return max((e["end"] for e in self.events), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(e["end"] - e["start"] for e in self.events if e["rank"] == rank)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over total rank time (ranks x makespan)."""
        total = self.makespan * self.schedule.ranks
        return 1 - sum(self.busy(r) for r in range(self.schedule.ranks)) / total if total else 0

    def peak_inflight(self, rank: int) -> int:
        """Most micro-batches holding activations at once on ``rank``: from the start of a
        forward until its backward (B, or W when split) ends; one per stage held."""
        changes = []
        for e in self.events:
            if e["rank"] == rank:
                if e["kind"] == "F":
                    changes.append((e["start"], 1))
                elif e["kind"] in ("B", "W"):
                    changes.append((e["end"], -1))
        level = peak = 0
        for _, delta in sorted(changes, key=lambda c: (c[0], c[1])):  # frees first on ties
            level += delta
            peak = max(peak, level)
        return peak

    @property
    def per_rank(self) -> pd.DataFrame:
        """rank, busy, idle, bubble_fraction, peak_inflight."""
        import pandas as pd

        span = self.makespan
        rows = []
        for r in range(self.schedule.ranks):
            busy = self.busy(r)
            rows.append({"rank": r, "busy": busy, "idle": span - busy,
                         "bubble_fraction": (span - busy) / span if span else 0.0,
                         "peak_inflight": self.peak_inflight(r)})
        return pd.DataFrame(rows)

    def to_frame(self) -> pd.DataFrame:
        """One row per action: rank, slot, stage, kind, microbatch, action, start, end."""
        import pandas as pd

        columns = ["rank", "slot", "stage", "kind", "microbatch", "action", "start", "end"]
        return pd.DataFrame(self.events, columns=columns).sort_values(["rank", "start"],
                                                                      ignore_index=True)

    def summary(self) -> dict[str, Any]:
        """One row for a comparison table."""
        s = self.schedule
        return {"schedule": s.name, "ranks": s.ranks, "stages": s.stages,
                "microbatches": s.microbatches, "makespan": self.makespan,
                "bubble_fraction": round(self.bubble_fraction, 4),
                "peak_inflight": max(self.peak_inflight(r) for r in range(s.ranks))}


def simulate(schedule: Schedule, costs: Costs, *, validated: bool = False) -> Timeline:
    """Validate (unless the caller has: meshlab's builders' schedules are), then time every
    action: it starts when its rank is free and its inputs (plus one hop of ``comm`` from
    another rank) have arrived."""
    if not validated:
        schedule.validate()
    if costs.stage_scale is not None and len(costs.stage_scale) != schedule.stages:
        raise ScheduleError(f"stage_scale has {len(costs.stage_scale)} values, the schedule "
                            f"has {schedule.stages} stages: give one per stage")
    order = slots(schedule)  # a dependency-respecting order across ranks
    split = backward_kinds(schedule)
    share = schedule.ranks / schedule.stages
    end: dict[tuple[int, str, int], float] = {}
    free = dict.fromkeys(range(schedule.ranks), 0.0)
    timeline = Timeline(schedule, costs)
    keyed = [(order[(a.stage, a.kind, a.microbatch)], r, a)
             for r in range(schedule.ranks) for a in schedule.compute_actions(r)]
    for slot, rank, a in sorted(keyed):
        ready = free[rank]
        for dep in dependencies(a, schedule, split):
            hop = costs.comm if schedule.stage_to_rank[dep[0]] != rank else 0.0
            ready = max(ready, end[dep] + hop)
        scale = costs.stage_scale[a.stage] if costs.stage_scale else 1.0
        finish = ready + costs.of(a.kind) * share * scale
        end[(a.stage, a.kind, a.microbatch)] = free[rank] = finish
        timeline.events.append({"rank": rank, "slot": slot, "stage": a.stage, "kind": a.kind,
                                "microbatch": a.microbatch, "action": str(Action(*a)),
                                "start": ready, "end": finish})
    return timeline
