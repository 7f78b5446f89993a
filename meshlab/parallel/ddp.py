"""Data parallel (DDP): a full replica per rank; gradients are averaged over the dp axis."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_ddp(model: nn.Module, mesh: DeviceMesh, *, axis: str = "dp") -> nn.Module:
    """Wrap ``model`` in DistributedDataParallel over ``mesh[axis]``."""
    from torch.nn.parallel import DistributedDataParallel

    device = next(model.parameters()).device
    # Buffers are not broadcast before each forward: they are derived (RoPE) or per-rank
    # statistics (MoE counts). torch 2.13 names that forward_sync_buffers (broadcast_buffers
    # warns there), and then copies rank 0's buffers once when it wraps the model, as it does
    # the parameters: equal at that point (a fresh model's counts are zero).
    sync = ("forward_sync_buffers" if "forward_sync_buffers" in
            inspect.signature(DistributedDataParallel).parameters else "broadcast_buffers")
    options: dict[str, Any] = {sync: False}
    return DistributedDataParallel(
        model, process_group=mesh[axis].get_group(), **options,
        device_ids=[device.index] if device.type == "cuda" else None)
