"""The ``%mesh`` subcommands that measure and plan: bench, calibrate, plan, dryrun (their
arguments, declared once; meshlab.notebook.commands lists them with the others)."""

from __future__ import annotations

from IPython.core.magic_arguments import argument, magic_arguments

from meshlab.notebook.command_options import amount, count, output_option, ranks_option
from meshlab.plan import HARDWARE, IMPLEMENTATIONS, MODELS, PRECISIONS


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
