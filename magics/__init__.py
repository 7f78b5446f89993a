"""The ``%mesh`` / ``%%mesh`` magics: parse a line, make one library call, display."""

from __future__ import annotations

import os
import time
from typing import Any

from IPython.core.completer import (
    CompletionContext,
    SimpleCompletion,
    SimpleMatcherResult,
    context_matcher,
)
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display

from meshlab.calibrate import parse_sizes
from meshlab.notebook.bench import run_bench
from meshlab.notebook.calibrate import calibrate_profile
from meshlab.notebook.charts import (
    bench_chart,
    comms_chart,
    memory_chart,
    plan_comm_chart,
    plan_memory_chart,
    timeline_chart,
)
from meshlab.notebook.cluster import Cluster, ClusterError
from meshlab.notebook.export import ExportError, Journal, export
from meshlab.notebook.output import (
    LiveOutput,
    MeshError,
    postmortem_text,
    stacks_text,
    strip_ansi,
    summary_lines,
)
from meshlab.notebook.ranks import parse_ranks
from meshlab.notebook.restore import (
    DEFAULT_NAMES,
    RestoreError,
    load_code,
    plan,
    read_manifest,
    replay,
    save_code,
)
from meshlab.notebook.stepping import SteppedPipeline, compare, plan_frame, resolve
from meshlab.notebook.tables.comms import comms_frame, comms_totals
from meshlab.notebook.tables.memory import memory_frame
from meshlab.notebook.widgets import MeshView, ShardingView, group_table
from meshlab.plan import HARDWARE, MODELS, PRECISIONS
from meshlab.plan import report as planning
from meshlab.schedules import BUILDERS, Costs, ScheduleError


# Each subcommand's arguments, declared once; `%mesh?` is assembled from them.
@magic_arguments()
@argument("n", nargs="?", type=int, help="number of ranks (default: one per GPU, else 4)")
@argument("--profile", default="local", help="a profile in clusters/ or a path to a .toml file")
@argument("--backend", choices=["auto", "gloo", "nccl"], help="override the profile's backend")
@argument("--debug", action="store_true",
          help="TORCH_DISTRIBUTED_DEBUG=DETAIL: mismatched collectives raise at once")
def _start(line: str) -> None:
    """%mesh start [N]: start N ranks and a torch.distributed process group across them."""


@magic_arguments()
def _stop(line: str) -> None:
    """%mesh stop: stop every rank."""


@magic_arguments()
@argument("--from-checkpoint", metavar="DIR", help="load this checkpoint (saved in this "
          "session) and replay only the cells after it, plus the setup they need")
@argument("--upto", type=int, metavar="N", help="replay up to In [N] only (default: everything, "
          "or up to the last cell marked `# meshlab: restore-point`)")
def _restart(line: str) -> None:
    """%mesh restart: fresh engines of the same size and profile, the mesh and the session's
    successful %%mesh cells replayed."""


@magic_arguments()
@argument("action", choices=["save", "load"])
@argument("path", help="a folder; each rank writes its own shards there")
@argument("names", nargs="*", help="objects on the ranks (default: those of model, optimizer, "
          "step defined; on load, every name the checkpoint holds)")
@argument("--async", dest="background", action="store_true",
          help="save in the background (torch.distributed.checkpoint.async_save)")
def _checkpoint(line: str) -> None:
    """%mesh checkpoint save|load DIR [NAME...]: sharded torch.distributed.checkpoint of named
    objects on every rank; loads into another mesh shape or world size."""


@magic_arguments()
@argument("--ranks", help="only these ranks, e.g. 0,2-3")
def _stacks(line: str) -> None:
    """%mesh stacks: every rank's current Python stack (identical ones once) and its last
    collectives; answers while a cell runs or hangs."""


@magic_arguments()
@argument("rank", type=int, help="the rank whose last failed cell to examine")
def _debug(line: str) -> None:
    """%mesh debug RANK: post-mortem of the last failed cell on RANK (traceback, the failing
    frame's variables)."""


@magic_arguments()
def _status(line: str) -> None:
    """%mesh status: a table of ranks (host, pid, device, alive, busy, memory)."""


@magic_arguments()
@argument("expr", nargs="+", help="a DTensor, tensor or nn.Module (any expression) on the ranks")
@argument("--ranks", help="only these ranks, e.g. 0,2-3")
def _inspect(line: str) -> None:
    """%mesh inspect EXPR: a widget showing which rank holds which block of EXPR."""


