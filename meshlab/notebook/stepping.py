"""Notebook side of pipeline schedules: plan and compare them, and step one on the ranks.

The ranks run meshlab.schedules.execute; this module only resolves schedules, sends them,
collects what ran, and turns it into frames for meshlab.notebook.charts.timeline_chart.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

from meshlab.notebook.cluster import Cluster
from meshlab.notebook.pipeline_bubbles import action_costs, ranks_actions
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
            costs = self.costs()
            hop = f", hop {costs.comm:.3g} ms" if costs.comm else ""  # as the table says it
            again = self.schedule.simulate(costs).to_frame()
            frames.append(again.assign(view=f"simulated with measured costs: {_costs(costs)}"
                                            + hop, state="done", unit="ms"))
        return pd.concat(frames, ignore_index=True)

    def costs(self) -> Costs:
        """The step's costs, one per kind as the bubble table states them: each action from
        its input's arrival to the rank's next action (its compute and the Python posting its
        sends), the median; with the median hop where the whole step was profiled."""
        if self.whole_step_profiled and self.profile is not None:
            costs: Costs = self.bubble_table().attrs["costs"]
            return costs
        return action_costs((a for acts in ranks_actions(self.records, {}).values()
                             for a in acts), self.schedule)

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
        from meshlab.notebook.pipeline_bubbles import compare_bubbles

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


def _costs(costs: Costs) -> str:
    if costs.backward_input is not None:
        return f"F {costs.forward:.2f}, I {costs.of('I'):.2f}, W {costs.of('W'):.2f} ms"
    return f"F {costs.forward:.2f}, B {costs.of('B'):.2f} ms"
