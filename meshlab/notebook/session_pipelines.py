"""Pipeline schedules from a Session: compare them (no cluster needed), bind one to a model on
the ranks and step it. Mixed into Session."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshlab.notebook.errors import SessionError
from meshlab.notebook.stepping import SteppedPipeline, compare, plan_frame, resolve
from meshlab.rank.private_files import output_folder
from meshlab.schedules import Costs, Schedule

if TYPE_CHECKING:
    import pandas as pd

    from meshlab.notebook.cluster import Cluster
    from meshlab.notebook.export import Journal


class Pipelines:
    """schedule, pipeline and step."""

    bound_pipeline: SteppedPipeline | None
    cell_number: Callable[[], int]
    need_cluster: Callable[[], Cluster]
    need_journal: Callable[[], Journal]

    def schedule(self, names: Sequence[str | Schedule], *, stages: int = 4,
                 microbatches: int = 8, virtual: int = 1, costs: str | Costs = "1,2",
                 comm: float = 0.0, namespace: Mapping[str, Any] | None = None
                 ) -> tuple[list[Schedule], pd.DataFrame, pd.DataFrame]:
        """Build (or take), validate and simulate schedules: the schedules, a summary table
        (one row each) and their timelines in one frame to chart. Needs no cluster."""
        costs = costs if isinstance(costs, Costs) else Costs.parse(costs, comm=comm)
        schedules = [resolve(n, ranks=stages, microbatches=microbatches, virtual=virtual,
                             namespace=namespace) for n in names]
        timelines, table = compare(schedules, costs)
        return schedules, table, plan_frame(timelines)

    def pipeline(self, model: str, schedule: str | Schedule, *, microbatches: int = 4,
                 virtual: int = 1, batch: str = "batch", loss: str | None = None,
                 namespace: Mapping[str, Any] | None = None) -> SteppedPipeline:
        """Bind a schedule to a model on the ranks over the pp axis; ``step`` runs it."""
        cluster = self.need_cluster()
        spec = cluster.mesh_spec
        if spec is None or spec.pp < 2:
            raise SessionError("the mesh has no pp axis: %mesh init pp=N (times the other "
                               "axes)")
        built = resolve(schedule, ranks=spec.pp, microbatches=microbatches, virtual=virtual,
                        namespace=namespace)
        self.bound_pipeline = SteppedPipeline(cluster, built, model=model, batch=batch, loss=loss)
        self.need_journal().record_pipeline(model, built, self.cell_number(), batch=batch,
                                            loss=loss)
        return self.bound_pipeline

    def step(self, slots: int | None = 1, *, profile: bool = False,
             profile_dir: str | Path | None = None) -> list[dict[str, Any]]:
        """Run the next ``slots`` slots of the bound pipeline (None: the rest of the step);
        what ran, one record per action and rank. ``profile``: every rank's timeline into
        ``bound_pipeline.profile``, each action a named span; ``profile_dir`` also writes
        it there as one Chrome/Perfetto trace, ``step-N.json`` (N: this call's number, as
        cell-N for ``run``)."""
        if self.bound_pipeline is None:
            raise SessionError("no pipeline is bound: %mesh pipeline MODEL --schedule NAME")
        number = self.cell_number()
        if profile_dir is not None:
            profile_dir = output_folder(profile_dir, "--profile-dir")
        ran = self.bound_pipeline.step(slots, profile=profile or profile_dir is not None,
                                       trace=profile_dir is not None)
        if profile_dir is not None and self.bound_pipeline.profile is not None:
            self.bound_pipeline.profile.save(profile_dir, f"step-{number}")
        self.need_journal().record_step(number, slots)
        return ran
