"""ZeRO stage 1: optimizer states sharded over the dp axis (gradients and parameters whole).

Stages 2 and 3 shard gradients and parameters too: they are FSDP2 (meshlab.parallel.fsdp)
with ``reshard_after_forward`` False and True.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_zero1(model: nn.Module, mesh: DeviceMesh, *, axis: str = "dp",
                optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW,
                **optimizer_args: Any) -> torch.optim.Optimizer:
    """The optimizer for ``model`` with its states split over ``mesh[axis]`` (each rank
    updates its share of the parameters, then broadcasts them). Use it with DDP (apply_ddp)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=optimizer_class,
                                   process_group=mesh[axis].get_group(), **optimizer_args)
