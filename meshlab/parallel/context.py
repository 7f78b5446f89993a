"""Context parallel: each rank of the cp axis holds a contiguous slice of every sequence.

Attention needs every earlier key, so each rank all-gathers K and V along the sequence and
masks causally from its own offset. torch's context_parallel has no CPU sharding strategy
for the flash-attention op (causal or backward) in 2.13, so this is meshlab's own, exact
implementation; its backward sums the key/value gradients from every rank. (A ring pass
would keep only one remote chunk in memory at a time; the all-gather is simpler.)
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


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


def apply_cp(model: nn.Module, mesh: Any, *, seq_len: int, axis: str = "cp") -> nn.Module:
    """Make every attention layer attend across the cp ranks' slices of the sequence."""
    cp = mesh[axis]
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    if seq_len % size:
        raise ValueError(f"cp={size} must divide the sequence length {seq_len}")
    chunk = seq_len // size
    offset = rank * chunk
    model.seq_offset = offset  # RoPE positions start where our slice does

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = gather_sequence(k, group, 2), gather_sequence(v, group, 2)  # (B,H,T,D)
        query_pos = torch.arange(offset, offset + q.shape[2])[:, None]
        mask = torch.arange(keys.shape[2])[None, :] <= query_pos  # causal, globally
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)

    for block in cast(nn.ModuleDict, model.layers).values():
        attention: Any = block.attention
        attention.core = core
    return model


def sequence_slice(tokens: torch.Tensor, mesh: Any, *, axis: str = "cp") -> torch.Tensor:
    """This cp rank's slice of (B, T) tokens or targets."""
    cp = mesh[axis]
    return tokens.chunk(cp.size(), dim=1)[cp.get_local_rank()].contiguous()
