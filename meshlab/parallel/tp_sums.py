"""The two sums tensor parallelism's own styles need beside torch's (meshlab's Conv1D
styles, transformers' replicated-with-gradient-all-reduce): over the tp group in forward,
or in backward."""

from __future__ import annotations

from typing import Any

import torch


class SumInForward(torch.autograd.Function):
    """The sum over ``group`` in forward (partial outputs made whole); identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous()
        torch.distributed.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class SumInBackward(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None