@magic_arguments()
@argument("model", help="a module on the ranks (a name or expression without spaces)")
@argument("optimizer", nargs="?", help="its optimizer on the ranks")
@argument("--stage", type=int, choices=[0, 1, 2, 3],
          help="also show the ZeRO paper's per-device formula for this stage")
@argument("--dp", type=int, help="data-parallel degree for the formula (default: the mesh's)")
@argument("--inputs", help="a batch on the ranks: also measure the activations one forward "
          "saves for backward")
def _memory(line: str) -> None:
    """%mesh memory MODEL [OPTIMIZER]: bytes of params, grads, optimizer states per rank."""


@magic_arguments()
@argument("names", nargs="+", help="notebook variables to copy to every rank")
@argument("--ranks", help="only these ranks, e.g. 0,2-3")
def _push(line: str) -> None:
    """%mesh push NAME...: copy notebook variables to the ranks."""


@magic_arguments()
@argument("name", help="a variable defined on the ranks")
@argument("--ranks", help="only these ranks, e.g. 0,2-3")
def _pull(line: str) -> None:
    """%mesh pull NAME: {rank: value} of a variable on the ranks."""


@magic_arguments()
@argument("axes", nargs="*", metavar="AXIS=SIZE",
          help="pp, dp_replicate, dp_shard (or dp), cp, tp, ep; e.g. dp=2 tp=2")
def _init(line: str) -> None:
    """%mesh init dp=2 tp=2: a named DeviceMesh `mesh` on every rank (no axes: show it)."""


@magic_arguments()
@argument("state", choices=["on", "off"])
def _auto(line: str) -> None:
    """%mesh auto on|off: run every following cell on the ranks, without the %%mesh line."""


@magic_arguments()
@argument("names", metavar="NAME", help="a builder (" + ", ".join(BUILDERS) + ") or a notebook "
          "variable holding a Schedule, a text table or rows; several, comma-separated, "
          "to compare")
@argument("--stages", type=int, default=4, help="pipeline ranks p (default 4)")
@argument("--microbatches", type=int, default=8, help="micro-batches m (default 8)")
@argument("--virtual", type=int, default=1, help="stages per rank v (interleaved, looped)")
@argument("--costs", default="1,2", help="F,B or F,I,W times (default 1,2)")
@argument("--comm", type=float, default=0.0, help="time of one hop between ranks")
@argument("-o", dest="output", metavar="NAME", help="keep the (first) Schedule as NAME")
def _schedule(line: str) -> None:
    """%mesh schedule: build, validate, simulate and chart pipeline schedules."""


@magic_arguments()
@argument("model", help="a meshlab Transformer on the ranks, split into the schedule's stages")
@argument("--schedule", required=True, help="a builder name or a notebook Schedule variable")
@argument("--microbatches", type=int, default=4, help="micro-batches, for a builder name")
@argument("--virtual", type=int, default=1, help="stages per rank, for a builder name")
@argument("--batch", default="batch", help="(inputs, targets) on the ranks (default: batch)")
@argument("--loss", help="loss function on the ranks (default: next-token cross-entropy)")
def _pipeline(line: str) -> None:
    """%mesh pipeline: bind a schedule to a model over the pp axis; `pipeline` on the ranks."""


@magic_arguments()
@argument("n", nargs="?", type=int, default=1, help="slots of the schedule to run (default 1)")
@argument("--all", action="store_true", help="run the rest of the step")
def _step(line: str) -> None:
    """%mesh step: run the next N slots of the bound pipeline on every rank, and chart it."""


@magic_arguments()
@argument("kernel", help="a built-in kernel (rmsnorm, softmax, swiglu, cross_entropy) or a "
          "callable on the ranks, e.g. one launching your @triton.jit kernel")
@argument("--ref", help="the reference on the ranks (default for built-ins: their torch twin)")
@argument("--sizes", default="256,1024", help="row lengths, comma-separated (default 256,1024)")
@argument("--dtype", default="float32", help="float32, float16, bfloat16 (default float32)")
@argument("--mode", choices=["fwd", "bwd", "full"], default="fwd", help="what to time")
@argument("--rows", type=int, help="rows per problem (default 4096 on GPU, 4 on CPU)")
@argument("--ranks", help="only these ranks, e.g. 0,2-3")
@argument("-o", dest="output", metavar="NAME", help="keep the table (a DataFrame) as NAME")
def _bench(line: str) -> None:
    """%mesh bench: time a Triton kernel beside torch on every rank; a table and a chart."""


