"""One entry point that applies the strategies in the order production trainers do.

Pipeline stages are split first (meshlab.parallel.pipeline.apply_pp), then on each stage:
tensor parallel, activation checkpointing, and data parallel (DDP, ZeRO-1, or FSDP2 for
ZeRO-2/3 and HSDP) last, as torchtitan does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshlab.mesh import axis_size
from meshlab.parallel.activation_checkpoint import MODES, apply_ac
from meshlab.parallel.context import IMPLEMENTATIONS
from meshlab.parallel.ddp import apply_ddp
from meshlab.parallel.fsdp import apply_fsdp
from meshlab.parallel.pipeline import apply_pp, is_causal_lm
from meshlab.parallel.tensor import apply_tp
from meshlab.parallel.zero import apply_zero1
from meshlab.schedules import Schedule, ScheduleError, build, canonical, check_virtual

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

DATA_PARALLEL = ("none", "ddp", "zero1", "zero2", "zero3")


@dataclass(kw_only=True, slots=True)
class ParallelPlan:
    """How to parallelize a model on a mesh; the degrees come from the mesh itself."""

    data_parallel: str = "zero3"
    """none, ddp, zero1 (DDP + sharded optimizer), zero2 or zero3 (FSDP2; HSDP with a
    dp_replicate axis)."""
    seq_len: int = 16
    """Sequence length of a batch; context parallelism splits it over the cp axis."""
    sequence_parallel: bool | None = None
    """With tp > 1, also split norms and the residual stream along the sequence; None: where
    the TP plan has it (meshlab's plan does, transformers' do not)."""
    tp_plan: Mapping[str, Any] | None = None
    """With tp > 1: module pattern -> ColwiseParallel() | RowwiseParallel() | ... (torch
    style), or transformers' names ("colwise", ...); None: the model's own plan (meshlab's, or
    transformers' ``_tp_plan``)."""
    blocks: str | None = None
    """Path to the model's repeated blocks (e.g. "model.layers"), which FSDP shards one by one
    and activation checkpointing wraps; None: found (meshlab.parallel.blocks)."""
    activation_checkpoint: str = "none"
    """none, selective (attention core) or full (every block)."""
    mixed_precision: bool = False
    """bf16 parameters and fp32 gradient reduction (FSDP stages only)."""
    pipeline_schedule: str | Schedule = "1f1b"
    """With a pp axis: a schedule meshlab builds (gpipe, 1f1b, interleaved_1f1b, looped_bfs,
    zb_h1, zbv, dualpipev: meshlab.schedules.BUILDERS) or a user's own Schedule
    (meshlab.schedules.parse), built for pp ranks."""
    microbatches: int = 2
    """Micro-batches per step through the pipeline (must divide the local batch)."""
    virtual: int = 1
    """Stages per rank for the looped schedules (interleaved_1f1b, looped_bfs)."""
    split_points: Sequence[str] | None = None
    """The blocks that open pipeline stages 1, 2, ... (torchtitan's names: ["layers.3"], or
    ["model.layers.3"] on a transformers model); None: blocks split as evenly as they go."""
    context_parallel: str = "auto"
    """With cp > 1: meshlab (all-gather K/V, any device), torch (torch's ring attention,
    CUDA only) or auto (torch's on CUDA, meshlab's elsewhere)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step, gradients reduced over dp once, in the last
    (meshlab.parallel.accumulate): k micro-steps on 1/k of the batch each equal one step on
    it, with the memory of the smaller one."""

    def __post_init__(self) -> None:
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel={self.data_parallel!r} is not one of "
                             f"{DATA_PARALLEL}")
        if self.activation_checkpoint not in MODES:
            raise ValueError(f"activation_checkpoint={self.activation_checkpoint!r} is not one "
                             f"of {MODES}")
        if self.context_parallel not in IMPLEMENTATIONS:
            raise ValueError(f"context_parallel={self.context_parallel!r} is not one of "
                             f"{IMPLEMENTATIONS}")
        if self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches} must be >= 1")
        if self.virtual < 1:
            raise ValueError(f"virtual={self.virtual} must be >= 1 (stages per rank)")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum!r} must be an integer >= 1 "
                             "(micro-steps per optimizer step)")
        if isinstance(self.pipeline_schedule, Schedule):
            self._check_own_schedule(self.pipeline_schedule)
        else:
            key = self.pipeline_schedule = canonical(self.pipeline_schedule)
            check_virtual(key, self.virtual, said=f"pipeline_schedule={key!r}")
        if self.mixed_precision and self.data_parallel not in ("zero2", "zero3"):
            raise ValueError("mixed_precision needs an FSDP stage: data_parallel='zero2' or "
                             "'zero3'")

    def _check_own_schedule(self, schedule: Schedule) -> None:
        schedule.validate()
        if self.microbatches != schedule.microbatches:
            raise ScheduleError(f"microbatches={self.microbatches} but the pipeline_schedule "
                                f"runs {schedule.microbatches} micro-batches: pass "
                                f"microbatches={schedule.microbatches}")
        if self.virtual != 1:
            raise ScheduleError(f"virtual={self.virtual} applies to a schedule built by name; "
                                f"a Schedule places its own stages ({schedule.stages} on "
                                f"{schedule.ranks} ranks): leave virtual=1")

    def schedule(self, pp: int) -> Schedule:
        """The pipeline schedule this plan runs on ``pp`` pipeline ranks."""
        if isinstance(self.pipeline_schedule, Schedule):
            return self.pipeline_schedule
        return build(self.pipeline_schedule, ranks=pp, microbatches=self.microbatches,
                     virtual=self.virtual)


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan) -> nn.Module:
    """Split pipeline stages (with a pp axis: then ``model.pipeline.step(x, y)`` trains),
    then on each stage expert, context and tensor parallel, activation checkpointing and
    data parallel, in that order."""
    tp, dp = axis_size(mesh, "tp"), axis_size(mesh, "dp")
    if tp > 1 and plan.data_parallel in ("ddp", "zero1") and dp > 1:
        raise ValueError(f"{plan.data_parallel} with tp={tp}: DDP does not take tensor-parallel "
                         "(DTensor) parameters; use data_parallel='zero2' or 'zero3' (FSDP2)")
    if axis_size(mesh, "pp") > 1 and plan.data_parallel in ("ddp", "zero1") and dp > 1:
        raise ValueError(f"{plan.data_parallel} with pp: DDP's per-micro-batch gradient "
                         "all-reduce deadlocks against the pipeline's sends; use "
                         "data_parallel='zero2' or 'zero3' (FSDP2), as torchtitan does")
    if axis_size(mesh, "pp") > 1 and plan.grad_accum > 1:
        raise ValueError(f"grad_accum={plan.grad_accum} with pp={axis_size(mesh, 'pp')}: the "
                         "pipeline already accumulates over its micro-batches; raise "
                         f"microbatches instead (microbatches={plan.microbatches * plan.grad_accum}"
                         ", grad_accum=1)")
    if axis_size(mesh, "cp") > 1 and axis_size(mesh, "ep") == 1 and plan.data_parallel == "none":
        raise ValueError(f"data_parallel='none' with cp={axis_size(mesh, 'cp')}: each cp rank "
                         "computes gradients from its slice of the sequence, and they must be "
                         "summed: use data_parallel='ddp', 'zero2' or 'zero3'")
    if axis_size(mesh, "ep") > 1 and plan.data_parallel != "none":
        raise ValueError("with ep, expert parallelism averages gradients over the data ranks "
                         "itself: use data_parallel='none'")
    _check_model_supports(model, mesh, plan)
    if axis_size(mesh, "pp") > 1:
        return apply_pp(model, mesh, schedule=plan.schedule(axis_size(mesh, "pp")),
                        split_points=plan.split_points,
                        parallelize_stage=partial(_parallelize_stage, mesh=mesh, plan=plan))
    return _parallelize_stage(model, mesh=mesh, plan=plan)


