"""Data parallel (DDP): a full replica per rank; gradients are averaged over the dp axis."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, axis: str = "dp") -> nn.Module:
    """Wrap ``model`` in DistributedDataParallel over ``mesh[axis]``."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    # Buffers are not broadcast: they are derived (RoPE) or per-rank statistics (MoE counts).
    return DistributedDataParallel(
        model, process_group=mesh[axis].get_group(), broadcast_buffers=False,
        device_ids=[device.index] if device.type == "cuda" else None)
