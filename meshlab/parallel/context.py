"""Context parallel: each rank of the cp axis holds a contiguous slice of every sequence.

Attention needs every earlier key, so each rank all-gathers K and V along the sequence and
masks causally from its own offset. torch's context_parallel has no CPU sharding strategy
for the flash-attention op (causal or backward) in 2.13, so on CPU this is meshlab's own,
exact implementation ("meshlab"); its backward sums the key/value gradients from every rank.
(A ring pass would keep only one remote chunk in memory at a time; the all-gather is
simpler.) On CUDA ranks the default is torch's own ring attention ("torch"), attached to the
attention core the way torchtitan does, with contiguous slices (no load balancing) so the
RoPE offsets stay those of meshlab's slices.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dim; backward: sum the gradient over ranks, keep our chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries used our keys
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's slice, differentiably."""
    return cast(torch.Tensor, _GatherSequence.apply(x, group, dim))


IMPLEMENTATIONS = ("auto", "meshlab", "torch")


def apply_cp(model: nn.Module, mesh: DeviceMesh, *, seq_len: int, axis: str = "cp",
             impl: str = "auto") -> nn.Module:
    """Make every attention layer attend across the cp ranks' slices of the sequence.

    impl: "meshlab" (all-gather K/V, any device), "torch" (torch's ring attention, CUDA
    only) or "auto" (torch's on CUDA, meshlab's elsewhere).
    """
    cp = mesh[axis]
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    if seq_len % size:
        raise ValueError(f"cp={size} must divide the sequence length {seq_len}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS}")
    if impl == "auto":
        impl = "torch" if cp.device_type == "cuda" else "meshlab"
    if impl == "torch" and cp.device_type != "cuda":
        raise ValueError(f"impl='torch': torch's context parallel attention has no "
                         f"{cp.device_type} sharding strategy in torch {torch.__version__}; "
                         "use impl='meshlab' (or 'auto')")
    chunk = seq_len // size
    offset = rank * chunk
    transformer: Any = model  # a meshlab Transformer
    transformer.seq_offset = offset  # RoPE positions start where our slice does

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = gather_sequence(k, group, 2), gather_sequence(v, group, 2)  # (B,H,T,D)
        query_pos = torch.arange(offset, offset + q.shape[2], device=q.device)[:, None]
        keys_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=keys_pos <= query_pos)

    if impl == "torch":
        core = _torch_ring_attention(cp)
    for block in cast(nn.ModuleDict, model.layers).values():
        attention: Any = block.attention
        attention.core = core
    return model


class _CausalAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _torch_ring_attention(cp: DeviceMesh) -> Any:
    """torch's context-parallel SDPA on local (B, H, T/cp, D) slices, as torchtitan wires it."""
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    # Our slices are contiguous (rank r holds positions [r*T/cp, (r+1)*T/cp)); with load
    # balancing on, torch would assume its head-tail layout and mask the wrong blocks.
    _cp_options.enable_load_balance = False
    _enable_context_parallel_dispatcher()
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    ring = parallelize_module(_CausalAttention(), cp, style)
    return ring.__call__  # a bound method: nn.Module would register a module as a child


def sequence_slice(tokens: torch.Tensor, mesh: DeviceMesh, *, axis: str = "cp") -> torch.Tensor:
    """This cp rank's slice of (B, T) tokens or targets."""
    cp = mesh[axis]
    return tokens.chunk(cp.size(), dim=1)[cp.get_local_rank()].contiguous()
