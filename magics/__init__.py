"""The ``%mesh`` / ``%%mesh`` magics: parse a line, make one Session call, display."""

from __future__ import annotations

import ast
from typing import Any

from IPython.core.completer import (
    CompletionContext,
    SimpleCompletion,
    SimpleMatcherResult,
    context_matcher,
)
from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import display

from meshlab.mesh import crossing_hosts
from meshlab.notebook import commands
from meshlab.notebook.calibrate import calibration_tables
from meshlab.notebook.cluster import ClusterError
from meshlab.notebook.debug_prompt import Prompt
from meshlab.notebook.memory_snapshots import ran_out, where_saved
from meshlab.notebook.output import LiveOutput, MeshError, strip_ansi, summary_lines
from meshlab.notebook.session import Session
from meshlab.notebook.tables.comms import comms_frame, comms_tables
from meshlab.notebook.tables.dryrun import dryrun_views, verified_table
from meshlab.notebook.tables.layout_diff import layout_diff_views
from meshlab.notebook.tables.losses import losses_views
from meshlab.notebook.tables.memory import memory_table
from meshlab.notebook.tables.plan import plan_summary, plan_table
from meshlab.notebook.tables.schedule import schedule_table
from meshlab.notebook.tables.status import status_table
from meshlab.notebook.tables.table import Table
from meshlab.notebook.widgets import MeshView, ShardingView, group_table, sharding_views


