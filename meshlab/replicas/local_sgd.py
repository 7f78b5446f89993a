"""Local SGD and DiLoCo: replicas train alone for H steps, then synchronise.

The replicas are the ``dp_replicate`` axis (the slow one: across hosts or sites); inside a
replica, DDP or FSDP reduce gradients every step over ``dp_shard`` as usual. Every ``H``
optimizer steps, each rank synchronises its parameters with the same shard on the other
replicas:

- ``local_sgd`` (Stich 2019; Lin et al. 2020): the parameters are averaged;
- ``diloco`` (Douillard et al. 2023): the pseudo-gradient, the last synchronised parameters
  minus the local ones, is averaged and an outer optimizer (SGD with Nesterov momentum)
  steps the synchronised parameters with it; every replica then continues from them.

This follows torchft's ``LocalSGD`` and ``DiLoCo`` (the pseudo-gradient's sign, the outer
step on a backup of the synchronised parameters), on meshlab's own mesh: torchft's need a
``torchft.Manager`` with its own quorum server and replica process group, which a mesh axis
of one cluster does not have. The synchronisation runs as a post-step hook of the optimizer
``build_optimizer`` returns, so a training loop does not change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.measure.memory import local_shard

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshlab.parallel.parallel_plan import ParallelPlan


def sync_for(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan) -> ReplicaSync:
    """The synchroniser of local SGD or DiLoCo as ``plan`` sets it (the replica_modes entry)."""
    return ReplicaSync(model, mesh, mode=plan.replica_sync, every=plan.sync_every,
                       outer_lr=plan.outer_lr, outer_momentum=plan.outer_momentum)


class ReplicaSync:
    """Counts optimizer steps and synchronises the replicas every ``every`` of them."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, *, mode: str, every: int,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9) -> None:
        self.group = mesh["dp_replicate"].get_group()
        self.replicas = dist.get_world_size(self.group)
        self.mode, self.every, self.steps, self.syncs = mode, every, 0, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.outer: torch.optim.Optimizer | None = None
        if mode == "diloco":  # the synchronised parameters, which the outer optimizer steps
            self.backup = [local_shard(p).detach().clone() for p in self.params]
            self.outer = torch.optim.SGD(self.backup, lr=outer_lr, momentum=outer_momentum,
                                         nesterov=outer_momentum > 0)

    def after_step(self, *_: Any) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        """Average (local SGD), or step the outer optimizer on the averaged pseudo-gradient."""
        self.syncs += 1
        shards = [local_shard(p) for p in self.params]
        if self.outer is None:
            for shard in shards:
                dist.all_reduce(shard, group=self.group)
                shard /= self.replicas
            return
        for saved, shard in zip(self.backup, shards, strict=True):
            saved.grad = saved - shard  # the pseudo-gradient: where the replica went, negated
            dist.all_reduce(saved.grad, group=self.group)
            saved.grad /= self.replicas
        self.outer.step()
        for saved, shard in zip(self.backup, shards, strict=True):
            shard.copy_(saved)
