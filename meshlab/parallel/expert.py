"""Expert parallel: each rank of the ep axis keeps n_experts / ep of every MoE layer's experts.

Tokens travel to the rank that holds their expert and back with all-to-all. The autograd
version (torch.distributed.nn.functional.all_to_all_single) is required: the plain
dist.all_to_all_single is invisible to autograd, and the experts would silently get no
gradient. ep is carved out of dp_shard x cp (meshlab.mesh), so the ranks of an ep group
also hold different data. apply_ep installs the dispatch on each MoE layer
(``moe.dispatch``), so the model itself never imports this module.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from meshlab.mesh import axis_size
from meshlab.models.moe import MoE

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_ep(model: nn.Module, mesh: DeviceMesh, *, axis: str = "ep") -> nn.Module:
    """Keep this rank's slice of the experts, send tokens to their experts' ranks, and
    average gradients like one process would."""
    ep = mesh[axis]
    size, rank = ep.size(), ep.get_local_rank()
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ValueError("expert parallelism needs an MoE model: ModelConfig(n_experts=...)")
    for moe in moes:
        if moe.n_experts % size:
            raise ValueError(f"ep={size} must divide n_experts={moe.n_experts}")
        local = moe.n_experts // size
        for name in ("w1", "w2", "w3"):
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local]
                                            .clone()))
        moe.dispatch = partial(dispatch_and_combine, group=ep.get_group(), ranks=size,
                               local=local)
        moe.register_buffer("tokens_received", torch.zeros(local, dtype=torch.long),
                            persistent=False)
    _average_gradients(model, mesh, moes)
    return model


def _average_gradients(model: nn.Module, mesh: DeviceMesh, moes: list[MoE]) -> None:
    """The single-process gradient is the mean over all data ranks.

    A replicated (non-expert) parameter sums its gradient over every data rank. An expert
    already received the gradients of every token routed to it from its ep group, so it
    only sums over its replicas in the other ep groups. Both then divide by the number of
    data ranks.
    """
    data = axis_size(mesh, "dp")
    experts = {id(p) for moe in moes for p in (moe.w1, moe.w2, moe.w3)}
    dp_group = mesh["dp"].get_group() if data > 1 else None
    replicas = axis_size(mesh, "dp_shard_mod_ep") * axis_size(mesh, "dp_replicate")
    replica_group = _expert_replica_group(mesh) if replicas > 1 else None

    for p in model.parameters():
        group = replica_group if id(p) in experts else dp_group

        def hook(param: torch.Tensor, group: Any = group) -> None:
            assert param.grad is not None
            if group is not None:
                dist.all_reduce(param.grad, group=group)
            param.grad.div_(data)

        p.register_post_accumulate_grad_hook(hook)


def _expert_replica_group(mesh: DeviceMesh) -> Any:
    dims = [d for d in ("dp_replicate", "dp_shard_mod_ep") if axis_size(mesh, d) > 1]
    sub = mesh[tuple(dims)]
    return sub.get_group() if len(dims) == 1 else sub._flatten("ep_replicas").get_group()


def dispatch_and_combine(moe: MoE, tokens: torch.Tensor, experts: torch.Tensor,
                         weights: torch.Tensor, *, group: Any, ranks: int, local: int
                         ) -> torch.Tensor:
    """Send each (token, expert) pair to the expert's rank among the ``ranks`` of ``group``
    (each holding ``local`` experts), run it there, bring it back."""
    from torch.distributed.nn.functional import all_to_all_single

    flat = experts.flatten()  # (N * k,) global expert ids
    order = flat.argsort(stable=True)  # group the pairs by expert, hence by owner rank
    token_of_pair = (torch.arange(flat.numel()) // experts.shape[1])[order]
    counts = torch.bincount(flat, minlength=moe.n_experts).view(ranks, local)  # to each rank
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # sizes only: no autograd
    send, recv = counts.sum(1).tolist(), received_counts.sum(1).tolist()

    routed = tokens[token_of_pair]
    arrived = all_to_all_single(torch.empty(sum(recv), tokens.shape[1], dtype=tokens.dtype),
                                routed, recv, send, group=group)
    moe.get_buffer("tokens_received").add_(received_counts.sum(0).detach())
    pieces, start = [], 0
    for source in range(ranks):  # each source sent its pairs sorted by expert
        for e in range(local):
            n = int(received_counts[source, e])
            pieces.append(moe.experts(arrived[start:start + n], e))
            start += n
    done = torch.cat(pieces) if pieces else arrived
    returned = all_to_all_single(torch.empty_like(routed), done, send, recv, group=group)
    gate = weights.flatten()[order, None]
    out = torch.zeros_like(tokens)
    return cast(torch.Tensor, out.index_add(0, token_of_pair, returned * gate))
