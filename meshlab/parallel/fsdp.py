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
    from meshlab.mesh import axis_size

    dims = mesh.mesh_dim_names or ()
    shard = "dp_shard_cp"
    if axis_size(mesh, shard) == 1:  # replicas only (pp=2 dp_replicate=2): ZeRO over them
        return mesh["dp_replicate"]
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
                              offload_policy=offload_policy() if offload else OffloadPolicy(),
                              shard_placement_fn=_shard_placement(dp.mesh.shape[-1]))
    for _, block in items(find_blocks(model, blocks)[1]):
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    # The root's parameters (embedding, norm, output) are used last in backward: no point
    # resharding them after forward.
    fully_shard(model, reshard_after_forward=False, **kw)
    _quiet_view_output(model)
    cast(Any, model).params_on_host = offload  # what meshlab.measure.memory.measure counts as host
    return model


def _shard_placement(size: int) -> Any:
    """FSDP splits dim 0, except where tensor parallel already splits dim 0 strided (a fused
    projection's packed parts, meshlab.parallel.fused): FSDP's dim-0 split over a strided one
    does not gather back whole (the full weight comes back in the wrong row order), so it
    splits dim 1 instead, as it does over GPT-2's Conv1D (strided on dim 1); FSDP splits a
    dim other than 0 only evenly."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def placement(param: nn.Parameter) -> Any:
        strided = any(isinstance(p, _StridedShard) and p.dim == 0
                      for p in getattr(param, "placements", ()))
        if not strided or param.ndim < 2:
            return None
        if param.shape[1] % size:
            raise ValueError(f"a fused projection's weight {tuple(param.shape)}, split by tp "
                             f"along its packed outputs, is split by FSDP along its "
                             f"{param.shape[1]} inputs, which the {size} data-parallel ranks "
                             "do not divide: pick a dp_shard that divides them")
        return Shard(1)

    return placement


# torch >= 2.13 warns whenever an FSDP2 module's forward returns a view (pytorch/pytorch#181850):
# an in-place op on that output (`out += y`) would skip the module's pre-backward all-gather
# (pytorch/pytorch#181832). Under TP the root's output always is one: DTensor.to_local returns
# a view of the local shard (torch's _ToTorchTensor), and a copy of the logits to avoid it
# would cost memory at real size. Harmless here: the root keeps its parameters gathered after
# forward (reshard_after_forward=False above), so an in-place edit of its output cannot skip
# an all-gather its backward needs; the blocks' hooks, whose all-gathers matter, still warn.
# torch means to warn on such a mutation instead of on every view (pytorch/pytorch#197154).
VIEW_OUTPUT = r"FSDP2-wrapped module \(.*\) returned a view tensor\."


def _quiet_view_output(model: nn.Module) -> None:
    """Run FSDP's post-forward hook of the root ``model`` (it returns what the caller gets)
    with VIEW_OUTPUT ignored; every other warning still shows, and the blocks' own hooks are
    left as torch made them."""
    import functools
    import warnings

    state = getattr(model, "_get_fsdp_state", lambda: None)()
    handle = getattr(state, "_post_forward_hook_handle", None)
    hooks = model._forward_hooks
    if handle is None or handle.id not in hooks:  # another torch: its warning shows
        return
    hook = hooks[handle.id]

    @functools.wraps(hook)
    def quiet(*args: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=VIEW_OUTPUT, category=UserWarning)
            return hook(*args)

    hooks[handle.id] = quiet
