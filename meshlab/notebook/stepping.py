"""Notebook side of pipeline schedules: plan and compare them, and step one on the ranks.

The ranks run meshlab.schedules.execute; this module only resolves schedules, sends them,
collects what ran, and turns it into frames for meshlab.notebook.charts.timeline_chart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from statistics import median
from typing import TYPE_CHECKING, Any, NamedTuple

import pandas as pd

from meshlab.notebook.cluster import Cluster
from meshlab.schedules import (
    BUILDERS,
    TAKES_VIRTUAL,
    Costs,
    Schedule,
    ScheduleError,
    Timeline,
    build,
    canonical,
    parse,
)
from meshlab.schedules.actions import Action
from meshlab.schedules.simulate import simulate
from meshlab.schedules.validate import Key, backward_kinds, dependencies

if TYPE_CHECKING:
    from meshlab.notebook.cell_profile import CellProfile
    from meshlab.notebook.tables.table import Table


def resolve(name: str | Schedule, *, ranks: int, microbatches: int, virtual: int = 1,
            namespace: Mapping[str, Any] | None = None) -> Schedule:
    """A Schedule from a builder name, a notebook variable (Schedule, text or rows), or a
    Schedule itself. ``virtual`` applies to the builders that take it (so one value can be
    given when comparing several)."""
    if isinstance(name, Schedule):
        return name
    if namespace is not None and name in namespace and name not in BUILDERS:
        value = namespace[name]
        schedule = value if isinstance(value, Schedule) else parse(value, name=name)
        return schedule
    looped = canonical(name) in TAKES_VIRTUAL  # the others fix their placement
    return build(name, ranks=ranks, microbatches=microbatches, virtual=virtual if looped else 1)


def compare(schedules: list[Schedule], costs: Costs) -> tuple[list[Timeline], pd.DataFrame]:
    """Simulate each schedule; their timelines and a summary table (one row each)."""
    timelines = [s.simulate(costs) for s in schedules]
    table = pd.DataFrame([t.summary() for t in timelines]).set_index("schedule")
    return timelines, table


def plan_frame(timelines: list[Timeline]) -> pd.DataFrame:
    """All timelines in one frame, one chart panel (``view``) per schedule."""
    frames = []
    for t in timelines:
        s = t.schedule
        view = f"{s.name}: p={s.ranks} m={s.microbatches} v={s.virtual}, " \
               f"bubble {t.bubble_fraction:.1%}"
        frames.append(t.to_frame().assign(view=view))
    return pd.concat(frames, ignore_index=True)


class SteppedPipeline:
    """A schedule bound to a model on the ranks, advanced a few slots at a time."""

    def __init__(self, cluster: Cluster, schedule: Schedule, *, model: str,
                 batch: str = "batch", loss: str | None = None,
                 name: str = "pipeline") -> None:
        schedule.validate()
        self.cluster, self.schedule, self.name = cluster, schedule, name
        self.plan = grid_frame(schedule)
        self.records: list[dict[str, Any]] = []
        self.loss: float | None = None
        self.profile: CellProfile | None = None
        """The last profiled ``step``'s profile: every rank's timeline on one clock."""
        self.whole_step_profiled = False  # the whole step ran in one profiled call
        cluster.push({"_meshlab_schedule": schedule})
        loss_arg = f", loss_fn={loss}" if loss else ""
        cluster.run(f"from meshlab.schedules.execute import bind as _meshlab_bind\n"
                    f"{name} = _meshlab_bind({model}, mesh, _meshlab_schedule, "
                    f"batch={batch}{loss_arg})")

    @property
    def done(self) -> bool:
        return self.loss is not None

    @property
    def slots_done(self) -> int:
        return max((r["slot"] + 1 for r in self.records), default=0)

    def step(self, slots: int | None = None, *, profile: bool = False, trace: bool = False
             ) -> list[dict[str, Any]]:
        """Run the next ``slots`` slots on every rank (the rest of the step when None).
        ``profile``: torch.profiler on every rank meanwhile, into ``self.profile`` (each
        action a span named for it); a whole step profiled in one call can be set beside
        the simulator's (``bubble_table``)."""
        if self.done:
            raise ScheduleError(f"this step is complete (loss {self.loss:.6g}): bind the "
                                "pipeline again for the next batch")
        count = "None" if slots is None else int(slots)
        from_start = not self.records
        result = self.cluster.run(f"{self.name}.advance({count}), {self.name}.loss",
                                  keep_values=True, profile=profile, trace=trace)
        ran: list[dict[str, Any]] = []
        seen = set()
        # ranks of other pp groups repeat the records; the lowest global rank of each pp
        # rank comes first, so the records kept are one pipeline's
        for global_rank, value in sorted(result.values.items()):
            records, loss = value
            for r in records:
                if (r["rank"], r["action"]) not in seen:
                    seen.add((r["rank"], r["action"]))
                    ran.append(r | {"global_rank": global_rank})
            self.loss = loss if loss is not None else self.loss
        self.records += ran
        if profile:
            self.profile = result.profile
        self.whole_step_profiled = from_start and self.done and result.profile is not None
        return ran

    def frame(self) -> pd.DataFrame:
        """The plan (executed actions solid, the rest outlined), what ran as measured (ms),
        and, once the step is complete, the plan re-simulated with the measured costs."""
        done = {(r["rank"], r["action"]) for r in self.records}
        plan = self.plan.assign(state=["done" if (r, a) in done else "pending" for r, a in
                                       zip(self.plan["rank"], self.plan["action"], strict=True)])
        frames = [plan.assign(view=f"the grid being stepped: {self.slots_done} of "
                                   f"{self.plan['slot'].max() + 1} slots run", unit="slots")]
        measured = self.measured()
        if not measured.empty:
            frames.append(measured.assign(view="measured on the ranks (ms)", state="done",
                                          unit="ms"))
        if self.done and not measured.empty:
            costs = measured_costs(measured, self.schedule)
            again = self.schedule.simulate(costs).to_frame()
            frames.append(again.assign(view=f"simulated with measured costs: {_costs(costs)}",
                                       state="done", unit="ms"))
        return pd.concat(frames, ignore_index=True)

    def bubble_table(self) -> pd.DataFrame:
        """Per pp rank and in total (ms): the bubble and the exposed communication of the
        step as measured, beside the simulator's for the same step replayed with each
        action's measured time and the measured hop between ranks; ratios measured over
        simulated. Needs the whole step profiled in one call (``step(None,
        profile=True)`` right after binding)."""
        if not self.whole_step_profiled or self.profile is None:
            raise ScheduleError("compare a whole step: bind the pipeline again, then run it "
                                "all in one profiled call (%mesh step --all --profile)")
        offsets = {r: c.offset_ns for r, c in self.profile.clocks.items()}
        return compare_bubbles(self.records, self.schedule, offsets)

    def bubble_view(self) -> Table:
        """``bubble_table`` with a caption and a note saying how it was cut."""
        from meshlab.notebook.tables.table import Table, sig

        table = self.bubble_table()
        a = table.attrs
        spread = ", ".join(f"{k} {lo:.3g}-{hi:.3g}" for k, (lo, hi) in a["spread"].items())
        again = a["replayed"]
        return Table(table.reset_index(), formats={c: sig(3) for c in table.columns},
                     caption=f"bubble and exposed communication (ms): measured, and simulated "
                             f"with the measured costs ({_costs(a['costs'])}, hop "
                             f"{a['costs'].comm:.3g} ms); makespan {a['makespan']:.4g} ms "
                             f"measured, {a['makespan_simulated']:.4g} simulated",
                     note="busy: compute and the Python between actions (posting sends and "
                          "receives); bubble: waiting for an input its producer had not "
                          "made yet, and before a rank's first action and after its last; "
                          "exposed comm: waiting for an input already made (its send and "
                          "transfer). Costs are medians; measured here they ranged "
                          f"{spread} ms, which one cost per kind leaves out. Replayed with "
                          "each action's own time and each input's own arrival, the "
                          f"simulator gives bubble {again['bubble']:.4g}, exposed "
                          f"{again['exposed comm']:.4g}, makespan {again['makespan']:.4g}.")

    def measured(self) -> pd.DataFrame:
        """Compute actions that ran, with start and end in ms since the step began."""
        rows = [r for r in self.records if r["kind"] in ("F", "B", "I", "W")]
        frame = pd.DataFrame(rows, columns=["rank", "slot", "stage", "kind", "microbatch",
                                            "action", "start", "end", "wait"])
        return frame.assign(start=frame["start"] * 1e3, end=frame["end"] * 1e3)