def _check_model_supports(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan) -> None:
    """Context and expert parallel split meshlab's own Transformer for now, and a pipeline
    also a transformers causal LM: any other model gets an error naming what to change,
    never a bare AttributeError. Checked before any rank builds anything, so every rank
    refuses alike (one refusing alone would leave its pipeline peers waiting)."""
    from meshlab.models import Transformer

    if isinstance(model, Transformer):
        return
    if axis_size(mesh, "pp") > 1 and axis_size(mesh, "tp") > 1 and plan.sequence_parallel:
        raise ValueError(f"sequence_parallel=True with pp={axis_size(mesh, 'pp')} is applied "
                         f"to meshlab's Transformer only, not yet to {type(model).__name__} "
                         "(its stages pass whole-sequence activations): pass "
                         "sequence_parallel=False, or build the mesh without pp")
    from meshlab.parallel import context, expert

    checks = [("pp", "a pipeline split", is_causal_lm(model),
               "meshlab's Transformer and transformers' causal LMs (a _pp_plan)"),
              ("cp", "context parallel", context.takes(model), context.TAKES),
              ("ep", "expert parallel", expert.takes(model), expert.TAKES)]
    for axis, what, takes, takers in checks:
        if axis_size(mesh, axis) > 1 and not takes:
            raise ValueError(f"{what} ({axis}={axis_size(mesh, axis)}) is applied to {takers}, "
                             f"not yet to {type(model).__name__}: build the "
                             f"mesh without {axis} (DDP, ZeRO-1/2/3, HSDP, TP and activation "
                             "checkpointing take any model of repeated blocks)")


