"""Session: a cluster of ranks and everything a notebook does with it, in plain Python.

It owns the Cluster, the journal (what ``export`` writes and ``restart`` replays), the bound
pipeline, the optimizer-step count and checkpoints. The ``%mesh`` magics are a thin skin over
it: each parses its line, makes one call here and displays what comes back.

>>> with Session(4) as s:
...     s.init("dp=2 tp=2")
...     s.run("x = torch.ones(2); dist.all_reduce(x); x")
...     s.export("train.py", sbatch=True)
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshlab.mesh import MeshSpec
from meshlab.notebook import restore
from meshlab.notebook.cluster import Cluster, ClusterError
from meshlab.notebook.export import Journal, export
from meshlab.notebook.output import (
    CellResult,
    MeshError,
    postmortem_text,
    size_text,
    stacks_text,
)
from meshlab.notebook.profiles import Profile
from meshlab.notebook.ranks import parse_ranks
from meshlab.notebook.stepping import SteppedPipeline, compare, plan_frame, resolve
from meshlab.rank.private_files import output_folder
from meshlab.schedules import Costs, Schedule

if TYPE_CHECKING:
    import pandas as pd

    from meshlab.dry_run.run import DryRun
    from meshlab.measure.sharding import ModuleReport, ShardingReport
    from meshlab.notebook.calibrate import CalibrationReport
    from meshlab.notebook.tables.table import Table
    from meshlab.plan.report import Plan


class SessionError(ValueError):
    """A request the session cannot take as it stands; the message names the fix."""


class Session:
    """One cluster of ranks, with the journal, pipeline and checkpoints of what ran on it."""

    def __init__(self, n: int | None = None, *, profile: str | Path | Profile = "local",
                 backend: str | None = None, debug: bool | None = None) -> None:
        self.n, self.profile, self.backend, self.debug = n, profile, backend, debug
        self.cluster: Cluster | None = None
        self.journal: Journal | None = None  # new at start; what export writes
        self.bound_pipeline: SteppedPipeline | None = None  # what step() advances
        self.optimizer_steps = 0  # on the ranks after the last cell: did the next one train?
        counter = itertools.count(1)
        self.cell_number: Callable[[], int] = lambda: next(counter)
        """The number the journal files the next entry under; the magics read In [n]."""

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Session:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.running:
            self.stop()

    @property
    def running(self) -> bool:
        return self.cluster is not None and self.cluster.running

    @property
    def world_size(self) -> int:
        return self.need_cluster().world_size

    def start(self, n: int | None = None, *, profile: str | Path | Profile | None = None,
              backend: str | None = None, debug: bool | None = None,
              progress: bool = True) -> str:
        """Start the ranks and their process group; returns the "ready" line."""
        cluster = Cluster(self.n if n is None else n,  # a bad line first
                          profile=profile or self.profile,
                          backend=backend or self.backend,
                          debug=self.debug if debug is None else debug)
        if self.running:
            raise SessionError(f"a cluster of {self.world_size} ranks is already running: "
                               "%mesh stop first, or %mesh restart")
        started = time.perf_counter()
        self.cluster = cluster.start(progress=progress)
        self.journal = Journal(cluster.world_size, cluster.backend)
        self.bound_pipeline, self.optimizer_steps = None, 0
        return (f"{cluster.world_size} ranks ready in {time.perf_counter() - started:.1f} s "
                f"({cluster.start_phases}): {cluster.describe()}")

    def stop(self) -> str:
        """Stop every rank; says what stopped and how long it took."""
        cluster = self.need_cluster()
        started, n = time.perf_counter(), cluster.world_size
        cluster.stop()
        self.cluster, self.bound_pipeline = None, None
        return (f"stopped {n} rank{'s' if n != 1 else ''} and their controller in "
                f"{time.perf_counter() - started:.1f} s")

    def restart(self, *, upto: int | None = None, from_checkpoint: str | None = None,
                progress: Callable[[str], None] = print) -> None:
        """Fresh engines of the same size and profile, and the session replayed on them:
        every successful cell (up to In [upto]), or from a checkpoint this session saved.
        A replay that fails raises ReplayError naming the cell and those not replayed."""
        cluster, journal = self.need_cluster(), self.need_journal()
        checkpoint = from_checkpoint and os.path.abspath(from_checkpoint)
        steps = restore.plan(journal, upto=upto, checkpoint=checkpoint)  # before stopping
        started = time.perf_counter()
        cluster.restart()
        self.bound_pipeline = None
        progress(f"{cluster.world_size} fresh ranks ready in "
                 f"{time.perf_counter() - started:.1f} s; replaying "
                 f"{len(steps.entries) + bool(steps.load)} recorded entries")
        for entry in steps.skipped:
            progress(f"  In [{entry.number}] skipped: it trained, {from_checkpoint} holds that")
        for entry in steps.unsafe:
            progress(f"  In [{entry.number}] skipped: it destroys the default process group "
                     "(dist.destroy_process_group()), which would leave the ranks without one")
        self.journal = Journal(cluster.world_size, cluster.backend)  # replays record nothing
        again = "%mesh restart" + (f" --from-checkpoint {from_checkpoint}"
                                   if from_checkpoint else "")
        try:
            restore.replay(cluster, steps, redo=lambda verb, kwargs: getattr(self, verb)(
                **kwargs), progress=progress, again=again)
        finally:
            self.journal = journal
            # a failed replay too: the next cell's "did it train?" counts from what ran
            self.optimizer_steps = cluster.optimizer_steps()
        progress(f"session restored in {time.perf_counter() - started:.1f} s")

    # -- running code ----------------------------------------------------------------------

    def run(self, code: str, ranks: str | list[int] | None = None,
            timeout: float | None = None, *, on_output: Callable[[CellResult], None] | None
            = None, keep_values: bool = False, comms: bool = False,
            profile: bool = False, profile_dir: str | Path | None = None,
            max_lines: int | None = None) -> CellResult:
        """Run ``code`` on every rank (or ``ranks``) and record it; MeshError if any failed.

        See Cluster.run for the options. ``max_lines``: keep at most this many lines of
        each rank's stdout and stderr for this cell (default ``cluster.max_output_lines``);
        the rest goes to a file per rank that ``result.full_output`` names. ``profile``:
        every rank's timeline on one clock into ``result.profile`` (a CellProfile);
        ``profile_dir`` also writes it there as one Chrome/Perfetto trace, ``cell-N.json``."""
        cluster, number = self.need_cluster(), self.cell_number()
        if profile_dir is not None:  # before it runs: a trace it cannot write loses no cell
            profile_dir = output_folder(profile_dir, "--profile-dir")
        default = cluster.max_output_lines
        try:
            cluster.max_output_lines = max_lines or default
            result = cluster.run(code, ranks, timeout, on_output=on_output,
                                 keep_values=keep_values, comms=comms,
                                 profile=profile or profile_dir is not None,
                                 trace=profile_dir is not None, number=number)
        except MeshError as e:  # not exported, but export names what later cells needed
            self.need_journal().record_failure(code, number)
            if profile_dir is not None and e.result.profile is not None:
                e.result.profile.save(profile_dir, f"cell-{number}")  # a failure's too
            raise
        finally:
            cluster.max_output_lines = default
        if profile_dir is not None and result.profile is not None:
            result.profile.save(profile_dir, f"cell-{number}")
        steps = self.optimizer_steps
        self.optimizer_steps = result.optimizer_steps if result.optimizer_steps is not None \
            else cluster.optimizer_steps(result.ranks)  # a rank did not report: ask them
        self.need_journal().record_cell(code, number, result.ranks,
                                        trained=self.optimizer_steps > steps)
        return result

    def init(self, axes: str | MeshSpec | None = None) -> MeshSpec:
        """Build the named DeviceMesh ``mesh`` on every rank (no axes: the one there is)."""
        cluster = self.need_cluster()
        if axes:
            spec = cluster.init_mesh(axes)
            self.need_journal().record_mesh(spec, self.cell_number())
        if cluster.mesh_spec is None:
            raise SessionError("no mesh yet: %mesh init dp=2 tp=2 (axes multiply to the "
                               "world size)")
        return cluster.mesh_spec

    def push(self, values: Mapping[str, Any], ranks: str | list[int] | None = None) -> None:
        """Copy values to the ranks' namespaces (and into the journal, as literals)."""
        cluster = self.need_cluster()
        cluster.push(values, ranks)
        taken = parse_ranks(ranks, cluster.world_size) if ranks else None
        self.need_journal().record_push(dict(values), self.cell_number(), taken)

    def pull(self, name: str, ranks: str | list[int] | None = None, *,
             shown_as: int | None = None) -> dict[int, Any]:
        """``{rank: value}`` of a name on the ranks. ``shown_as``: the Out[n] IPython will
        show (and cache) the value as, for the warning a large pull gives."""
        try:
            return self.need_cluster().pull(name, ranks, shown_as=shown_as)
        except KeyError as e:
            raise SessionError(e.args[0]) from None

    def throttle(self, ranks: str | list[int] | None, factor: float = 2.0) -> str:
        """Slow the compute of ``ranks`` ``factor`` times: a straggler to watch the others wait
        for (``run(..., profile=True)``); ``ranks`` None: every rank at full speed again. It
        stays on across cells, a restart replays it, an export leaves it out."""
        from meshlab.measure.throttle import check_factor
        from meshlab.notebook import on_ranks

        cluster = self.need_cluster()
        chosen = parse_ranks(ranks, cluster.world_size) if ranks is not None else None
        value = check_factor(factor) if chosen is not None else 1.0
        now = cluster._apply_each(on_ranks.set_throttle, lambda r: {  # every rank answers
            "factor": value if chosen is None or r in chosen else None})
        self.need_journal().record_throttle(self.cell_number(), chosen, value)
        slow = {r: f for r, f in sorted(now.items()) if f != 1}
        if not slow:
            return "every rank computes at full speed"
        return ("throttled: " + ", ".join(f"rank {r} x{f:g}" for r, f in slow.items())
                + " (each op followed by a sleep of factor - 1 times its duration); "
                "%mesh throttle off restores full speed")

    def prove(self, model: str, plan: str, factory: str | None = None) -> str:
        """Train ``plan`` (a ParallelPlan on the ranks) for two steps on a tiny copy of
        ``model`` (its class, shrunk; ``factory``: a function of a TinySize, for a model
        written by hand) on the current mesh, beside one process: what it found, or a
        MeshError naming what differs (meshlab.verify.tiny)."""
        given = f", factory={factory}" if factory else ""
        result = self.need_cluster().run(
            "from meshlab.verify.tiny import prove as _prove\n"
            f"str(_prove({model}, mesh, {plan}{given}))", keep_values=True)
        return str(result.values[min(result.values)])

    # -- looking at the ranks --------------------------------------------------------------

    def status(self) -> pd.DataFrame:
        """One row per rank: host, pid, device, alive, busy, memory."""
        return self.need_cluster().status()

    def stacks(self, ranks: str | list[int] | None = None) -> str:
        """Every rank's current stack (identical ones once) and its last collectives."""
        cluster = self.need_cluster()
        chosen = parse_ranks(ranks, cluster.world_size)
        return stacks_text(cluster.stacks(chosen), cluster.collectives(chosen), chosen)

    def postmortem(self, rank: int) -> str:
        """Post-mortem of the last failed cell on ``rank``."""
        return postmortem_text(rank, self.need_cluster().postmortem(rank))

    def inspect(self, expr: str, ranks: str | list[int] | None = None
                ) -> ShardingReport | ModuleReport:
        """Which rank holds which block of ``expr`` (a DTensor, tensor or module)."""
        return self.need_cluster().inspect(expr, ranks)

    def memory(self, model: str, optimizer: str | None = None, *, stage: int | None = None,
               dp: int | None = None, inputs: str | None = None) -> pd.DataFrame:
        """Bytes of parameters, gradients and optimizer states per rank (activations one
        forward on ``inputs`` saves), on the device and offloaded to host memory, beside the
        ZeRO formula for ``stage`` if given."""
        from meshlab.notebook.tables.memory import memory_frame

        cluster = self.need_cluster()
        try:
            reports, params, activations = cluster.memory(model, optimizer, inputs)
        except ClusterError as e:
            raise SessionError(f"cannot measure {model!r}:\n{e}") from None
        spec = cluster.mesh_spec
        dp = dp or (spec.dp_replicate * spec.dp_shard if spec else cluster.world_size)
        # params: what one tp rank holds, counted on the ranks (TP leaves norms, and often
        # the embedding and head, whole), so the formula divides it by dp only
        return memory_frame(reports, params=params, dp=dp, stage=stage, activations=activations)

    # -- checkpoints -----------------------------------------------------------------------

    def checkpoint(self, action: str, path: str | Path, names: Sequence[str] = (), *,
                   background: bool = False, trusted: bool = False,
                   group_readable: bool = False) -> str:
        """Save (or load) named objects on every rank as a sharded checkpoint in ``path``;
        returns what was done. Default names: those of model, optimizer, step defined.
        ``trusted``: load one another account could have written (it runs their pickles).
        ``group_readable``: save it 0750/0640 (default 0700/0600: only you read it)."""
        cluster, journal = self.need_cluster(), self.need_journal()
        if action not in ("save", "load"):
            raise SessionError(f"checkpoint action {action!r}: use 'save' or 'load'")
        path, number = os.path.abspath(path), self.cell_number()
        names = list(names) or (cluster.defined(list(restore.DEFAULT_NAMES)) if action == "save"
                                else restore.read_manifest(path)["names"])
        if not names:
            raise SessionError("nothing to save: none of model, optimizer, step is defined on "
                               "rank 0; name the objects: %mesh checkpoint save DIR model "
                               "optimizer")
        code = (restore.save_code(path, names, journal, number, background=background,
                                  group_readable=group_readable)
                if action == "save" else restore.load_code(path, names, trusted))
        try:
            cluster.run(code)  # a failure shows as any cell's would
        except MeshError as e:
            for left in sorted(Path(path).parent.glob(f"{glob.escape(Path(path).name)}.partial-*")):
                e.add_note(f"{left} holds the shards written before the save stopped "
                           f"({size_text(_bytes_in(left))}): the next save to {path} removes it")
            raise
        journal.record_checkpoint(code, number, action, path)
        # loading a fresh optimizer's state takes a zero-lr step: not the next cell's training
        self.optimizer_steps = cluster.optimizer_steps()
        done = "saving" if background else "saved" if action == "save" else "loaded"
        # the background save's error comes later, in another command: say which
        later = (" in the background (if it fails, the next checkpoint save, load or wait "
                 "says so)" if background else "")
        return (f"{done} {', '.join(names)} {'to' if action == 'save' else 'from'} {path} on "
                f"{cluster.world_size} ranks{later}")

    # -- pipelines -------------------------------------------------------------------------

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

    # -- measuring and planning ------------------------------------------------------------

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

    def export(self, path: str | Path, *, sbatch: bool = False, nodes: int = 1,
               gpus_per_node: int | None = None, cells: str | None = None) -> list[Path]:
        """The session's successful cells as a torchrun script, launch.sh (and job.sbatch)."""
        return export(self.need_journal(), path, sbatch=sbatch, nodes=nodes,
                      gpus_per_node=gpus_per_node, cells=cells)

    # -- helpers ---------------------------------------------------------------------------

    def need_cluster(self) -> Cluster:
        """The running cluster, or a SessionError naming how to start one."""
        if self.cluster is None or not self.cluster.running:
            raise SessionError("no cluster is running: %mesh start N")
        return self.cluster

    def need_journal(self) -> Journal:
        """The session's journal (begun on first use when the cluster came from elsewhere)."""
        if self.journal is None:
            cluster = self.need_cluster()
            self.journal = Journal(cluster.world_size, cluster.backend)
        return self.journal


__all__ = ["Session", "SessionError"]


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
