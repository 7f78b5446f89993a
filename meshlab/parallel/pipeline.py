"""Pipeline parallel: contiguous stages over the pp axis, run by a torch pipelining schedule.

Stage s keeps layers [s*L/p, (s+1)*L/p); the first stage also holds the embedding, the last
the final norm and output. Split first, then parallelize each stage (TP, FSDP) as usual.
The step-by-step executor of user schedules is meshlab.schedules (a separate piece).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

SCHEDULES = ("gpipe", "1f1b")


def stage_layers(n_layers: int, stage: int, stages: int) -> range:
    """The layer indices a stage owns: as even a split as the counts allow."""
    if stages > n_layers:
        raise ValueError(f"pp={stages} stages need at least {stages} layers, the model has "
                         f"{n_layers}: lower pp or add layers")
    return range(stage * n_layers // stages, (stage + 1) * n_layers // stages)


def split_stage(model: Any, mesh: Any, *, axis: str = "pp") -> Any:
    """Cut ``model`` (a meshlab Transformer) down to this rank's pipeline stage, in place."""
    stage, stages = mesh[axis].get_local_rank(), mesh[axis].size()
    layers = cast(nn.ModuleDict, model.layers)
    keep = {str(i) for i in stage_layers(len(layers), stage, stages)}
    for name in [n for n in layers if n not in keep]:
        del layers[name]  # keys stay the original indices, so names match the full model
    if stage != 0:
        model.tok_embeddings = None
    if stage != stages - 1:
        model.norm = None
        model.output = None
    return model


def build_schedule(stage_model: nn.Module, mesh: Any, *, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   schedule: str = "1f1b", axis: str = "pp") -> Any:
    """A torch.distributed.pipelining schedule running this stage with its neighbours."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    pp = mesh[axis]
    device = next(stage_model.parameters()).device
    stage = PipelineStage(stage_model, pp.get_local_rank(), pp.size(), device,
                          group=pp.get_group())
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    # scale_grads: gradients are averaged over micro-batches, like one big batch
    return cls(stage, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=True)


def pipeline_step(schedule: Any, mesh: Any, inputs: torch.Tensor, targets: torch.Tensor,
                  *, axis: str = "pp") -> torch.Tensor:
    """One forward+backward through the pipeline; every stage gets the step's mean loss."""
    pp = mesh[axis]
    first, last = pp.get_local_rank() == 0, pp.get_local_rank() == pp.size() - 1
    losses: list[torch.Tensor] = []
    if first:
        schedule.step(inputs, target=targets if last else None, losses=losses)
    else:
        schedule.step(target=targets if last else None, losses=losses)
    # float64 on the wire: exact for both fp32 and float64 runs
    loss = torch.zeros((), dtype=torch.float64)
    if last:
        loss = torch.stack(losses).mean().detach().double()
    # the last stage knows the loss; share it so every rank reports the same number
    src = dist.get_global_rank(pp.get_group(), pp.size() - 1)
    dist.broadcast(loss, src=src, group=pp.get_group())
    return loss