def _parallelize_stage(model: nn.Module, *, mesh: DeviceMesh, plan: ParallelPlan
                       ) -> nn.Module:
    """Expert, context and tensor parallel, activation checkpointing, data parallel."""
    tp = axis_size(mesh, "tp")
    if axis_size(mesh, "ep") > 1:
        from meshlab.parallel.expert import apply_ep

        model = apply_ep(model, mesh)
    if axis_size(mesh, "cp") > 1:
        from meshlab.parallel.context import apply_cp

        model = apply_cp(model, mesh, seq_len=plan.seq_len, impl=plan.context_parallel)
    if tp > 1:
        model = apply_tp(model, mesh, sequence_parallel=plan.sequence_parallel,
                         plan=plan.tp_plan)
    model = apply_ac(model, plan.activation_checkpoint, blocks=plan.blocks)
    if plan.data_parallel != "none" and axis_size(mesh, "dp_cp") > 1:
        if plan.data_parallel in ("ddp", "zero1"):
            # cp ranks hold replicas too, trained on other parts of the same sequences
            model = apply_ddp(model, mesh, axis="dp_cp" if axis_size(mesh, "cp") > 1 else "dp")
        elif plan.data_parallel in ("zero2", "zero3"):
            # mixed precision: bf16 compute, fp32 gradient reduction (the usual recipe)
            mixed = plan.mixed_precision
            # With PP, do not reshard after forward: it would all-gather per micro-batch.
            reshard = plan.data_parallel == "zero3" and axis_size(mesh, "pp") == 1
            model = apply_fsdp(model, mesh, reshard_after_forward=reshard,
                               param_dtype=torch.bfloat16 if mixed else None,
                               reduce_dtype=torch.float32 if mixed else None,
                               blocks=plan.blocks)
    return model


def build_optimizer(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan, *, lr: float = 1e-2,
                    weight_decay: float = 0.1) -> torch.optim.Optimizer:
    """AdamW, with its states sharded over dp for ZeRO-1."""
    if plan.data_parallel == "zero1" and axis_size(mesh, "dp") > 1:
        return apply_zero1(model, mesh, lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