@magics_class
class MeshMagics(Magics):
    """``%mesh SUBCOMMAND`` and ``%%mesh``; holds the notebook's Session."""

    shell: Any  # the InteractiveShell these magics are registered on

    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session = Session()
        self.session.cell_number = self._cell_number
        self.auto = False

    def _cell_number(self) -> int:
        """The In [n] of the running cell. Recent IPython (9.18) counts a cell up before it
        runs, so execution_count reads n + 1 in it; 8.x counts after. Both have stored its
        input as history entry n by then."""
        return len(self.shell.history_manager.input_hist_raw) - 1

    @line_cell_magic
    def mesh(self, line: str, cell: str | None = None) -> Any:
        sub, _, rest = line.strip().partition(" ")
        try:
            if cell is not None:
                return self._cell(commands.parse_cell(line), cell)
            args = commands.parse(sub, rest)  # an unknown subcommand: ValueError naming them
            return getattr(self, f"_{sub}")(args)
        except ValueError as e:  # a request the session refused: its message names the fix
            raise UsageError(str(e)) from None
        except KeyboardInterrupt:  # Ctrl-C while waiting on the ranks: one line, not 10 KB
            raise UsageError(f"%mesh {sub} interrupted. " + commands.INTERRUPTED.get(
                sub, "The ranks may still be finishing it; `%mesh status` shows them, "
                "`%mesh restart` replaces them")) from None

    mesh.__doc__ = commands.help_text()

    # -- subcommands: parse (above), one Session call, display --------------------------------

    def _start(self, args: Any) -> None:
        print(self.session.start(args.n, profile=args.profile, backend=args.backend,
                                 debug=args.debug or None))

    def _stop(self, args: Any) -> None:
        print(self.session.stop())
        self._auto_off()  # nothing left to run on

    def _restart(self, args: Any) -> None:
        self.session.restart(upto=args.upto, from_checkpoint=args.from_checkpoint)

    def _checkpoint(self, args: Any) -> None:
        print(self.session.checkpoint(args.action, args.path, args.names,
                                      background=args.background, trusted=args.trusted,
                                      group_readable=args.group_readable))

    def _stacks(self, args: Any) -> None:
        print(self.session.stacks(args.ranks, native=args.native))

    def _debug(self, args: Any) -> None:
        if not args.target.isdigit():  # list, attach, cast: the prompt's own commands
            raise UsageError(f"`%mesh debug {args.target}` is typed at the debugger's prompt, "
                             "while a rank is stopped at breakpoint() in a %%mesh cell; no "
                             "cell is running now. `%mesh debug RANK [--live]` examines a "
                             "rank's last failed cell")
        print(self.session.postmortem(int(args.target), live=args.live))

    def _status(self, args: Any) -> Table:
        return status_table(self.session.status())  # Session.status(): the frame

    def _prove(self, args: Any) -> None:
        print(self.session.prove(args.model, args.plan, args.factory))

    def _compare(self, args: Any) -> None:
        diff = self.session.compare(args.model, args.plan, steps=args.steps, dtype=args.dtype,
                                    itself=args.itself, beside=args.beside,
                                    beside_mesh=args.beside_mesh, vocab=args.vocab)
        display(*layout_diff_views(diff))
        if args.output:
            self.shell.user_ns[args.output] = diff

    def _losses(self, args: Any) -> None:
        comparison = self.session.compare_losses(args.runs, tolerance=args.tolerance)
        display(*losses_views(comparison))
        if args.output:
            self.shell.user_ns[args.output] = comparison

    def _throttle(self, args: Any) -> None:
        print(self.session.throttle(None if args.ranks == "off" else args.ranks, args.factor))

    def _init(self, args: Any) -> None:
        spec = self.session.init(" ".join(args.axes))
        cluster = self.session.cluster  # where the ranks are, for the table and notes
        hosts = cluster.host_of if cluster is not None else []
        display(group_table(spec, hosts), MeshView(spec))
        for note in crossing_hosts(spec, hosts):
            print(note)

    def _inspect(self, args: Any) -> ShardingView:
        *notes, view = sharding_views(self.session.inspect(" ".join(args.expr), args.ranks))
        display(*notes)
        return view

    def _memory(self, args: Any) -> None:
        frame = self.session.memory(args.model, args.optimizer, stage=args.stage, dp=args.dp,
                                    inputs=args.inputs)
        display(memory_table(frame), charts().memory_chart(frame))

    def _variable(self, option: str, name: str) -> Any:
        """The notebook variable an option names, or UsageError saying it is not there."""
        if name not in self.shell.user_ns:
            raise UsageError(f"--{option} {name}: not defined in the notebook: define {name} "
                             "first, or leave the option out")
        return self.shell.user_ns[name]

    def _push(self, args: Any) -> None:
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        self.session.push({n: self.shell.user_ns[n] for n in args.names}, args.ranks)

    def _pull(self, args: Any) -> dict[int, Any]:
        return self.session.pull(args.name, args.ranks,
                                 shown_as=shown_as(self.shell, args.name))

    def _auto(self, args: Any) -> None:
        if args.state == "on":
            self.session.need_cluster()
            self.auto = True
            if _auto_transform not in self.shell.input_transformers_cleanup:
                self.shell.input_transformers_cleanup.append(_auto_transform)
        else:
            self._auto_off()
        print("every cell now runs on the ranks; %mesh auto off returns to the notebook"
              if self.auto else "cells run in the notebook again")

    def _schedule(self, args: Any) -> None:
        schedules, table, frame = self.session.schedule(
            args.names.split(","), stages=args.stages, microbatches=args.microbatches,
            virtual=args.virtual, costs=args.costs, comm=args.comm,
            namespace=self.shell.user_ns)
        if args.output:
            self.shell.user_ns[args.output] = schedules[0]
        display(schedule_table(table), charts().timeline_chart(frame))

    def _pipeline(self, args: Any) -> None:
        pipeline = self.session.pipeline(args.model, args.schedule,
                                          microbatches=args.microbatches, virtual=args.virtual,
                                          batch=args.batch, loss=args.loss,
                                          namespace=self.shell.user_ns)
        s = pipeline.schedule
        print(f"{s.name} bound to {args.model}: {s.stages} stages on {s.ranks} pp ranks, "
              f"{s.microbatches} micro-batches; %mesh step N runs the next N slots")
        display(charts().timeline_chart(pipeline.frame()))

    def _step(self, args: Any) -> None:
        ran = self.session.step(None if args.all else args.n, profile=args.profile,
                                profile_dir=args.profile_dir)
        by_rank: dict[int, list[str]] = {}
        for r in ran:
            if r["kind"] in ("F", "B", "I", "W"):
                by_rank.setdefault(r["rank"], []).append(r["action"])
        for rank in sorted(by_rank):
            print(f"[pp rank {rank}] ran {' '.join(by_rank[rank])}")
        pipeline = self.session.bound_pipeline
        assert pipeline is not None  # step() refuses without one
        if pipeline.done:
            print(f"step complete: loss {pipeline.loss:.6f}")
        display(charts().timeline_chart(pipeline.frame()))
        if (args.profile or args.profile_dir) and pipeline.profile is not None:
            if pipeline.profile.saved is not None and args.profile_dir:
                print(f"wrote {pipeline.profile.saved} (Perfetto, chrome://tracing)")
            display(*profile_views(pipeline.profile))
            if pipeline.whole_step_profiled:
                display(pipeline.bubble_view())

    def _bench(self, args: Any) -> None:
        try:
            sizes = [int(n) for n in args.sizes.split(",")]
        except ValueError:
            raise UsageError(f"--sizes {args.sizes!r}: give row lengths like 256,1024") from None
        frame = self.session.bench(args.kernel, ref=commands.unquote(args.ref), sizes=sizes,
                                   dtype=args.dtype, mode=args.mode, rows=args.rows,
                                   ranks=args.ranks)
        for _, row in frame[frame["error"].notna()].iterrows():
            print(f"[rank {row['rank']}] {row['provider']} at size {row['size']}: "
                  f"{row['error']}")
        if args.output:
            self.shell.user_ns[args.output] = frame
        display(*bench_views(frame))  # one compact table, and a chart if anything was timed

    def _calibrate(self, args: Any) -> None:
        from meshlab.calibrate import parse_sizes

        report = self.session.calibrate(args.path, name=args.name, quick=args.quick,
                                        sizes=parse_sizes(args.sizes) if args.sizes else None)
        c = report.calibration
        print(f"calibrated {c.world_size} ranks ({c.device_name}, {c.timer}) in "
              f"{c.seconds:.1f} s, mesh {c.mesh or '(none)'}")
        for note in c.notes:
            print(f"note: {note}")
        display(*calibration_tables(report))
        print(f"wrote {report.path}: {report.describe()}")
        print(f"use it: %mesh plan MODEL --hardware {args.path}")

    def _plan(self, args: Any) -> None:
        result = self.session.plan(
            self.shell.user_ns.get(args.model, args.model), gpus=args.gpus, seq=args.seq,
            hardware_profile=args.hardware, layout=commands.unquote(args.layout),
            constraints=commands.unquote(args.where), global_batch=args.batch,
            precision=args.precision or ("fp32" if args.measure else "bf16"), top=args.top,
            tokens=args.tokens, verify=args.verify or 0, implementation=args.implementation,
            measure=commands.unquote(args.measure), steps=args.steps)
        if isinstance(result, Table):  # --measure: the planner's terms beside the step's
            display(result)
        else:
            display(plan_summary(result), plan_table(result),
                    charts().plan_memory_chart(result.memory_frame()),
                    charts().plan_comm_chart(result.comm_frame()))
            if result.verified:
                display(verified_table(result))
        if args.output:
            self.shell.user_ns[args.output] = result

    def _dryrun(self, args: Any) -> None:
        named = {option: self._variable(option, name)
                 for option, name in (("plan", args.plan), ("init", args.init)) if name}
        dry = self.session.dryrun(
            self.shell.user_ns.get(args.model, args.model), commands.unquote(args.layout) or "",
            hardware=args.hardware, ranks=args.ranks, batch=args.batch, seq=args.seq,
            kernels=args.kernels, **named)
        display(*dryrun_views(dry, args.hardware))
        if args.output:
            self.shell.user_ns[args.output] = dry

    def _export(self, args: Any) -> None:
        written = self.session.export(args.path, sbatch=args.sbatch, ray=args.ray,
                                      nodes=args.nodes,
                                      gpus_per_node=args.gpus_per_node, cells=args.cells)
        print(f"wrote {', '.join(map(str, written))}; run it with: bash {written[1]}",
              *written.notes, sep="\n")

    def _cell(self, args: Any, cell: str) -> None:
        live, prompt = LiveOutput(), Prompt()
        try:
            result = self.session.run(cell, args.ranks, args.timeout, on_output=live.update,
                                      keep_values=bool(args.output), comms=args.comms,
                                      profile=args.profile, profile_dir=args.profile_dir,
                                      max_lines=args.max_lines, on_breakpoint=prompt,
                                      memory=args.memory, memory_dir=args.memory_dir,
                                      on_oom=args.on_oom or None, on_progress=live.progress)
        except MeshError as e:
            live.finish(e.result, prompt.transcript)
            if e.result.memory and (args.memory or args.memory_dir or ran_out(e.result)):
                display(charts().memory_timeline_chart(e.result.memory, ran_out(e.result)))
            if args.output:
                self.shell.user_ns[args.output] = e.result.values
            if e.result.profile is not None:
                display(*profile_views(e.result.profile))
            raise
        live.finish(result, prompt.transcript)
        if args.output:
            self.shell.user_ns[args.output] = result.values
        if args.comms and (cluster := self.session.cluster) is not None:
            frame = comms_frame(result.comms, cluster.mesh_spec, cluster.world_size)
            display(*comms_tables(frame), charts().comms_chart(frame))
        if result.profile is not None:
            display(*profile_views(result.profile))
        if result.memory:
            if args.memory_dir:
                print(where_saved(sorted(result.memory), args.memory_dir))
            display(charts().memory_timeline_chart(result.memory))

    def _auto_off(self) -> None:
        self.auto = False
        if _auto_transform in self.shell.input_transformers_cleanup:
            self.shell.input_transformers_cleanup.remove(_auto_transform)


