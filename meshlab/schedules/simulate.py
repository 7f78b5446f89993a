"""Run a schedule against a cost model: when each action starts and ends on each rank.

Each rank runs its actions in list order as soon as the rank is free and the inputs have
arrived (a hop between ranks costs ``comm``). Costs are for one rank's share of the model
(a p-stage split); a schedule with v stages per rank spends 1/v of that per action.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple

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


class Timed(NamedTuple):
    """One action's place in a simulated step."""

    slot: int
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """Start and end of every action; the schedule's makespan and bubbles."""

    schedule: Schedule
    costs: Costs
    timed: list[Timed] = field(default_factory=list)
    """Every action, by slot then rank."""

    @cached_property
    def events(self) -> list[dict[str, Any]]:
        """One dict per action: rank, slot, stage, kind, microbatch, action, start, end."""
        return [{"rank": t.rank, "slot": t.slot, "stage": t.action.stage,
                 "kind": t.action.kind, "microbatch": t.action.microbatch,
                 "action": str(t.action), "start": t.start, "end": t.end} for t in self.timed]

    @property
    def makespan(self) -> float:
        return max((t.end for t in self.timed), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(t.end - t.start for t in self.timed if t.rank == rank)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over total rank time (ranks x makespan)."""
        total = self.makespan * self.schedule.ranks
        return 1 - sum(self.busy(r) for r in range(self.schedule.ranks)) / total if total else 0

    def peak_inflight(self, rank: int) -> int:
        """Most micro-batches holding activations at once on ``rank``: from the start of a
        forward until its backward (B, or W when split) ends; one per stage held."""
        changes = []
        for t in self.timed:
            if t.rank == rank:
                if t.action.kind == "F":
                    changes.append((t.start, 1))
                elif t.action.kind in ("B", "W"):
                    changes.append((t.end, -1))
        level = peak = 0
        for _, delta in sorted(changes, key=lambda c: (c[0], c[1])):  # frees first on ties
            level += delta
            peak = max(peak, level)
        return peak

    def peak_accumulating(self, rank: int) -> int:
        """Most stages accumulating weight gradients at once on ``rank``: from the start of a
        stage's first backward (B, or W when split) to the end of its last, after which its
        gradients are reduced and freed."""
        spans: dict[int, tuple[float, float]] = {}
        for t in self.timed:
            if t.rank == rank and t.action.kind in ("B", "W"):
                start, end = spans.get(t.action.stage, (t.start, t.end))
                spans[t.action.stage] = (min(start, t.start), max(end, t.end))
        changes = [(a, 1) for a, _ in spans.values()] + [(b, -1) for _, b in spans.values()]
        level = peak = 0
        for _, delta in sorted(changes):  # frees first on ties
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


def simulate(schedule: Schedule, costs: Costs, *, validated: bool = False,
             durations: Mapping[Action, float] | None = None,
             hops: Mapping[Action, float] | None = None) -> Timeline:
    """Validate (unless the caller has: meshlab's builders' schedules are), then time every
    action: it starts when its rank is free and its inputs (plus one hop of ``comm`` from
    another rank) have arrived. ``durations``: some actions' own times, and ``hops``: the
    hop into some actions from another rank, in place of the costs (a measured step
    replayed).

    One event-driven pass: a rank runs down its list until an action's input is not done
    yet, and waits on that input; finishing it wakes the rank. An action's unit-time slot
    (``validate.slots``) and its time come out of the same step."""
    if not validated:
        schedule.validate()
    if costs.stage_scale is not None and len(costs.stage_scale) != schedule.stages:
        raise ScheduleError(f"stage_scale has {len(costs.stage_scale)} values, the schedule "
                            f"has {schedule.stages} stages: give one per stage")
    split = backward_kinds(schedule)
    share = schedule.ranks / schedule.stages
    took = {kind: costs.of(kind) * share for kind in "FBIW"}
    scale = costs.stage_scale or (1.0,) * schedule.stages
    rank_of = schedule.stage_to_rank
    rows = [[(i, a) for i, a in enumerate(schedule.actions[r]) if a is not None]
            for r in range(schedule.ranks)]
    position, clock, free = [0] * len(rows), [0] * len(rows), [0.0] * len(rows)
    done: dict[tuple[int, str, int], tuple[int, float]] = {}  # key -> (next slot, end)
    waiting: dict[tuple[int, str, int], list[int]] = {}  # key -> ranks blocked on it
    runnable = list(range(len(rows)))
    timed = []
    while runnable:
        rank = runnable.pop()
        row = rows[rank]
        while position[rank] < len(row):
            index, a = row[position[rank]]
            deps = dependencies(a, schedule, split)
            missing = [dep for dep in deps if dep not in done]
            if missing:
                waiting.setdefault(missing[0], []).append(rank)
                break
            slot, ready = max(index, clock[rank]), free[rank]
            for dep in deps:
                dep_slot, dep_end = done[dep]
                if dep_slot > slot:
                    slot = dep_slot
                if rank_of[dep[0]] != rank:
                    dep_end += hops.get(a, costs.comm) if hops is not None else costs.comm
                if dep_end > ready:
                    ready = dep_end
            if durations is not None and a in durations:
                finish = ready + durations[a]
            else:
                finish = ready + took[a.kind] * scale[a.stage]
            done[a] = (slot + 1, finish)  # an Action is its own (stage, kind, microbatch) key
            clock[rank], free[rank] = slot + 1, finish
            timed.append(Timed(slot, rank, a, ready, finish))
            position[rank] += 1
            runnable += waiting.pop(a, ())
    if any(position[r] < len(row) for r, row in enumerate(rows)):
        slots(schedule)  # a deadlock the caller vouched against: raises, naming it
    timed.sort(key=itemgetter(0, 1))  # by slot, then rank
    return Timeline(schedule, costs, timed)
