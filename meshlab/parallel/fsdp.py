"""ZeRO-2/3 and HSDP with FSDP2 ``fully_shard`` over the dp_shard (x cp) axis.

reshard_after_forward=True frees the gathered parameters after each block's forward
(ZeRO-3); False keeps them until backward (ZeRO-2: only gradients and optimizer states stay
sharded through the step). With a dp_replicate axis the mesh is 2-D and FSDP2 shards within
dp_shard and replicates across dp_replicate (HSDP).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from meshlab.parallel.blocks import find_blocks, items

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def fsdp_mesh(mesh: DeviceMesh, replicate: bool = True) -> DeviceMesh:
    """The (dp_replicate,) dp_shard_cp part of the mesh that FSDP shards over; without
    ``replicate`` only dp_shard_cp (replicas that synchronise on their own: local SGD)."""
    dims = mesh.mesh_dim_names or ()
    shard = "dp_shard_cp"
    return mesh[("dp_replicate", shard)] if "dp_replicate" in dims and replicate \
        else mesh[shard]


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = None, blocks: str | None = None,
               replicate: bool = True, offload: bool = False) -> nn.Module:
    """Shard every block (found, or at the path ``blocks``), then the rest, as torchtitan
    does: one FSDP unit per block, gathered only while it runs; ``offload``: the shards in
    host memory (meshlab.parallel.offload)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from meshlab.parallel.offload import offload_policy

    dp = fsdp_mesh(mesh, replicate)
    # None keeps the parameters' own dtype; mixed precision passes bf16 and fp32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw: dict[str, Any] = dict(mesh=dp, mp_policy=policy,
                              offload_policy=offload_policy() if offload else OffloadPolicy())
    for _, block in items(find_blocks(model, blocks)[1]):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    # The root's parameters (embedding, norm, output) are used last in backward: no point
    # resharding them after forward.
    fully_shard(model, reshard_after_forward=False, **kw)
    cast(Any, model).params_on_host = offload  # what meshlab.memory.measure counts as host
    return model
