"""The ``%mesh`` command line: each subcommand's arguments, declared once.

The magics parse with these and call the Session; ``meshlab export`` reads saved notebooks
with them; ``%mesh?`` is assembled from their docstrings. Options several subcommands share
(``--ranks``, ``-o NAME``, the schedule's size) are decorators declared here once.
"""

from __future__ import annotations

import math
from argparse import ArgumentTypeError
from collections.abc import Callable
from typing import Any

from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from meshlab.plan import HARDWARE, IMPLEMENTATIONS, MODELS, PRECISIONS
from meshlab.schedules import BUILDERS

Parser = Callable[[str], None]


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a whole (``int``) or finite (``float``) number above 0; argparse
    names the option in front of the message."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            what = "whole number" if kind is int else "finite number"
            raise ArgumentTypeError(f"{text!r} is not a {what} above 0")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


count, amount = positive(int), positive(float)  # argparse types: 3 ranks, 2.5 s

ranks_option = argument("--ranks", help="only these ranks, e.g. 0,2-3 (default: all)")


def output_option(what: str) -> Callable[[Parser], Parser]:
    """``-o NAME``: keep ``what`` in the notebook as NAME."""
    return argument("-o", dest="output", metavar="NAME", help=f"keep {what} as NAME")


def schedule_options(microbatches: int) -> Callable[[Parser], Parser]:
    """``--microbatches`` and ``--virtual``, for a schedule built by name."""
    def add(fn: Parser) -> Parser:
        fn = argument("--virtual", type=count, default=1,
                      help="stages per rank v (interleaved, looped; a builder name)")(fn)
        return argument("--microbatches", type=count, default=microbatches,
                        help=f"micro-batches m (default {microbatches}; a builder name)")(fn)
    return add


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
def stacks(line: str) -> None:
    """%mesh stacks: every rank's current Python stack (identical ones once) and its last
    collectives; answers while a cell runs or hangs."""


@magic_arguments()
@argument("rank", type=int, help="the rank whose last failed cell to examine")
def debug(line: str) -> None:
    """%mesh debug RANK: post-mortem of the last failed cell on RANK (traceback, the failing
    frame's variables)."""


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
@argument("kernel", help="a built-in kernel (rmsnorm, softmax, swiglu, cross_entropy) or a "
          "callable on the ranks, e.g. one launching your @triton.jit kernel")
@argument("--ref", help="the reference on the ranks (default for built-ins: their torch twin)")
@argument("--sizes", default="256,1024", help="row lengths, comma-separated (default 256,1024)")
@argument("--dtype", default="float32", help="float32, float16, bfloat16 (default float32)")
@argument("--mode", choices=["fwd", "bwd", "full"], default="fwd", help="what to time")
@argument("--rows", type=count, help="rows per problem (default 4096 on GPU, 4 on CPU)")
@ranks_option
@output_option("the table (a DataFrame)")
def bench(line: str) -> None:
    """%mesh bench: time a Triton kernel beside torch on every rank; a table and a chart."""


@magic_arguments()
@argument("-o", dest="path", default="calibrated.toml", metavar="PATH",
          help="the hardware profile to write (default calibrated.toml)")
@argument("--name", help="the profile's name (default: the file's stem)")
@argument("--sizes", help="collective message sizes in bytes, comma-separated, K/M/G suffixes "
          "(default 4K..16M on CPU, 64K..256M on GPU)")
@argument("--quick", action="store_true", help="fewer sizes and repetitions: a rough profile "
          "in a few seconds")
def calibrate(line: str) -> None:
    """%mesh calibrate: time matmuls, memory copies and every collective on each mesh axis of
    the live ranks; fit the planner's alpha-beta model; time each all-reduce algorithm (ring,
    halving-doubling, tree, hierarchical) on the world and say which wins at which size;
    write a hardware profile."""


@magic_arguments()
@argument("model", help="a preset (" + ", ".join(MODELS) + "), a .toml file of ModelShape's "
          "fields (layers = 32, hidden = 4096, ...), or a notebook variable holding a "
          "ModelShape or a meshlab ModelConfig")
@argument("--gpus", type=count, help="GPUs to plan for (default: the running cluster's ranks)")
@argument("--seq", type=count, help="the model at this training sequence length (default: its "
          "own), e.g. --seq 131072")
@argument("--hardware", default="h100-sxm", help="a profile (" + ", ".join(HARDWARE) + ") or "
          "a .toml file, e.g. one %%mesh calibrate wrote (default h100-sxm)")
@argument("--layout", help='one layout to estimate, e.g. "tp=8 pp=16 dp=16 zero=1 mbs=1 '
          'm=16"; without it the best layouts are searched')
