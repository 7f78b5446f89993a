"""``meshlab plan MODEL --gpus N [--hardware H] [--layout ...] [--where ...]``: the planner
in a terminal (``%mesh plan`` in a notebook): a summary, the layouts and the collectives."""

from __future__ import annotations

from typing import Any

from meshlab.plan.hardware import HARDWARE
from meshlab.plan.layout import PRECISIONS
from meshlab.plan.report import plan
from meshlab.plan.shapes import MODELS


def add_command(commands: Any) -> None:
    cmd = commands.add_parser(
        "plan", help="memory, communication and step time of a model on many GPUs",
        description="Predict memory per GPU, communication per axis and step time; without "
        "--layout, search the best layouts.")
    cmd.add_argument("model", help="a preset: " + ", ".join(MODELS))
    cmd.add_argument("--gpus", type=int, required=True)
    cmd.add_argument("--hardware", default="h100-sxm",
                     help=", ".join(HARDWARE) + ", or a .toml profile (default h100-sxm)")
    cmd.add_argument("--layout", help='e.g. "tp=8 pp=16 dp=16 zero=1 mbs=1 m=16"')
    cmd.add_argument("--where", help='search constraints, e.g. "tp<=8 pp=16"')
    cmd.add_argument("--batch", type=int,
                     help="global batch in sequences (default ~4M tokens, >= 1 per GPU)")
    cmd.add_argument("--precision", default="bf16", choices=list(PRECISIONS))
    cmd.add_argument("--tokens", type=float, help="training tokens, for days and GPU-hours")
    cmd.add_argument("--top", type=int, default=10)
    cmd.set_defaults(run=run_command)


def run_command(args: Any, parser: Any) -> int:
    try:
        result = plan(args.model, gpus=args.gpus, hardware_profile=args.hardware,
                      layout=args.layout, constraints=args.where, global_batch=args.batch,
                      precision=args.precision, top=args.top, tokens=args.tokens)
    except ValueError as e:
        parser.exit(2, f"meshlab plan: {e}\n")
    print(result.text(), end="\n\n")
    print(result.table().to_string(index=False), end="\n\n")
    comm = result.comm_frame()
    print(f"collectives of {result.best.layout.describe()}:")
    print(comm.to_string(index=False) if len(comm) else "(none: a single GPU)")
    return 0