def grid_frame(schedule: Schedule) -> pd.DataFrame:
    """The schedule's grid as a timeline: each action in its slot, one unit long."""
    from meshlab.schedules.validate import slots

    rows = [{"rank": schedule.stage_to_rank[stage], "slot": slot, "stage": stage, "kind": kind,
             "microbatch": m, "action": f"{stage}{kind}{m}", "start": slot, "end": slot + 1}
            for (stage, kind, m), slot in slots(schedule).items()]
    return pd.DataFrame(rows).sort_values(["rank", "slot"], ignore_index=True)


def measured_costs(measured: pd.DataFrame, schedule: Schedule) -> Costs:
    """Median measured time per kind, scaled back to a rank's whole share of the model."""
    per_kind = (measured["end"] - measured["start"]).groupby(measured["kind"]).median()
    scale = schedule.stages / schedule.ranks
    kinds = {k: float(v) * scale for k, v in per_kind.items()}
    if "I" in kinds:
        return Costs(forward=kinds["F"], backward_input=kinds["I"],
                     backward_weight=kinds.get("W", 0.0))
    return Costs(forward=kinds["F"], backward=kinds.get("B", 2 * kinds["F"]))


def _costs(costs: Costs) -> str:
    if costs.backward_input is not None:
        return f"F {costs.forward:.2f}, I {costs.of('I'):.2f}, W {costs.of('W'):.2f} ms"
    return f"F {costs.forward:.2f}, B {costs.of('B'):.2f} ms"