@magic_arguments()
@argument("-o", dest="path", default="calibrated.toml", metavar="PATH",
          help="the hardware profile to write (default calibrated.toml)")
@argument("--name", help="the profile's name (default: the file's stem)")
@argument("--sizes", help="collective message sizes in bytes, comma-separated, K/M/G suffixes "
          "(default 4K..16M on CPU, 64K..256M on GPU)")
@argument("--quick", action="store_true", help="fewer sizes and repetitions: a rough profile "
          "in a few seconds")
def _calibrate(line: str) -> None:
    """%mesh calibrate: time matmuls, memory copies and every collective on each mesh axis of
    the live ranks; fit the planner's alpha-beta model; write a hardware profile."""


@magic_arguments()
@argument("model", help="a preset (" + ", ".join(MODELS) + "), or a notebook variable "
          "holding a ModelShape or a meshlab ModelConfig")
@argument("--gpus", type=int, help="GPUs to plan for (default: the running cluster's ranks)")
@argument("--hardware", default="h100-sxm", help="a profile (" + ", ".join(HARDWARE) + ") or "
          "a .toml file, e.g. one %%mesh calibrate wrote (default h100-sxm)")
@argument("--layout", help='one layout to estimate, e.g. "tp=8 pp=16 dp=16 zero=1 mbs=1 '
          'm=16"; without it the best layouts are searched')
@argument("--where", help='constraints for the search, e.g. "tp<=8 pp=16 zero=3"')
@argument("--batch", type=int, help="global batch in sequences (default: ~4M tokens, at "
          "least one sequence per GPU)")
@argument("--precision", default="bf16", choices=list(PRECISIONS),
          help="compute precision (default bf16)")
@argument("--tokens", type=float, help="training tokens, for days and GPU-hours (e.g. 15e12)")
@argument("--top", type=int, default=10, help="layouts to show from the search (default 10)")
@argument("-o", dest="output", metavar="NAME", help="keep the Plan in the notebook as NAME")
def _plan(line: str) -> None:
    """%mesh plan: predict memory per GPU, communication per axis and step time of a model on
    many GPUs, for one layout or the best layouts found."""


@magic_arguments()
@argument("path", help="the script to write, e.g. train.py; launch.sh goes beside it")
@argument("--sbatch", action="store_true", help="also write job.sbatch for Slurm")
@argument("--nodes", type=int, default=1, help="nodes to run on (default 1)")
@argument("--gpus-per-node", type=int, help="processes per node, one per GPU (default: the "
          "session's ranks on one node, on its device kind)")
@argument("--cells", help="In [n] numbers to take, e.g. 3-7,9 or 12- (default: all)")
def _export(line: str) -> None:
    """%mesh export: the session's successful %%mesh cells as a torchrun script."""


@magic_arguments()
@argument("--ranks", help="run on these ranks only, e.g. 0,2-3 (default: all)")
@argument("--timeout", type=float, help="time limit in seconds; stuck ranks show their stacks")
@argument("-o", dest="output", metavar="NAME",
          help="store {rank: value of the last expression} in the notebook as NAME")
@argument("--comms", action="store_true",
          help="trace the collectives each rank issued: counts, bytes, mesh axis")
def _cell(line: str) -> None:
    """%%mesh: run the cell on every rank; `rank`, `world_size`, `device`, `dist` are defined."""


cell_arguments = _cell  # %%mesh's options, for reading saved notebooks (meshlab.notebook.export)


SUBCOMMANDS = {"start": _start, "stop": _stop, "restart": _restart, "status": _status,
               "init": _init, "inspect": _inspect, "memory": _memory, "push": _push,
               "pull": _pull, "auto": _auto, "schedule": _schedule, "pipeline": _pipeline,
               "step": _step, "bench": _bench, "calibrate": _calibrate, "plan": _plan,
               "export": _export, "checkpoint": _checkpoint, "stacks": _stacks,
               "debug": _debug}


