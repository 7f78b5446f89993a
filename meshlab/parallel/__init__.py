"""Parallelism strategies, one per file, each an ``apply_<x>(model, mesh, ...)`` verb.

``parallelize(model, mesh, ParallelPlan(...))`` composes them in torchtitan's order.
"""

from meshlab.parallel.activation_checkpoint import apply_ac
from meshlab.parallel.compose import ParallelPlan, build_optimizer, parallelize
from meshlab.parallel.context import apply_cp
from meshlab.parallel.ddp import apply_ddp
from meshlab.parallel.expert import apply_ep
from meshlab.parallel.fsdp import apply_fsdp
from meshlab.parallel.pipeline import build_schedule, split_stage
from meshlab.parallel.tensor import apply_tp
from meshlab.parallel.zero import zero1_optimizer

__all__ = ["ParallelPlan", "apply_ac", "apply_cp", "apply_ddp", "apply_ep", "apply_fsdp",
           "apply_tp", "build_optimizer", "build_schedule", "parallelize", "split_stage",
           "zero1_optimizer"]
