"""The ``%mesh`` command line: each subcommand's arguments, declared once.

The magics parse with these and call the Session; ``meshlab export`` reads saved notebooks
with them; ``%mesh?`` is assembled from their docstrings. Options several subcommands share
(``--ranks``, ``-o NAME``, the schedule's size) are decorators declared here once.
"""

from __future__ import annotations

from typing import Any

from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from meshlab.notebook.command_options import (
    Parser,
    amount,
    count,
    output_option,
    ranks_option,
    schedule_options,
)
from meshlab.notebook.commands_planning import bench, calibrate, dryrun, plan
from meshlab.schedules import BUILDERS


@magic_arguments()
@argument("n", nargs="?", type=int, help="number of ranks (default: one per GPU, else 4)")
@argument("--profile", default="local", help="a profile in clusters/ or a path to a .toml file")
@argument("--backend", choices=["auto", "gloo", "nccl"], help="override the profile's backend")
@argument("--debug", action="store_true",
          help="TORCH_DISTRIBUTED_DEBUG=DETAIL: mismatched collectives raise at once")
def start(line: str) -> None:
    """%mesh start [N]: start N ranks and a torch.distributed process group across them."""


@magic_arguments()
def stop(line: str) -> None:
    """%mesh stop: stop every rank."""


@magic_arguments()
@argument("--from-checkpoint", metavar="DIR", help="load this checkpoint (saved in this "
          "session) and replay only the cells after it, plus the setup they need")
@argument("--upto", type=count, metavar="N", help="replay up to In [N] only (default: everything, "
          "or up to the last cell marked `# meshlab: restore-point`)")
def restart(line: str) -> None:
    """%mesh restart: fresh engines of the same size and profile, the mesh and the session's
    successful %%mesh cells replayed."""


@magic_arguments()
@argument("action", choices=["save", "load"])
@argument("path", help="a folder; each rank writes its own shards there")
@argument("names", nargs="*", help="objects on the ranks (default: those of model, optimizer, "
          "step defined; on load, every name the checkpoint holds)")
@argument("--async", dest="background", action="store_true",
          help="save in the background (torch.distributed.checkpoint.async_save); a failure "
          "is raised by the next checkpoint command")
@argument("--group-readable", action="store_true", help="save it readable by your group "
          "(0750 folder, 0640 files); by default only you can read it (0700, 0600)")
@argument("--trust", dest="trusted", action="store_true",
          help="load a checkpoint another account could have written: its pickled metadata "
          "runs code as you (without it such a checkpoint is refused)")
def checkpoint(line: str) -> None:
    """%mesh checkpoint save|load DIR [NAME...]: sharded torch.distributed.checkpoint of named
    objects on every rank; loads into another mesh shape or world size."""


@magic_arguments()
@ranks_option
@argument("--native", action="store_true",
          help="py-spy's stacks instead, C and C++ frames (gloo's, NCCL's) among the Python "
          "ones (needs py-spy where the ranks run: pip install 'meshlab[debug]')")
def stacks(line: str) -> None:
    """%mesh stacks: every rank's current Python stack (identical ones once) and its last
    collectives; answers while a cell runs or hangs."""


@magic_arguments()
@argument("target", help="the rank whose last failed cell to examine; at the debugger's prompt "
          "also list, attach N or cast RANKS CMD")
@argument("rest", nargs="*", help="at the prompt: attach's rank; cast's ranks and pdb command")
@argument("--live", action="store_true",
          help="pdb at the failing frame, at a prompt in the notebook (as breakpoint() in a "
          "cell gives one)")
def debug(line: str) -> None:
    """%mesh debug RANK [--live]: post-mortem of the last failed cell on RANK (traceback, the
    failing frame's variables; --live: pdb there). A cell's breakpoint() stops its rank at a
    pdb prompt, where %mesh debug list, attach N and cast RANKS CMD steer the ranks."""


@magic_arguments()
def status(line: str) -> None:
    """%mesh status: a table of ranks (host, pid, device, alive, busy, memory, throttle)."""


