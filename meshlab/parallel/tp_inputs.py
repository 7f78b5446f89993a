"""Every rank of a tensor-parallel group must be given the same batch: each computes its
slice of the same layers on it, and their partial sums are added. Ranks fed by their global
rank (a data loader sharded over every rank, not over the data-parallel ones) give each tp
rank other tokens, and the sums mix two batches: a loss that trains, wrongly, with no error.

``watch`` checks the first ``CHECKED_CALLS`` forwards of a model: a checksum of each tensor
argument (exact for token ids), gathered over the tp group, and a ValueError on every rank
of the group alike (they all see the same checksums, so none is left waiting) naming the
ranks that differ and the fix. Then the hook removes itself: a loader sharded wrongly is
wrong from its first batch.
Rank side: torch only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

CHECKED_CALLS = 4


def watch(model: nn.Module, tp: DeviceMesh) -> None:
    """Check the first forwards of ``model`` get the same tensors on every rank of ``tp``;
    nothing on a dry run's fake group (its tensors have no values to compare)."""
    if dist.get_backend(tp.get_group()) == "fake":
        return
    calls = [0]

    def check(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls[0] += 1
        if calls[0] >= CHECKED_CALLS:
            handle.remove()
        # every rank gathers, tensors or not: one that skipped would leave the others waiting
        mine = checksum([*args, *kwargs.values()], _device(tp))
        group = tp.get_group()
        everyone = [torch.zeros_like(mine) for _ in range(tp.size())]
        dist.all_gather(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
        apart = [r for r, sums in zip(ranks, everyone, strict=True)
                 if not torch.equal(sums, everyone[0])]
        if apart:
            raise ValueError(
                f"tensor-parallel ranks {ranks} were given different inputs in forward call "
                f"{calls[0]} (ranks {apart} differ from rank {ranks[0]}): every rank of a tp "
                "group must see the same batch, or their partial sums mix two batches. Shard "
                "the data by the data-parallel coordinate, not the global rank: e.g. "
                "local_batch(..., rank=mesh['dp'].get_local_rank(), ranks=mesh['dp'].size())")

    handle = model.register_forward_pre_hook(check, with_kwargs=True)


def checksum(values: list[Any], device: torch.device) -> torch.Tensor:
    """(count, sum, position-weighted sum) over every plain tensor in ``values``, float64 on
    ``device`` (zeros when there is none). Token ids sum exactly; a reordered batch changes
    the weighted sum; each tensor weighs in by its place among the arguments."""
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    tensors = [v for v in values if type(v) is torch.Tensor]  # not a DTensor: shards differ
    for place, value in enumerate(tensors, start=1):
        flat = value.detach().reshape(-1).to(device=device, dtype=torch.float64)
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=device)
        sums += torch.stack([sums.new_tensor(float(flat.numel() * place)),
                             flat.sum() * place, (flat * weights).sum() * place])
    return sums


def _device(tp: DeviceMesh) -> torch.device:
    """Where the group's collectives run: the rank's accelerator, or the CPU (gloo)."""
    if tp.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(tp.device_type, torch.accelerator.current_device_index())