def _unquote(text: str | None) -> str | None:
    # magic_arguments keeps the quotes of "tp=8 pp=16" on the value
    return text.strip("\"'") if text else text


def _help() -> str:
    parts = [_cell.__doc__ or ""] + [fn.__doc__ or "" for fn in SUBCOMMANDS.values()]
    return "meshlab: run cells on every rank of a torch.distributed cluster.\n\n" + "\n\n".join(
        p.strip() for p in parts)


@magics_class
class MeshMagics(Magics):
    """``%mesh SUBCOMMAND`` and ``%%mesh``; holds the notebook's cluster."""

    shell: Any  # the InteractiveShell these magics are registered on

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.cluster: Cluster | None = None
        self.auto = False
        self.pipeline: SteppedPipeline | None = None
        self.journal: Journal | None = None  # what %mesh export writes; new at %mesh start
        self.optimizer_steps = 0  # on the ranks after the last cell: did the next one train?
        self.line = ""  # the %mesh line being run, for the journal to run again on restart

    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        if cell is not None:
            return self._run_cell(line, cell)
        sub, _, rest = line.strip().partition(" ")
        if sub not in SUBCOMMANDS:
            raise UsageError(f"unknown subcommand {sub!r}: use one of "
                             f"{', '.join(SUBCOMMANDS)} (see %mesh?)" if sub else
                             f"%mesh needs a subcommand: {', '.join(SUBCOMMANDS)} (see %mesh?)")
        args = parse_argstring(SUBCOMMANDS[sub], rest)
        self.line = line.strip()
        return getattr(self, f"_{sub}")(args)

    mesh.__doc__ = _help()

    # -- subcommands ----------------------------------------------------------------------

    def _start(self, args: Any) -> None:
        try:  # a bad line first: its error is the one to fix
            cluster = Cluster(args.n, profile=args.profile, backend=args.backend,
                              debug=args.debug or None)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if self.cluster is not None and self.cluster.running:
            raise UsageError(f"a cluster of {self.cluster.world_size} ranks is already running: "
                             "%mesh stop first, or %mesh restart")
        started = time.perf_counter()
        self.cluster = cluster.start()
        self.journal = Journal(cluster.world_size, cluster.backend)
        self.optimizer_steps = 0
        print(f"{cluster.world_size} ranks ready in {time.perf_counter() - started:.1f} s: "
              f"{cluster.describe()}")

    def _stop(self, args: Any) -> None:
        self._need_cluster().stop()
        self.cluster = None
        if _auto_transform in self.shell.input_transformers_cleanup:  # nothing left to run on
            self.shell.input_transformers_cleanup.remove(_auto_transform)
            self.auto = False

    def _restart(self, args: Any) -> None:
        cluster, journal = self._need_cluster(), self._journal()
        checkpoint = args.from_checkpoint and os.path.abspath(args.from_checkpoint)
        try:  # before stopping anything: a bad request loses nothing
            steps = plan(journal, upto=args.upto, checkpoint=checkpoint)
        except RestoreError as e:
            raise UsageError(str(e)) from None
        started = time.perf_counter()
        cluster.restart()
        self.pipeline = None
        print(f"{cluster.world_size} fresh ranks ready in {time.perf_counter() - started:.1f} s"
              f"; replaying {len(steps.entries) + bool(steps.load)} recorded entries")
        for entry in steps.skipped:
            print(f"  In [{entry.number}] skipped: it trained, {args.from_checkpoint} holds "
                  "that")
        self.journal = Journal(cluster.world_size, cluster.backend)  # replays record nothing
        try:
            replay(cluster, steps, run_line=lambda line: self.mesh(line))
        except RestoreError as e:
            raise UsageError(str(e)) from None
        finally:
            self.journal = journal
        self.optimizer_steps = cluster.optimizer_steps()
        print(f"session restored in {time.perf_counter() - started:.1f} s")

    def _checkpoint(self, args: Any) -> None:
        cluster, journal = self._need_cluster(), self._journal()
        path, number = os.path.abspath(args.path), self.shell.execution_count
        try:
            names = args.names or (cluster.defined(list(DEFAULT_NAMES)) if args.action == "save"
                                   else read_manifest(path)["names"])
        except RestoreError as e:
            raise UsageError(str(e)) from None
        if not names:
            raise UsageError("nothing to save: none of model, optimizer, step is defined on rank "
                             "0; name the objects: %mesh checkpoint save DIR model optimizer")
        code = (save_code(path, names, journal, number, background=args.background)
                if args.action == "save" else load_code(path, names))
        cluster.run(code)  # a failure shows as any cell's would
        journal.record_checkpoint(code, number, args.action, path)
        # loading a fresh optimizer's state takes a zero-lr step: not the next cell's training
        self.optimizer_steps = cluster.optimizer_steps()
        print(f"{'saving' if args.background else 'saved' if args.action == 'save' else 'loaded'}"
              f" {', '.join(names)} {'to' if args.action == 'save' else 'from'} {path} on "
              f"{cluster.world_size} ranks")

    def _stacks(self, args: Any) -> None:
        cluster = self._need_cluster()
        try:
            ranks = parse_ranks(args.ranks, cluster.world_size)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(stacks_text(cluster.stacks(ranks), cluster.collectives(ranks), ranks))

    def _debug(self, args: Any) -> None:
        try:
            report = self._need_cluster().postmortem(args.rank)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(postmortem_text(args.rank, report))

    def _status(self, args: Any) -> Any:
        return self._need_cluster().status()

    def _init(self, args: Any) -> None:
        cluster = self._need_cluster()
        if args.axes:
            try:
                spec = cluster.init_mesh(" ".join(args.axes))
            except ValueError as e:
                raise UsageError(str(e)) from None
            self._journal().record_mesh(spec, self.shell.execution_count)
        if cluster.mesh_spec is None:
            raise UsageError("no mesh yet: %mesh init dp=2 tp=2 (axes multiply to the world size)")
        display(group_table(cluster.mesh_spec), MeshView(cluster.mesh_spec))

    def _inspect(self, args: Any) -> ShardingView:
        try:
            report = self._need_cluster().inspect(" ".join(args.expr), args.ranks)
        except ValueError as e:
            raise UsageError(str(e)) from None
        return ShardingView(report)

    def _memory(self, args: Any) -> None:
        cluster = self._need_cluster()
        try:
            reports, params, activations = cluster.memory(args.model, args.optimizer,
                                                          args.inputs)
        except ClusterError as e:
            raise UsageError(f"cannot measure {args.model!r}:\n{e}") from None
        spec = cluster.mesh_spec
        dp = args.dp or (spec.dp_replicate * spec.dp_shard if spec else cluster.world_size)
        frame = memory_frame(reports, params=params, dp=dp, stage=args.stage,
                             activations=activations)
        display(frame, memory_chart(frame))

    def _push(self, args: Any) -> None:
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        values = {n: self.shell.user_ns[n] for n in args.names}
        self._need_cluster().push(values, args.ranks)
        ranks = parse_ranks(args.ranks, self._need_cluster().world_size) if args.ranks else None
        self._journal().record_push(values, self.shell.execution_count, ranks)

    def _pull(self, args: Any) -> dict[int, Any]:
        try:
            return self._need_cluster().pull(args.name, args.ranks)
        except KeyError as e:
            raise UsageError(e.args[0]) from None
        except ValueError as e:
            raise UsageError(str(e)) from None

    def _auto(self, args: Any) -> None:
        if args.state == "on":
            self._need_cluster()
        self.auto = args.state == "on"
        transformers = self.shell.input_transformers_cleanup
        if self.auto and _auto_transform not in transformers:
            transformers.append(_auto_transform)
        elif not self.auto and _auto_transform in transformers:
            transformers.remove(_auto_transform)
        print("every cell now runs on the ranks; %mesh auto off returns to the notebook"
              if self.auto else "cells run in the notebook again")

    def _schedule(self, args: Any) -> None:
        try:
            costs = Costs.parse(args.costs, comm=args.comm)
            schedules = [resolve(n, ranks=args.stages, microbatches=args.microbatches,
                                 virtual=args.virtual, namespace=self.shell.user_ns)
                         for n in args.names.split(",")]
            timelines, table = compare(schedules, costs)
        except ValueError as e:  # ScheduleError too: its message holds the grid
            raise UsageError(str(e)) from None
        if args.output:
            self.shell.user_ns[args.output] = schedules[0]
        display(table, timeline_chart(plan_frame(timelines)))

    def _pipeline(self, args: Any) -> None:
        cluster = self._need_cluster()
        spec = cluster.mesh_spec
        if spec is None or spec.pp < 2:
            raise UsageError("the mesh has no pp axis: %mesh init pp=N (times the other axes)")
        try:
            schedule = resolve(args.schedule, ranks=spec.pp, microbatches=args.microbatches,
                               virtual=args.virtual, namespace=self.shell.user_ns)
            self.pipeline = SteppedPipeline(cluster, schedule, model=args.model,
                                            batch=args.batch, loss=args.loss)
        except ValueError as e:
            raise UsageError(str(e)) from None
        self._journal().record_pipeline(args.model, schedule, self.shell.execution_count,
                                        batch=args.batch, loss=args.loss, line=self.line)
        print(f"{schedule.name} bound to {args.model}: {schedule.stages} stages on "
              f"{schedule.ranks} pp ranks, {schedule.microbatches} micro-batches; "
              "%mesh step N runs the next N slots")
        display(timeline_chart(self.pipeline.frame()))

    def _step(self, args: Any) -> None:
        if self.pipeline is None:
            raise UsageError("no pipeline is bound: %mesh pipeline MODEL --schedule NAME")
        try:
            ran = self.pipeline.step(None if args.all else args.n)
        except ScheduleError as e:
            raise UsageError(str(e)) from None
        self._journal().record_step(self.shell.execution_count, line=self.line)
        by_rank: dict[int, list[str]] = {}
        for r in ran:
            if r["kind"] in ("F", "B", "I", "W"):
                by_rank.setdefault(r["rank"], []).append(r["action"])
        for rank in sorted(by_rank):
            print(f"[pp rank {rank}] ran {' '.join(by_rank[rank])}")
        if self.pipeline.done:
            print(f"step complete: loss {self.pipeline.loss:.6f}")
        display(timeline_chart(self.pipeline.frame()))

    def _bench(self, args: Any) -> None:
        try:
            sizes = [int(n) for n in args.sizes.split(",")]
        except ValueError:
            raise UsageError(f"--sizes {args.sizes!r}: give row lengths like 256,1024") from None
        # IPython's argument splitter keeps quotes: --ref 'lambda x: x * 2' is an expression
        ref = args.ref.strip("'\"") if args.ref else None
        frame = run_bench(self._need_cluster(), args.kernel, ref=ref, sizes=sizes,
                          dtype=args.dtype, mode=args.mode, rows=args.rows, ranks=args.ranks)
        failed = frame[frame["error"].notna()]
        for _, row in failed.iterrows():
            print(f"[rank {row['rank']}] {row['provider']} at size {row['size']}: "
                  f"{row['error']}")
        if args.output:
            self.shell.user_ns[args.output] = frame
        # columns the same on every row go in one caption line; empty ones (peak_pct on CPU) go
        same = [c for c in ("kernel", "mode", "dtype", "device") if frame[c].nunique() == 1]
        print(" · ".join(str(frame[c].iloc[0]) for c in same)
              + ("  (interpreter rows: Triton's CPU interpreter, not kernel speed)"
                 if (frame["timer"] == "interpreter").any() else ""))
        table = frame.drop(columns=same).dropna(axis=1, how="all")
        display(table.set_index(["rank", "provider", "size"]))
        if frame["median_ms"].notna().any():
            display(bench_chart(frame))

    def _calibrate(self, args: Any) -> None:
        try:  # a bad line first: its error is the one to fix
            sizes = parse_sizes(args.sizes) if args.sizes else None
            report = calibrate_profile(self._need_cluster(), args.path, name=args.name,
                                       sizes=sizes, quick=args.quick)
        except ValueError as e:
            raise UsageError(str(e)) from None
        c = report.calibration
        print(f"calibrated {c.world_size} ranks ({c.device_name}, {c.timer}) in "
              f"{c.seconds:.1f} s, mesh {c.mesh or '(none)'}")
        for note in c.notes:
            print(f"note: {note}")
        collectives = report.collectives.set_index(["axis", "collective"])
        if not collectives["note"].any():
            collectives = collectives.drop(columns="note")
        display(report.matmul.set_index(["dtype", "m", "n", "k"]), collectives)
        print(f"wrote {report.path}: {report.describe()}")
        print(f"use it: %mesh plan MODEL --hardware {args.path}")

    def _plan(self, args: Any) -> None:
        gpus = args.gpus or (self.cluster.world_size if self.cluster and self.cluster.running
                             else None)
        if gpus is None:
            raise UsageError("how many GPUs? pass --gpus N (or start a cluster to plan for it)")
        try:
            model = self.shell.user_ns.get(args.model, args.model)
            result = planning.plan(model, gpus=gpus, hardware_profile=args.hardware,
                                   layout=_unquote(args.layout),
                                   constraints=_unquote(args.where),
                                   global_batch=args.batch, precision=args.precision,
                                   top=args.top, tokens=args.tokens)
        except ValueError as e:
            raise UsageError(str(e)) from None
        print(result.text())
        display(result.table(), plan_memory_chart(result.memory_frame()),
                plan_comm_chart(result.comm_frame()))
        if args.output:
            self.shell.user_ns[args.output] = result

    def _export(self, args: Any) -> None:
        try:
            written = export(self._journal(), args.path, sbatch=args.sbatch, nodes=args.nodes,
                             gpus_per_node=args.gpus_per_node, cells=args.cells)
        except ExportError as e:
            raise UsageError(str(e)) from None
        print(f"wrote {', '.join(map(str, written))}; run it with: bash {written[1]}")

    def _run_cell(self, line: str, cell: str) -> None:
        args = parse_argstring(_cell, line)
        cluster = self._need_cluster()
        live = LiveOutput()
        try:
            result = cluster.run(cell, args.ranks, args.timeout, on_output=live.update,
                                 keep_values=bool(args.output), comms=args.comms)
        except ValueError as e:  # a bad --ranks set
            raise UsageError(str(e)) from None
        except MeshError as e:
            live.finish(e.result)
            if args.output:
                self.shell.user_ns[args.output] = e.result.values
            raise
        live.finish(result)
        steps, self.optimizer_steps = self.optimizer_steps, cluster.optimizer_steps(result.ranks)
        self._journal().record_cell(cell, self.shell.execution_count, result.ranks,
                                    trained=self.optimizer_steps > steps)
        if args.output:
            self.shell.user_ns[args.output] = result.values
        if args.comms:
            frame = comms_frame(result.comms, cluster.mesh_spec, cluster.world_size)
            display(frame.set_index(["rank", "op", "axis"]), comms_totals(frame),
                    comms_chart(frame))

    def _journal(self) -> Journal:
        """The session's journal (begun on first use when the cluster came from elsewhere)."""
        if self.journal is None:
            cluster = self._need_cluster()
            self.journal = Journal(cluster.world_size, cluster.backend)
        return self.journal

    def _need_cluster(self) -> Cluster:
        if self.cluster is None or not self.cluster.running:
            raise UsageError("no cluster is running: %mesh start N")
        return self.cluster


