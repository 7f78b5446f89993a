"""Measuring and planning from a Session: kernel benches, a calibrated hardware profile, the
planner (checked against the live mesh if asked) and dry runs on fake ranks. Mixed into
Session."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshlab.notebook.errors import SessionError
from meshlab.notebook.ranks import parse_ranks

if TYPE_CHECKING:
    import pandas as pd

    from meshlab.dry_run.run import DryRun
    from meshlab.notebook.calibrate import CalibrationReport
    from meshlab.notebook.cluster import Cluster
    from meshlab.notebook.output import CellResult
    from meshlab.notebook.tables.table import Table
    from meshlab.plan.report import Plan


class Planning:
    """bench, calibrate, plan, plan_check and dryrun."""

    cluster: Cluster | None
    run: Callable[..., CellResult]
    need_cluster: Callable[[], Cluster]

    if TYPE_CHECKING:  # Session's
        @property
        def running(self) -> bool: ...

    def bench(self, kernel: str, *, ref: str | None = None, sizes: list[int] | None = None,
              dtype: str = "float32", mode: str = "fwd", rows: int | None = None,
              ranks: str | None = None) -> pd.DataFrame:
        """Time a Triton kernel beside its torch reference on every rank."""
        from meshlab.notebook.bench import run_bench

        return run_bench(self.need_cluster(), kernel, ref=ref, sizes=sizes, dtype=dtype,
                         mode=mode, rows=rows, ranks=ranks)

    def calibrate(self, path: str | Path = "calibrated.toml", *, name: str | None = None,
                  sizes: list[int] | None = None, quick: bool = False) -> CalibrationReport:
        """Measure the live ranks and write a hardware profile for the planner."""
        from meshlab.notebook.calibrate import calibrate_profile

        return calibrate_profile(self.need_cluster(), path, name=name, sizes=sizes,
                                 quick=quick)

    def plan(self, model: Any, *, gpus: int | None = None, seq: int | None = None,
             verify: int = 0, measure: str | None = None, steps: int = 1,
             **options: Any) -> Plan | Table:
        """Memory, communication and step time of ``model`` (at ``seq`` tokens per sequence if
        given) on ``gpus`` GPUs (default: this cluster's ranks); options as
        meshlab.plan.report.plan takes them. ``verify``: dry-run
        the best ``verify`` layouts too (``Plan.verified``). ``measure``: a training step the
        ranks know, run ``steps`` times under the profiler for the planner's terms on the
        live mesh beside the measured ones (plan_check; ``layout`` is the live mesh's)."""
        from meshlab.plan import model_shape
        from meshlab.plan.hardware import with_nodes_of
        from meshlab.plan.report import plan

        if hasattr(model, "num_hidden_layers") and hasattr(model, "to_json_string"):
            # a transformers config: its structure from the model it builds, on meta
            from meshlab.dry_run.shape_from_config import checked_shape

            model = checked_shape(model, name=str(getattr(model, "model_type", "")
                                                  or "transformers"))
        if seq is not None:
            model = dataclasses.replace(model_shape(model), seq_len=seq)
        if measure:
            if not options.get("layout"):
                raise SessionError("measuring needs the live layout: the mesh's degrees and "
                                   'the planner\'s keys, e.g. layout="dp=2 tp=2 zero=3 mbs=4"')
            return self.plan_check(model, options["layout"],
                                   hardware=options.get("hardware_profile"), step=measure,
                                   steps=steps, precision=options.get("precision") or "fp32")

        live = self.cluster if self.running and self.cluster and not gpus else None
        gpus = gpus or (live.world_size if live else None)
        if gpus is None:
            raise SessionError("how many GPUs? pass --gpus N (or start a cluster to plan for "
                               "it)")
        if live is not None:  # this cluster's nodes: as many GPUs on one as it has ranks there
            options["hardware_profile"] = with_nodes_of(
                options.get("hardware_profile") or "h100-sxm", live.host_of)
        found = plan(model, gpus=gpus, **options)
        if verify:  # what torch would allocate and send, for the best layouts
            from meshlab.dry_run.plan import describe

            found.verified = [self.dryrun(found.model, describe(e.layout),
                                          hardware=found.hardware)
                              for e in found.estimates[:verify]]
        return found

    def plan_check(self, model: Any, layout: str, *, hardware: Any, step: str = "train_step()",
                   steps: int = 1, precision: str = "fp32") -> Table:
        """The planner's time on the live mesh: ``step`` (a statement the ranks know, one
        training step) run ``steps`` times under ``%%mesh --profile``, each term of the step
        measured beside the planner's prediction for ``model``, ``layout`` (the live mesh's
        degrees, with the planner's keys: zero, mbs, m, ...) and ``hardware`` (the profile
        ``calibrate`` wrote). ``precision``: what the ranks train in (meshlab's CPU ranks:
        fp32, unless the layout says ``precision=bf16``)."""
        from meshlab.notebook.plan_vs_measured import plan_vs_measured
        from meshlab.plan import Layout, estimate, model_shape
        from meshlab.plan.hardware import hardware as find_hardware

        cluster = self.need_cluster()
        lay = Layout.parse(layout, precision=precision)
        if cluster.mesh_spec is None or lay.mesh_spec.axes() != cluster.mesh_spec.axes():
            raise SessionError(f"the layout {lay.describe()} is not the live mesh "
                               f"({cluster.mesh_spec or 'none: %mesh init first'}): give the "
                               "live mesh's degrees, or %mesh init the layout's")
        est = estimate(model_shape(model), lay, find_hardware(hardware))
        result = self.run(f"for _ in range({int(steps)}):\n    {step}", profile=True)
        return plan_vs_measured(result.profile, est, steps=steps)

    def dryrun(self, model: Any, layout: str, *, hardware: Any = "h100-sxm",
               ranks: str | None = None, **options: Any) -> DryRun:
        """One training step of ``model`` on ``layout`` as its representative ranks (or
        ``ranks``, e.g. "0,1023") would run it on that many GPUs, in this process on fake
        ranks: no cluster needed (meshlab.dry_run.run). ``model``: a factory, a ModelShape, a
        meshlab ModelConfig or a preset name; options as dryrun takes them (batch, seq)."""
        from meshlab.dry_run.run import dryrun
        from meshlab.models import ModelConfig, Transformer
        from meshlab.plan.hardware import hardware as find_hardware
        from meshlab.plan.layout import Layout

        if isinstance(model, ModelConfig):
            model = partial(Transformer, model)
        chosen = None
        if ranks is not None:
            chosen = parse_ranks(ranks, Layout.parse(layout).gpus)
        return dryrun(model, layout, hardware=find_hardware(hardware), ranks=chosen, **options)
