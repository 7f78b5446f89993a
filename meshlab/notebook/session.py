"""Session: a cluster of ranks and everything a notebook does with it, in plain Python.

It owns the Cluster, the journal (what ``export`` writes and ``restart`` replays), the bound
pipeline, the optimizer-step count and checkpoints. The ``%mesh`` magics are a thin skin over
it: each parses its line, makes one call here and displays what comes back.

Here: its lifecycle, running code, export. Mixed in, by concern: looking at the ranks
(session_inspect), checkpoints (session_checkpoints), pipeline schedules (session_pipelines),
measuring and planning (session_planning).

>>> with Session(4) as s:
...     s.init("dp=2 tp=2")
...     s.run("x = torch.ones(2); dist.all_reduce(x); x")
...     s.export("train.py", sbatch=True)
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from meshlab.mesh import MeshSpec
from meshlab.notebook import memory_snapshots, restore
from meshlab.notebook.cluster import Cluster
from meshlab.notebook.debug_prompt import Prompt
from meshlab.notebook.errors import SessionError
from meshlab.notebook.export import Journal, Written, export
from meshlab.notebook.output import CellResult, MeshError
from meshlab.notebook.profiles import Profile
from meshlab.notebook.progress_line import ProgressLine
from meshlab.notebook.ranks import parse_ranks
from meshlab.notebook.session_checkpoints import Checkpoints
from meshlab.notebook.session_inspect import Inspection
from meshlab.notebook.session_pipelines import Pipelines
from meshlab.notebook.session_planning import Planning
from meshlab.notebook.stepping import SteppedPipeline
from meshlab.rank.private_files import output_folder

if TYPE_CHECKING:
    from meshlab.notebook.cell_progress import CellProgress
    from meshlab.notebook.debugger import Debugger
    from meshlab.verify.layout_diff import LayoutDiff
    from meshlab.verify.loss_curves import LossComparison


class Session(Inspection, Checkpoints, Pipelines, Planning):
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
        self.cluster = cluster.start(progress=progress)
        self.journal = Journal(cluster.world_size, cluster.backend)
        self.bound_pipeline, self.optimizer_steps = None, 0
        return (f"{cluster.world_size} ranks ready in {cluster.start_seconds:.1f} s "
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
        # the start's own time, as its progress line above shows it, and the stop's apart
        stopping = time.perf_counter() - started - cluster.start_seconds
        progress(f"stopped the old ranks in {stopping:.1f} s; {cluster.world_size} fresh "
                 f"ranks ready in {cluster.start_seconds:.1f} s ({cluster.start_phases}); "
                 f"replaying {len(steps.entries) + bool(steps.load)} recorded entries")
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
            max_lines: int | None = None,
            on_breakpoint: Callable[[Debugger], None] | None = None,
            memory: bool = False, memory_dir: str | Path | None = None,
            on_oom: bool | None = None,
            on_progress: Callable[[CellProgress], None] | None = None) -> CellResult:
        """Run ``code`` on every rank (or ``ranks``) and record it; MeshError if any failed.

        See Cluster.run for the options. ``max_lines``: keep at most this many lines of
        each rank's stdout and stderr for this cell (default ``cluster.max_output_lines``);
        the rest goes to a file per rank that ``result.full_output`` names. ``profile``:
        every rank's timeline on one clock into ``result.profile`` (a CellProfile);
        ``profile_dir`` also writes it there as one Chrome/Perfetto trace, ``cell-N.json``.
        ``on_breakpoint``: called with a Debugger (meshlab.notebook.debugger) when a rank
        stops at ``breakpoint()``; by default a pdb prompt where ``input()`` reads
        (meshlab.notebook.debug_prompt).
        ``memory``: every rank's memory over the cell by category and module, into
        ``result.memory``; ``memory_dir`` also writes each rank's snapshot there as
        ``rank<N>.pickle`` (pytorch.org/memory_viz opens it); ``on_oom`` (default: the
        profile's ``memory_on_oom``) tracks it too and writes the snapshot of a rank that ran
        out of memory, its error saying where (meshlab.notebook.memory_snapshots).
        ``on_progress``: called every second, once the cell has run a few, with how long it
        has run and each rank's optimizer steps (a CellProgress); by default a ProgressLine
        shows it (an output updated in place in a notebook, a line on a terminal's stderr,
        nothing elsewhere) and ends on ``result.progress``."""
        cluster, number = self.need_cluster(), self.cell_number()
        line = ProgressLine() if on_progress is None else None
        if line is not None:  # (where it shows nothing the ranks are not asked)
            on_progress, on_output = line.on_progress, line.around(on_output)
        if profile_dir is not None:  # before it runs: a trace it cannot write loses no cell
            profile_dir = output_folder(profile_dir, "--profile-dir")
        memory_folder = output_folder(memory_dir, "--memory-dir") if memory_dir else None
        on_oom = cluster.profile.memory_on_oom if on_oom is None else on_oom
        track = memory or memory_folder is not None or on_oom
        default = cluster.max_output_lines
        try:
            cluster.max_output_lines = max_lines or default
            result = cluster.run(code, ranks, timeout, on_output=on_output,
                                 keep_values=keep_values, comms=comms,
                                 profile=profile or profile_dir is not None,
                                 trace=profile_dir is not None, number=number,
                                 on_breakpoint=on_breakpoint or Prompt(), memory=track,
                                 on_progress=on_progress)
        except MeshError as e:  # not exported, but export names what later cells needed
            if line is not None:
                line.finish(e.result.progress)
            self.need_journal().record_failure(code, number, e.result.drew)
            if profile_dir is not None and e.result.profile is not None:
                e.result.profile.save(profile_dir, f"cell-{number}")  # a failure's too
            if track:  # a rank that ran out: its snapshot, and the error says where
                memory_snapshots.keep(e.result, cluster, memory_folder, on_oom, number)
                raise MeshError(e.result) from None
            raise
        finally:
            cluster.max_output_lines = default
        if line is not None:
            line.finish(result.progress)
        if profile_dir is not None and result.profile is not None:
            result.profile.save(profile_dir, f"cell-{number}")
        if memory_folder is not None:
            memory_snapshots.save_all(result, memory_folder)
        steps = self.optimizer_steps
        self.optimizer_steps = result.optimizer_steps if result.optimizer_steps is not None \
            else cluster.optimizer_steps(result.ranks)  # a rank did not report: ask them
        self.need_journal().record_cell(code, number, result.ranks,
                                        trained=self.optimizer_steps > steps, drew=result.drew)
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

    def compare(self, model: str, plan: str, *, steps: int = 2, dtype: str = "float64",
                itself: bool = False, beside: str | None = None,
                beside_mesh: str | None = None, vocab: int | None = None) -> LayoutDiff:
        """Train ``plan`` (a ParallelPlan on the ranks) on ``model`` (a ModelConfig or a
        factory on the ranks) on the current mesh beside one process, module by module: the
        first step, phase, module and rank that differ (meshlab.verify.layout_diff);
        ``itself``: the layout twice, bit-identical or the first tensor that is not;
        ``beside``: another plan, on ``beside_mesh`` (axes; default the current mesh's),
        the two layouts set beside each other (meshlab.verify.two_layouts); ``vocab``: the
        token ids' range where the model's config does not say it."""
        if dtype not in ("float64", "float32"):
            raise SessionError(f"dtype={dtype!r}: the layout diff runs float64 (the default) "
                               "or float32")
        if itself and beside:
            raise SessionError(f"itself and beside={beside!r}: a layout is run twice, or set "
                               "beside another, not both")
        cluster = self.need_cluster()
        if cluster.mesh_spec is None:
            raise SessionError("the layout diff runs on the ranks' mesh, and there is none: "
                               "%mesh init AXES first (e.g. %mesh init dp=4)")
        options = f"steps={int(steps)}, dtype={dtype!r}, vocab={vocab!r}"
        if beside:
            spec = cluster.mesh_spec
            mine = str(spec)
            other = mine if beside_mesh is None else str(_mesh_spec(beside_mesh, spec.size))
            code = ("from meshlab.verify.two_layouts import diff_layouts as _diff\n"
                    f"_diff({model}, ({mine!r}, {plan}), ({other!r}, {beside}), names="
                    f"({plan + ' on ' + mine!r}, {beside + ' on ' + other!r}), {options})")
        else:
            code = ("from meshlab.verify.layout_diff import "
                    f"{'diff_with_itself' if itself else 'diff_with_single_process'} as _diff\n"
                    f"_diff({model}, mesh, {plan}, {options})")
        result = cluster.run(code, keep_values=True)
        return cast("LayoutDiff", result.values[min(result.values)])

    def compare_losses(self, runs: list[str], *, tolerance: float = 0.0) -> LossComparison:
        """Runs' losses (files LossLog wrote, where rank 0 ran) side by side, and the first
        step where one differs from the first run's by more than ``tolerance`` (relative;
        meshlab.verify.loss_curves). Needs no cluster."""
        from meshlab.verify.loss_curves import compare_losses, load_runs

        try:
            return compare_losses(load_runs(runs), tolerance)
        except ValueError as e:
            raise SessionError(str(e)) from None

    # -- export ----------------------------------------------------------------------------

    def export(self, path: str | Path, *, sbatch: bool = False, ray: bool = False,
               nodes: int = 1, gpus_per_node: int | None = None, cells: str | None = None
               ) -> Written:
        """The session's successful cells as a torchrun script, launch.sh (job.sbatch, and
        ray_job.py for a Ray cluster):
        the files written, and in ``.notes`` the failed cells left out and whether that makes
        the script draw random numbers differently (also at the script's top)."""
        return export(self.need_journal(), path, sbatch=sbatch, ray=ray, nodes=nodes,
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


def _mesh_spec(axes: str, ranks: int) -> MeshSpec:
    """``axes`` as a mesh of ``ranks`` ranks, or a SessionError saying why not."""
    try:
        spec = MeshSpec.parse(axes)
        spec.check(ranks)
    except ValueError as e:
        raise SessionError(f"beside_mesh={axes!r}: {e}") from None
    return spec
