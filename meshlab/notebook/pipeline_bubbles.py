"""A measured pipeline step's bubble and exposed communication beside the schedule
simulator's, both cut the same way.

A rank's compute action is (ready, start, produced, end): ready when the rank reached it and
began waiting for its input, start when the input was in, produced when its output existed
(the compute ended), end when the rank reached its next compute action: the Python between
actions (posting sends and receives) is the rank's work, and the simulator's action times
include it. Waiting for an input before its producer on another rank had produced it is
bubble; waiting after, until it arrived, is exposed communication (the send's posting and
the transfer). Before a rank's first action and after its last is bubble too.

The same costs, one per kind (``action_costs``), are what the stepped pipeline's chart
re-simulates the step with and what the bubble table's caption states: one source.
Notebook side: SteppedPipeline.bubble_table calls compare_bubbles on a whole profiled step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from statistics import median
from typing import Any, NamedTuple

import pandas as pd

from meshlab.schedules import Costs, Schedule, Timeline
from meshlab.schedules.actions import Action
from meshlab.schedules.simulate import simulate
from meshlab.schedules.validate import Key, backward_kinds, dependencies


class Ran(NamedTuple):
    """One compute action as it ran on a rank, on a clock the ranks share (ms)."""

    action: Action
    ready: float
    start: float
    produced: float
    end: float


@dataclass(slots=True)
class RankRun:
    """One pp rank's compute actions in the order it ran them."""

    begin: float  # when the rank began the step (0 in the simulator)
    actions: list[Ran]


def split_idle(runs: dict[int, RankRun], schedule: Schedule, origin: float,
               finish: float) -> pd.DataFrame:
    """Per rank (ms): busy, bubble and exposed communication between ``origin`` and
    ``finish`` (the three add up to that window)."""
    produced: dict[Key, float] = {a.action: a.produced for run in runs.values()
                                  for a in run.actions}
    needs = cross_inputs(schedule)
    rows = []
    for rank, run in sorted(runs.items()):
        bubble, exposed = max(0.0, run.begin - origin), 0.0
        for a in run.actions:
            waited = max(0.0, a.start - a.ready)
            inputs = [produced[d] for d in needs[a.action]]
            before = min(waited, max(0.0, max(inputs, default=a.ready) - a.ready))
            bubble, exposed = bubble + before, exposed + waited - before
        bubble += max(0.0, finish - max(run.actions[-1].end, origin))
        rows.append({"rank": rank, "busy": finish - origin - bubble - exposed,
                     "bubble": bubble, "exposed comm": exposed})
    return pd.DataFrame(rows).set_index("rank")