@magic_arguments()
@argument("ranks", help="the ranks to slow, e.g. 2 or 0,2-3; or `off`: every rank at full speed")
@argument("--factor", type=amount, default=2.0,
          help="how many times slower they compute (default 2; 1: full speed)")
def throttle(line: str) -> None:
    """%mesh throttle RANKS --factor F: a straggler you can make: every op on RANKS takes F
    times as long (collectives are not slowed), until `%mesh throttle off`; `%%mesh --profile`
    shows the others waiting for it. A restart replays it; an export leaves it out."""


@magic_arguments()
@argument("model", help="a model on the ranks (a name or expression without spaces)")
@argument("plan", help="a ParallelPlan on the ranks (a name or expression without spaces)")
@argument("--factory", help="for a model written by hand: a function on the ranks taking a "
          "meshlab.verify.tiny.TinySize and returning the model at that size")
def prove(line: str) -> None:
    """%mesh prove MODEL PLAN: before the real model trains, train PLAN for two steps on a
    tiny copy of MODEL (the same class, shrunk: fewer layers, a narrower width, fewer
    experts, its sliding windows and attention chunks scaled to still act) on the current
    mesh beside one process, and say it was proved equal, or what differs."""


@magic_arguments()
@argument("model", help="a ModelConfig or a model factory on the ranks (a name or expression "
          "without spaces)")
@argument("plan", help="a ParallelPlan on the ranks (a name or expression without spaces)")
@argument("--steps", type=count, default=2, help="training steps (default 2)")
@argument("--dtype", choices=["float64", "float32"], default="float64",
          help="both runs' dtype (default float64: the tightest tolerance, 1e-10)")
@argument("--itself", action="store_true",
          help="run PLAN twice instead: bit-identical, or the first tensor that is not")
@argument("--beside", metavar="PLAN2", help="another ParallelPlan on the ranks: set the two "
          "layouts beside each other instead of one process")
@argument("--beside-mesh", metavar="AXES", help="PLAN2's mesh, e.g. dp=2,tp=2 (default the "
          "current mesh)")
@argument("--vocab", type=count, metavar="N", help="the token ids' range, where MODEL's "
          "config does not say it (default: its config's, or its one nn.Embedding's)")
@output_option("the LayoutDiff")
def compare(line: str) -> None:
    """%mesh compare MODEL PLAN: train PLAN on the current mesh beside one process (or beside
    itself, or beside another layout), module by module, and name the first step, phase
    (forward, output gradient, parameter gradient, update), module and rank where they differ
    beyond the dtype's tolerance."""


@magic_arguments()
@argument("runs", nargs="+", metavar="RUN", help="files LossLog or save_losses wrote (two or "
          "more)")
@argument("--tolerance", type=float, default=0.0,
          help="relative difference a step may have from the first run's (default 0: equal)")
@output_option("the LossComparison")
def losses(line: str) -> None:
    """%mesh losses RUN RUN...: runs' losses side by side (meshlab.verify.loss_curves), each
    named with its layout and code version, the first step where one differs from the first
    run's beyond the tolerance, and their curves. Needs no cluster."""


@magic_arguments()
@argument("expr", nargs="+", help="a DTensor, tensor or nn.Module (any expression) on the ranks")
@ranks_option
def inspect(line: str) -> None:
    """%mesh inspect EXPR: a widget showing which rank holds which block of EXPR. Only the
    ranks of one DTensor that hold the same piece share a block ("replicated"); ranks holding
    different tensors under EXPR (pipeline stages, expert slices, plain tensors) are drawn
    apart, each captioned with its ranks, mesh coordinates and name in the model."""


@magic_arguments()
@argument("model", help="a module on the ranks (a name or expression without spaces)")
@argument("optimizer", nargs="?", help="its optimizer on the ranks")
@argument("--stage", type=int, choices=[0, 1, 2, 3],
          help="also show the ZeRO paper's per-device formula for this stage")
