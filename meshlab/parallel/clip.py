"""Gradient clipping by the norm of the whole model's gradient, on any mesh.

Each rank holds part of the gradient: a shard (FSDP's or TP's DTensors), a pipeline stage's
parameters, this rank's experts (EP), or a replica of it (DDP, cp ranks, a replicated
DTensor). The squares are summed locally per layout, then over the ranks holding other
parts of it and over the pipeline stages, never over replicas; a pipeline's tied head copy
is counted once. The clip itself is torch's: grads times min(1, max_norm / (norm + 1e-6)).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PARTS = "_meshlab_parts"
"""On a plain parameter: the process group whose ranks hold other parts of it (EP's experts),
so its squares sum over that group."""
COPY = "_meshlab_copy"
"""On a parameter: it is a second copy of a weight another parameter holds (a pipeline's tied
head), left out of the norm."""


def grad_norm(model: nn.Module) -> torch.Tensor:
    """The 2-norm of the whole model's gradient (float64, the same on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate

    sums: dict[Any, torch.Tensor] = {}
    groups: dict[Any, list[Any]] = {}
    for p in model.parameters():
        g = p.grad
        if g is None or getattr(p, COPY, False):
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                               for pl in g.placements])
            parts = getattr(p, PARTS, None)  # experts split over tp too (EP x TP)
            key: Any = (id(g.device_mesh), tuple(g.placements), id(parts))
            # every split placement sums (transformers' packed weights are _StridedShard,
            # which is not is_shard())
            groups[key] = [g.device_mesh.get_group(d) for d, pl in enumerate(g.placements)
                           if not pl.is_replicate()] + ([parts] if parts is not None else [])
            local = g.to_local()
        else:
            group = getattr(p, PARTS, None)
            key, groups[key] = ("parts", id(group)), [group] if group is not None else []
            local = g
        square = torch.linalg.vector_norm(local, dtype=torch.float64) ** 2
        sums[key] = sums[key] + square if key in sums else square
    total = torch.zeros((), dtype=torch.float64, device=_device(model))
    for key, square in sums.items():  # the same keys, in the same order, across a group
        for group in groups[key]:
            dist.all_reduce(square, group=group)
        total += square
    pipeline = getattr(model, "pipeline", None)
    if pipeline is not None and dist.get_world_size(pipeline.group) > 1:
        dist.all_reduce(total, group=pipeline.group)
    return total.sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient so the whole model's gradient norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does in one process; returns the norm before."""
    from torch.distributed.tensor import DTensor

    norm = grad_norm(model)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            local.mul_(scale.to(local.dtype))
    return norm


def _device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")
