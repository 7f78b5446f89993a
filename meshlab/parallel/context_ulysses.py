"""DeepSpeed-Ulysses context parallel (Jacobs et al. 2023): heads for sequence, and back.

Each cp rank holds a contiguous slice of every sequence. Before attention, an all-to-all
over the cp group trades the slices for heads: local (B, H, T/cp, D) q, k, v become
(B, H/cp, T, D), the whole sequence for a cp-th of the heads; attention runs locally and
causally over the whole sequence; a second all-to-all trades the output back to
(B, H, T/cp, D). Each rank sends (cp-1)/cp of its q, k, v and output slices, so the bytes a
rank moves stay constant when the sequence and cp grow together (the all-gather's grow
with the sequence). With grouped-query attention the query heads and the key/value heads
are each split over cp, so every rank keeps whole groups: both counts (after tensor
parallel, the local ones) must be multiples of cp.

>>> ParallelPlan(context_parallel="ulysses")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""Attention over the whole sequence on a head slice: (B, h, T, D) q, k, v -> (B, h, T, D)."""


def _exchange(x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
    """One all-to-all: (B, H, T/cp, D) -> (B, H/cp, T, D) when ``to_heads``, else back."""
    size = dist.get_world_size(group)
    b, h, t, d = x.shape
    if to_heads:  # rank j gets head group j of our slice
        send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()
    else:  # rank j gets sequence slice j of our heads
        send = x.reshape(b, h, size, t // size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)  # (cp, B, h', t', D): row j from rank j
    dist.all_to_all_single(received, send, group=group)
    if to_heads:  # row j: sequence slice j
        return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)
    return received.transpose(0, 1).reshape(b, size * h, t // size, d)


class _AllToAll(torch.autograd.Function):
    """The all-to-all as autograd sees it: its backward is the reverse all-to-all."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return _exchange(x, group, to_heads)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _exchange(grad.contiguous(), ctx.group, not ctx.to_heads), None, None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, H, T/cp, D) slices of the sequence -> (B, H/cp, T, D) slices of the heads."""
    return cast(torch.Tensor, _AllToAll.apply(x, group, True))


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(B, H/cp, T, D) slices of the heads -> (B, H, T/cp, D) slices of the sequence."""
    return cast(torch.Tensor, _AllToAll.apply(x, group, False))


def check_heads(heads: int, kv_heads: int, cp: int, *, impl: str, kind: str, tp: int = 1
                ) -> None:
    """Refuse, naming the fix, head counts that do not split over the cp ranks."""
    local, local_kv = heads // tp, kv_heads // tp
    if local % cp or local_kv % cp:
        per = f" per tp rank (tp={tp})" if tp > 1 else ""
        raise ValueError(f"context_parallel={impl!r} splits attention heads over cp={cp}, and "
                         f"{kind} has {local} query and {local_kv} key/value heads{per}; "
                         f"expected both multiples of {cp}: use context_parallel='meshlab' "
                         "(all-gather K/V, any head count), or a cp dividing both")


def refuse_head_parameters(model: nn.Module, *, impl: str) -> None:
    """Refuse attention layers holding parameters of their own (gpt-oss's per-head
    ``sinks``) that the attention function reads for every head: a rank holding a slice of
    the heads would apply them to the wrong ones."""
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and hasattr(module, "num_key_value_groups"):
            raise ValueError(f"context_parallel={impl!r} gives each cp rank a slice of the "
                             f"heads, and {name} ({type(module).__name__}) has parameters "
                             f"its attention function reads for all heads ({', '.join(own)}); "
                             "use context_parallel='meshlab' (all-gather K/V keeps every "
                             "head on every rank)")


def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any, attend: Attend
            ) -> torch.Tensor:
    """Attention of local (B, H, T/cp, D) slices, heads split over ``group``: (B, H, T/cp, D)
    out; k and v may have fewer heads (grouped-query attention)."""
    out = attend(seq_to_heads(q, group), seq_to_heads(k, group), seq_to_heads(v, group))
    return heads_to_seq(out, group)


def meshlab_core(group: Any, repeat: int, attend: Attend) -> Callable[..., torch.Tensor]:
    """meshlab's Attention.core under Ulysses: its k and v come repeated to the query heads
    (``repeat`` = n_heads / n_kv_heads); only one of each group crosses the wire."""

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def grouped(qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
            if repeat > 1:
                kh, vh = kh.repeat_interleave(repeat, dim=1), vh.repeat_interleave(repeat, dim=1)
            return attend(qh, kh, vh)

        return ulysses(q, k[:, ::repeat], v[:, ::repeat], group, grouped)

    return core
