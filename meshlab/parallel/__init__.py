"""Parallelism strategies, one per file, each an ``apply_<x>(model, mesh, ...)`` verb.

``parallelize(model, mesh, ParallelPlan(...))`` composes them in torchtitan's order.
"""

from meshlab.parallel.activation_checkpoint import apply_ac
from meshlab.parallel.compose import ParallelPlan, build_optimizer, parallelize
from meshlab.parallel.context import apply_cp
from meshlab.parallel.ddp import apply_ddp
from meshlab.parallel.expert import apply_ep
from meshlab.parallel.fsdp import apply_fsdp
from meshlab.parallel.pipeline import apply_pp
from meshlab.parallel.tensor import apply_tp
from meshlab.parallel.zero import apply_zero1

__all__ = ["ParallelPlan", "apply_ac", "apply_cp", "apply_ddp", "apply_ep", "apply_fsdp",
           "apply_pp", "apply_tp", "apply_zero1", "build_optimizer", "parallelize"]