def ranks_actions(records: list[dict[str, Any]], offsets: Mapping[int, int]
                  ) -> dict[int, list[Ran]]:
    """Each pp rank's compute actions in the order they ran (ms; ``offsets`` as
    measured_runs takes them): an action starts once its input is there and ends when the
    rank begins its next one (the compute, then the Python posting its sends)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)

    def ms(r: dict[str, Any], ns: int) -> float:
        return (ns - offsets.get(r["global_rank"], 0)) / 1e6

    ran: dict[int, list[Ran]] = {}
    for rank, rows in by_rank.items():
        rows.sort(key=lambda r: r["begin_ns"])
        computes = [r for r in rows if r["kind"] in ("F", "B", "I", "W")]
        ran[rank] = []
        for r, after in zip(computes, [*computes[1:], None], strict=True):
            ready, produced = ms(r, r["begin_ns"]), ms(r, r["end_ns"])
            ran[rank].append(Ran(Action(r["stage"], r["kind"], r["microbatch"]), ready,
                                 ready + r["wait"] * 1e3, produced,
                                 produced if after is None else ms(after, after["begin_ns"])))
    return ran


def measured_costs(measured: pd.DataFrame, schedule: Schedule) -> Costs:
    """Median measured time per kind (``start``, ``end``), scaled back to a rank's whole
    share of the model."""
    per_kind = (measured["end"] - measured["start"]).groupby(measured["kind"]).median()
    scale = schedule.stages / schedule.ranks
    kinds = {k: float(v) * scale for k, v in per_kind.items()}
    if "I" in kinds:
        return Costs(forward=kinds["F"], backward_input=kinds["I"],
                     backward_weight=kinds.get("W", 0.0))
    return Costs(forward=kinds["F"], backward=kinds.get("B", 2 * kinds["F"]))


def action_costs(ran: Iterable[Ran], schedule: Schedule) -> Costs:
    """One cost per kind (the median, ms), each action timed as ``ranks_actions`` cuts it:
    what the simulator replays a measured step with, in the chart and the bubble table."""
    return measured_costs(pd.DataFrame([{"kind": a.action.kind, "start": a.start,
                                         "end": a.end} for a in ran]), schedule)


def measured_runs(records: list[dict[str, Any]], schedule: Schedule,
                  offsets: Mapping[int, int]) -> tuple[dict[int, RankRun], float, float]:
    """Each pp rank's compute actions from a whole step's records, on the notebook's clock
    (ms; ``offsets``: global rank -> its clock minus the notebook's, ns); the step's origin
    (when the first action that needs nothing from another rank began) and finish (when the
    last action's output existed)."""
    needs = cross_inputs(schedule)
    ran = ranks_actions(records, offsets)
    origin = min(a.ready for acts in ran.values() for a in acts if not needs[a.action])
    finish = max(a.produced for acts in ran.values() for a in acts)
    # the simulator starts every rank at the origin: a rank waits from there for its first
    # action's input (posting its first receives included), as a rank does between actions
    runs = {rank: RankRun(origin, [a._replace(ready=origin if i == 0 else a.ready,
                                              start=max(a.start, origin))
                                   for i, a in enumerate(acts)])
            for rank, acts in ran.items()}
    return runs, origin, finish


def arrivals(runs: dict[int, RankRun], schedule: Schedule) -> dict[Action, float]:
    """Per action with an input from another rank: when that input was there, from the end
    of its producer's action (negative when it came while the producer's rank was still
    posting: the action's end includes that). Exact where the consumer waited; where it did
    not, the input was there when asked for, which replays the same."""
    ends: dict[Key, float] = {a.action: a.end for run in runs.values() for a in run.actions}
    needs = cross_inputs(schedule)
    return {a.action: a.start - max(ends[d] for d in needs[a.action])
            for run in runs.values() for a in run.actions if needs[a.action]}


def simulated_runs(timeline: Timeline, tails: Mapping[Action, float] | None = None
                   ) -> dict[int, RankRun]:
    """A simulated step cut as measured_runs cuts a measured one: a rank is ready for an
    action when its previous one ends; ``tails``: how long before its end an action's
    output existed (the posting after the compute), 0 where not given."""
    runs: dict[int, RankRun] = {}
    tails = tails or {}
    for t in sorted(timeline.timed, key=lambda t: t.start):
        run = runs.setdefault(t.rank, RankRun(0.0, []))
        ready = run.actions[-1].end if run.actions else 0.0
        run.actions.append(Ran(t.action, ready, t.start, t.end - tails.get(t.action, 0.0),
                               t.end))
    return runs


def compare_bubbles(records: list[dict[str, Any]], schedule: Schedule,
                    offsets: Mapping[int, int]) -> pd.DataFrame:
    """A whole step's bubble and exposed communication as measured, beside the simulator's
    with the costs measured in it (one per kind, the median, and the median hop a waiting
    rank saw): per pp rank and in total, ms, with ratios measured / simulated.

    ``attrs``: ``costs``, the makespans, ``spread`` (each kind's and the hops' fastest and
    slowest, ms: what one cost per kind leaves out) and ``replayed``, the simulator's
    figures for the step replayed with each action's own time and each input's own
    arrival (what the simulator makes of exactly these costs: the measured figures, when
    the measurement cuts time as the simulator does)."""
    runs, origin, finish = measured_runs(records, schedule, offsets)
    measured = split_idle(runs, schedule, origin, finish)
    ran = [a for run in runs.values() for a in run.actions]
    hops = arrivals(runs, schedule)
    seen = [max(0.0, hops[a.action]) for a in ran if a.action in hops and a.start > a.ready]
    costs = replace(action_costs(ran, schedule), comm=median(seen) if seen else 0.0)
    planned = simulate(schedule, costs, validated=True)
    simulated = split_idle(simulated_runs(planned), schedule, 0.0, planned.makespan)
    table = pd.DataFrame({
        "busy": measured["busy"], "bubble": measured["bubble"],
        "bubble simulated": simulated["bubble"], "exposed comm": measured["exposed comm"],
        "exposed comm simulated": simulated["exposed comm"]})
    table.loc["total"] = table.sum()
    table.insert(3, "bubble ratio", table["bubble"] / table["bubble simulated"])
    table["exposed ratio"] = table["exposed comm"] / table["exposed comm simulated"]
    spread = {kind: (min(t), max(t)) for kind in "FBIW"
              if (t := [a.end - a.start for a in ran if a.action.kind == kind])}
    if seen:
        spread["hop"] = (min(seen), max(seen))
    again = simulate(schedule, Costs(), validated=True,
                     durations={a.action: a.end - a.start for a in ran}, hops=hops)
    tails = {a.action: a.end - a.produced for a in ran}
    replayed = split_idle(simulated_runs(again, tails), schedule, 0.0,
                          max(t.end - tails[t.action] for t in again.timed))
    table.attrs.update(costs=costs, makespan=finish - origin,
                       makespan_simulated=planned.makespan, spread=spread,
                       replayed=replayed.sum().to_dict() | {"makespan": again.makespan})
    return table


def cross_inputs(schedule: Schedule) -> dict[Action, list[Key]]:
    """Per compute action, the actions on other ranks whose outputs it needs."""
    split, rank_of = backward_kinds(schedule), schedule.stage_to_rank
    return {a: [d for d in dependencies(a, schedule, split) if rank_of[d[0]] != rank_of[a.stage]]
            for row in schedule.actions.values() for a in row if a is not None}