def _auto_transform(lines: list[str]) -> list[str]:
    """With `%mesh auto on`, a cell becomes a %%mesh cell unless it is a %mesh line itself."""
    if not lines or lines[0].lstrip().startswith(("%mesh", "%%mesh")) or not "".join(
            lines).strip():
        return lines
    return ["%%mesh\n", *lines]


def _show_error(shell: Any, etype: type, value: BaseException, tb: Any,
                tb_offset: int | None = None) -> list[str]:
    """Show a failed cell as a summary by rank plus one traceback, not meshlab's own frames."""
    if isinstance(value, MeshError):
        stb = summary_lines(value.result)
    else:
        stb = [f"\x1b[31m{etype.__name__}\x1b[0m: {strip_ansi(str(value))}"]
    shell._showtraceback(etype, value, stb)  # IPython discards what a custom handler returns
    return stb


def rank_matcher(magics: MeshMagics) -> Any:
    """Tab completion inside %%mesh cells, from rank 0's namespace."""

    @context_matcher()
    def match(context: CompletionContext) -> SimpleMatcherResult:
        text = context.full_text.lstrip()
        in_mesh_cell = text.startswith("%%mesh") or (magics.auto and not text.startswith("%"))
        completions: list[SimpleCompletion] = []
        if in_mesh_cell and context.token and magics.cluster and magics.cluster.running:
            completions = [SimpleCompletion(c, type="rank 0")
                           for c in magics.cluster.complete(context.token)]
        return {"completions": completions, "suppress": False}

    return match


__all__ = ["SUBCOMMANDS", "ClusterError", "MeshMagics", "cell_arguments", "rank_matcher"]