# -- a measured step beside the simulator's ----------------------------------------------------
#
# Both sides are cut the same way. A rank's compute action is (ready, start, produced, end):
# ready when the rank reached it and began waiting for its input, start when the input was
# in, produced when its output existed (the compute ended), end when the rank reached its
# next compute action: the Python between actions (posting sends and receives) is the
# rank's work, and the simulator's action times include it. Waiting for an input before its
# producer on another rank had produced it is bubble; waiting after, until it arrived, is
# exposed communication (the send's posting and the transfer). Before a rank's first action
# and after its last is bubble too.

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


def measured_runs(records: list[dict[str, Any]], schedule: Schedule,
                  offsets: Mapping[int, int]) -> tuple[dict[int, RankRun], float, float]:
    """Each pp rank's compute actions from a whole step's records, on the notebook's clock
    (ms; ``offsets``: global rank -> its clock minus the notebook's, ns); the step's origin
    (when the first action that needs nothing from another rank began) and finish (when the
    last action's output existed)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_rank.setdefault(r["rank"], []).append(r)

    def ms(r: dict[str, Any], ns: int) -> float:
        return (ns - offsets.get(r["global_rank"], 0)) / 1e6

    needs = cross_inputs(schedule)
    begins: dict[int, float] = {}
    ran: dict[int, list[Ran]] = {}
    for rank, rows in by_rank.items():
        rows.sort(key=lambda r: r["begin_ns"])
        computes = [r for r in rows if r["kind"] in ("F", "B", "I", "W")]
        begins[rank] = ms(rows[0], rows[0]["begin_ns"])
        ran[rank] = []
        for r, after in zip(computes, [*computes[1:], None], strict=True):
            ready, produced = ms(r, r["begin_ns"]), ms(r, r["end_ns"])
            ran[rank].append(Ran(Action(r["stage"], r["kind"], r["microbatch"]), ready,
                                 ready + r["wait"] * 1e3, produced,
                                 produced if after is None else ms(after, after["begin_ns"])))
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
    costs = replace(measured_costs(pd.DataFrame(
        [{"kind": a.action.kind, "start": a.start, "end": a.end} for a in ran]), schedule),
        comm=median(seen) if seen else 0.0)
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