def charts() -> Any:
    """meshlab.notebook.charts, imported when a chart is first drawn: altair and its schema
    take a second or more that `%load_ext meshlab` need not spend (issue 61)."""
    import meshlab.notebook.charts

    return meshlab.notebook.charts


def profile_views(profile: Any) -> list[Any]:
    from meshlab.notebook.tables.profile import profile_views as views  # charts: see charts()

    return list(views(profile))


def bench_views(frame: Any) -> list[Any]:
    from meshlab.notebook.bench import bench_views as views  # charts: see charts()

    return list(views(frame))


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
        stb = summary_lines(value.result) + list(getattr(value, "__notes__", []))
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
        cluster = magics.session.cluster
        if in_mesh_cell and context.token and cluster is not None and cluster.running:
            completions = [SimpleCompletion(c, type="rank 0")
                           for c in cluster.complete(context.token)]
        return {"completions": completions, "suppress": False}

    return match


__all__ = ["ClusterError", "MeshMagics", "rank_matcher"]


def shown_as(shell: Any, name: str) -> int | None:
    """The Out[n] IPython will show and keep ``%mesh pull NAME`` as, when the running cell
    ends with it (or shows every expression); None when its value is assigned or not shown."""
    result = getattr(shell.displayhook, "exec_result", None)
    info = getattr(result, "info", None)
    if info is None or info.silent:
        return None
    try:
        body = ast.parse(shell.transform_cell(info.raw_cell)).body
    except SyntaxError:
        return None
    shown = {"all": body, "none": []}.get(shell.ast_node_interactivity, body[-1:])
    for node in shown:
        call = node.value if isinstance(node, ast.Expr) else None
        # %mesh LINE is get_ipython().run_line_magic('mesh', LINE) once IPython transformed it
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "run_line_magic"):
            continue
        args = [a.value for a in call.args if isinstance(a, ast.Constant)]
        if len(args) == 2 and args[0] == "mesh" and str(args[1]).split()[:2] == ["pull", name]:
            return int(shell.displayhook.prompt_count)
    return None