@argument("--where", help='constraints for the search, e.g. "tp<=8 pp=16 zero=3"')
@argument("--batch", type=count, help="global batch in sequences (default: ~4M tokens, at "
          "least one sequence per GPU; with --layout: sets m, or must equal mbs x m x dp where "
          "the layout gives m)")
@argument("--precision", choices=list(PRECISIONS),
          help="compute precision (default bf16; with --measure fp32, as CPU ranks train)")
@argument("--tokens", type=amount, help="training tokens, for days and GPU-hours (e.g. 15e12)")
@argument("--implementation", choices=list(IMPLEMENTATIONS), default="meshlab",
          help="whose code the memory is counted for (default meshlab: what %%mesh dryrun "
          "measures; megatron: Megatron-LM's)")
@argument("--measure", metavar="STEP", help='with --layout, the live mesh\'s: run STEP (e.g. '
          '"train_step()", one training step the ranks know) profiled and show each term the '
          "planner predicts (compute, host time, exposed communication per axis, bubble, "
          "optimizer) beside the same term measured, and why where they differ by over 25%%")
@argument("--steps", type=count, default=1, help="with --measure: how many times to run STEP "
          "(default 1); the terms are per step")
@argument("--top", type=count, default=10, help="layouts to show from the search (default 10)")
@argument("--verify", type=count, nargs="?", const=3, metavar="K",
          help="also dry-run the best K layouts (default 3) on fake ranks: what torch "
          "allocates and sends beside what the planner predicts")
@output_option("the Plan (with --measure: the table of terms)")
def plan(line: str) -> None:
    """%mesh plan: predict memory per GPU, communication per axis and step time of a model on
    many GPUs, for one layout or the best layouts found."""


@magic_arguments()
@argument("model", help="a notebook variable holding a model factory (called on the meta "
          "device), a ModelShape or a meshlab ModelConfig; or a preset (" + ", ".join(MODELS)
          + "), built as meshlab's Transformer")
@argument("--layout", required=True, help='the layout, e.g. "pp=4 dp_shard=32 tp=8" (mesh '
          "degrees, and the planner's keys: zero, schedule, v, m, mbs, ac, sp)")
@argument("--batch", type=count, help="sequences per data-parallel rank per step (default "
          "mbs x m)")
@argument("--seq", type=count, help="sequence length (default: the preset's)")
@argument("--hardware", default="h100-sxm", help="whose memory the fit is checked against: "
          "a profile (" + ", ".join(HARDWARE) + ") or a .toml file (default h100-sxm)")
@argument("--ranks", help="the ranks to run, e.g. 0,1023 (default: one per distinct role, "
          "each pipeline stage)")
@argument("--plan", metavar="NAME", help="a notebook variable holding a ParallelPlan: its "
          "model options (tp_plan, blocks, split_points) as parallelize takes them; the "
          "layout decides the rest")
@argument("--kernels", choices=("fused", "eager"), default="fused",
          help="whose activations: fused GPU kernels' (FlashAttention, fused norms and SwiGLU; "
               "the default) or the code's op by op (eager)")
@argument("--init", metavar="NAME", help="a notebook function init(module), as "
          "parallelize(..., init=) takes it (a dry run fills nothing: a module without "
          "reset_parameters() needs none)")
@output_option("the DryRun")
def dryrun(line: str) -> None:
    """%mesh dryrun: one training step of your own model and layout on thousands of fake
    ranks, in this process (no cluster): memory by category and bytes per mesh axis of each
    representative rank, beside the planner's prediction."""


@magic_arguments()
@argument("path", help="the script to write, e.g. train.py; launch.sh goes beside it")
@argument("--sbatch", action="store_true", help="also write job.sbatch for Slurm")
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
def cell(line: str) -> None:
    """%%mesh: run the cell on every rank; `rank`, `world_size`, `device`, `dist` are defined."""


SUBCOMMANDS = {"start": start, "stop": stop, "restart": restart, "status": status,
               "init": init, "inspect": inspect, "memory": memory, "push": push,
               "pull": pull, "auto": auto, "schedule": schedule, "pipeline": pipeline,
               "step": step, "bench": bench, "calibrate": calibrate, "plan": plan,
               "dryrun": dryrun, "export": export, "checkpoint": checkpoint, "stacks": stacks,
               "debug": debug, "throttle": throttle, "prove": prove}


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


def help_text() -> str:
    """``%mesh?``: every subcommand's synopsis and options."""
    parts = [cell.__doc__ or ""] + [fn.__doc__ or "" for fn in SUBCOMMANDS.values()]
    return "meshlab: run cells on every rank of a torch.distributed cluster.\n\n" + "\n\n".join(
        p.strip() for p in parts)


def unquote(text: str | None) -> str | None:
    """A value without the quotes IPython's argument splitter keeps (``"tp=8 pp=16"``)."""
    return text.strip("\"'") if text else text