@argument("--dp", type=count, help="data-parallel degree for the formula (default: the mesh's)")
@argument("--inputs", help="a batch on the ranks: also measure the activations one forward "
          "saves for backward")
def memory(line: str) -> None:
    """%mesh memory MODEL [OPTIMIZER]: bytes of params, grads, optimizer states per rank, on
    the device and offloaded to host memory."""


@magic_arguments()
@argument("names", nargs="+", help="notebook variables to copy to every rank")
@ranks_option
def push(line: str) -> None:
    """%mesh push NAME...: copy notebook variables to the ranks."""


@magic_arguments()
@argument("name", help="a variable defined on the ranks")
@ranks_option
def pull(line: str) -> None:
    """%mesh pull NAME: {rank: value} of a variable on the ranks."""


@magic_arguments()
@argument("axes", nargs="*", metavar="AXIS=SIZE",
          help="pp, dp_replicate, dp_shard (or dp), cp, tp, ep; e.g. dp=2 tp=2")
def init(line: str) -> None:
    """%mesh init dp=2 tp=2: a named DeviceMesh `mesh` on every rank (no axes: show it)."""


@magic_arguments()
@argument("state", choices=["on", "off"])
def auto(line: str) -> None:
    """%mesh auto on|off: run every following cell on the ranks, without the %%mesh line."""


@magic_arguments()
@argument("names", metavar="NAME", help="a builder (" + ", ".join(BUILDERS) + ") or a notebook "
          "variable holding a Schedule, a text table or rows; several, comma-separated, "
          "to compare")
@argument("--stages", type=int, default=4, help="pipeline ranks p (default 4)")
@schedule_options(microbatches=8)
@argument("--costs", default="1,2", help="F,B or F,I,W times (default 1,2)")
@argument("--comm", type=float, default=0.0, help="time of one hop between ranks")
@output_option("the (first) Schedule")
def schedule(line: str) -> None:
    """%mesh schedule: build, validate, simulate and chart pipeline schedules."""


@magic_arguments()
@argument("model", help="a meshlab Transformer on the ranks, split into the schedule's stages")
@argument("--schedule", required=True, help="a builder name or a notebook Schedule variable")
@schedule_options(microbatches=4)
@argument("--batch", default="batch", help="(inputs, targets) on the ranks (default: batch)")
@argument("--loss", help="loss function on the ranks (default: next-token cross-entropy)")
def pipeline(line: str) -> None:
    """%mesh pipeline: bind a schedule to a model over the pp axis; `pipeline` on the ranks."""


@magic_arguments()
@argument("n", nargs="?", type=count, default=1, help="slots of the schedule to run (default 1)")
@argument("--all", action="store_true", help="run the rest of the step")
@argument("--profile", action="store_true",
          help="one timeline of every rank, each pipeline action a named span; a whole "
          "step profiled at once (--all right after binding) is also set beside the "
          "simulator's bubble and exposed communication")
@argument("--profile-dir", metavar="DIR",
          help="with --profile (implied): also write every rank's trace as one Chrome/"
          "Perfetto file, DIR/step-N.json (N: the cell's number)")
def step(line: str) -> None:
    """%mesh step: run the next N slots of the bound pipeline on every rank, and chart it."""


@magic_arguments()
@argument("path", help="the script to write, e.g. train.py; launch.sh goes beside it")
@argument("--sbatch", action="store_true", help="also write job.sbatch for Slurm")
@argument("--ray", action="store_true", help="also write ray_job.py for a Ray cluster")
@argument("--nodes", type=count, default=1, help="nodes to run on (default 1)")
@argument("--gpus-per-node", type=count, help="processes per node, one per GPU (default: the "
          "session's ranks on one node, on its device kind)")
@argument("--cells", help="In [n] numbers to take, e.g. 3-7,9 or 12- (default: all)")
def export(line: str) -> None:
    """%mesh export: the session's successful %%mesh cells as a torchrun script."""


