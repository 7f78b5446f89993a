"""Mixture of experts: a linear router picks top_k SwiGLU experts per token.

Experts are stored stacked (E, ...) so expert parallelism can keep a slice of them and
install its own ``dispatch`` (the model never imports a parallelism). The layer records how
many tokens each expert got (load-balancing statistics).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from meshlab.models.config import ModelConfig


class _IndexAddRows(torch.autograd.Function):
    """``out.index_add(0, index, rows)`` whose backward keeps only ``index``: torch's
    index_add keeps ``rows`` too (its backward reads their shape), a copy of every token's
    hidden state for each of its top_k experts, held until the backward."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
                ) -> torch.Tensor:
        ctx.save_for_backward(index)
        return out.index_add(0, index, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None,
                                                       torch.Tensor | None]:
        (index,) = ctx.saved_tensors
        rows = grad.index_select(0, index) if ctx.needs_input_grad[2] else None
        return (grad if ctx.needs_input_grad[0] else None), None, rows


def index_add_rows(out: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
                   ) -> torch.Tensor:
    """``out.index_add(0, index, rows)``, the same values and gradients, keeping only the
    index for the backward (the experts' weighted outputs summed back into their tokens)."""
    return cast(torch.Tensor, _IndexAddRows.apply(out, index, rows))


class MoE(nn.Module):
    """Top-k routed SwiGLU experts."""

    tokens_per_expert: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_hidden, cfg.dim))
        self.w3 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_hidden, cfg.dim))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_hidden))
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_experts, dtype=torch.long),
                             persistent=False)
        self.reset_parameters()
        # Set by expert parallelism (meshlab.parallel.expert): (self, tokens, expert ids,
        # weights) -> combined outputs, each pair run on the rank that holds its expert.
        self.dispatch: Callable[[MoE, torch.Tensor, torch.Tensor, torch.Tensor],
                                torch.Tensor] | None = None
        self._slices: tuple[tuple[torch.Tensor, ...], ...] = ()  # forward's (see there)

    def reset_parameters(self) -> None:
        """Experts drawn from N(0, 1/fan_in); the routing counts zeroed."""
        with torch.no_grad():
            for w in (self.w1, self.w3, self.w2):
                w.normal_(0.0, w.shape[-1] ** -0.5)
        self.tokens_per_expert.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, dim) tokens -> top-k expert ids (N, k) and their weights (N, k)."""
        scores = self.router(x).to(torch.promote_types(x.dtype, torch.float32))
        weights, experts = scores.topk(self.top_k, dim=-1)
        weights = F.softmax(weights, dim=-1).type_as(x)
        self.tokens_per_expert += torch.bincount(experts.flatten(),
                                                 minlength=self.n_experts).detach()
        return experts, weights

    def experts(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Expert ``expert`` (a local index) applied to tokens x (n, dim), within forward."""
        w1, w3, w2 = (w[expert] for w in self._slices or (self.w1, self.w3, self.w2))
        return F.silu(x @ w1.T) * (x @ w3.T) @ w2.T

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Each stacked weight split once a forward: unbind's backward stacks the experts'
        # gradients once, where indexing it per expert made a whole-size gradient for each
        # expert and summed them (a stacked weight's size more held in the backward)
        self._slices = tuple(w.unbind(0) for w in (self.w1, self.w3, self.w2))
        try:
            return self._forward(x)
        finally:
            self._slices = ()

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        experts, weights = self.route(tokens)
        if self.dispatch is not None:
            out = self.dispatch(self, tokens, experts, weights)
        else:
            out = torch.zeros_like(tokens)
            for e in range(self.n_experts):
                rows, slot = (experts == e).nonzero(as_tuple=True)
                if rows.numel():
                    out = index_add_rows(out, rows,
                                         self.experts(tokens[rows], e) * weights[rows, slot, None])
        # Every expert takes part in every step (a zero term if it got no tokens), so each one
        # has a gradient and AdamW treats them alike, sharded or not.
        out = out + 0.0 * (self.w1.sum() + self.w2.sum() + self.w3.sum())
        return out.reshape(shape)