@magic_arguments()
@ranks_option
@argument("--timeout", type=amount, help="time limit in seconds; stuck ranks show their stacks")
@output_option("{rank: value of the last expression}")
@argument("--comms", action="store_true",
          help="trace the collectives each rank issued: counts, bytes, mesh axis")
@argument("--profile", action="store_true",
          help="one timeline of every rank's compute and communication (torch.profiler), "
          "time per rank hidden/exposed/idle, who waited for whom")
@argument("--profile-dir", metavar="DIR",
          help="with --profile (implied): also write every rank's trace as one Chrome/"
          "Perfetto file, DIR/cell-N.json")
@argument("--max-lines", type=count, metavar="N",
          help="keep at most N lines of each rank's stdout and stderr (default 5000); the "
          "rest goes to a file per rank, named under the output")
@argument("--memory", action="store_true",
          help="every rank's memory over the cell, by category (parameters, gradients, "
          "optimizer states, activations, temporaries) and module: a chart per rank, the "
          "peak named")
@argument("--memory-dir", metavar="DIR", help="with --memory (implied): also write each rank's "
          "snapshot as DIR/rank<N>.pickle, which pytorch.org/memory_viz opens")
@argument("--on-oom", action="store_true", help="track memory too; a rank that runs out writes "
          "its snapshot, and the error says where and shows its chart")
def cell(line: str) -> None:
    """%%mesh: run the cell on every rank; `rank`, `world_size`, `device`, `dist` are defined."""


SUBCOMMANDS = {"start": start, "stop": stop, "restart": restart, "status": status,
               "init": init, "inspect": inspect, "memory": memory, "push": push,
               "pull": pull, "auto": auto, "schedule": schedule, "pipeline": pipeline,
               "step": step, "bench": bench, "calibrate": calibrate, "plan": plan,
               "dryrun": dryrun, "export": export, "checkpoint": checkpoint, "stacks": stacks,
               "debug": debug, "throttle": throttle, "prove": prove,
               "compare": compare, "losses": losses}


def _name_the_usage(fn: Parser, name: str) -> None:
    # argparse named each parser after its function: say what the user types instead
    fn.parser.prog = name  # type: ignore[attr-defined]
    fn.__doc__ = (fn.__doc__ or "").replace(f"%{fn.__name__}", name, 1)


for _name, _fn in SUBCOMMANDS.items():
    _name_the_usage(_fn, f"%mesh {_name}")
_name_the_usage(cell, "%%mesh")


def parse(subcommand: str, rest: str) -> Any:
    """The arguments of ``%mesh SUBCOMMAND REST``; ValueError names an unknown subcommand."""
    if subcommand not in SUBCOMMANDS:
        raise ValueError(f"unknown subcommand {subcommand!r}: use one of "
                         f"{', '.join(SUBCOMMANDS)} (see %mesh?)" if subcommand else
                         f"%mesh needs a subcommand: {', '.join(SUBCOMMANDS)} (see %mesh?)")
    return parse_argstring(SUBCOMMANDS[subcommand], rest)


def parse_cell(line: str) -> Any:
    """The options of a ``%%mesh`` line."""
    return parse_argstring(cell, line)


INTERRUPTED = {
    "start": "No cluster is running; `%mesh start N` starts again.",
    "restart": "The cluster may be half-replayed; `%mesh restart` again, or `%mesh stop`.",
    "init": "The ranks may still be building the mesh: `%mesh init AXES` again once they "
            "answer (`%mesh status`), or `%mesh restart`.",
}
"""What to do after Ctrl-C in a subcommand, where the generic advice would mislead."""


def help_text() -> str:
    """``%mesh?``: every subcommand's synopsis and options."""
    parts = [cell.__doc__ or ""] + [fn.__doc__ or "" for fn in SUBCOMMANDS.values()]
    return "meshlab: run cells on every rank of a torch.distributed cluster.\n\n" + "\n\n".join(
        p.strip() for p in parts)


def unquote(text: str | None) -> str | None:
    """A value without the quotes IPython's argument splitter keeps (``"tp=8 pp=16"``)."""
    return text.strip("\"'") if text else text
