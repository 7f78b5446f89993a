"""Context parallel proved on a probe batch before it trains: the whole model's output on a
probe sequence, in this process, before CP is installed, beside what the cp ranks give for
their slices of it after; any rank's slice that differs beyond its dtype's rounding refuses
the split on every rank alike, naming the rank and how far. It catches what a model does by
position that CP's slices do not keep (a position counted from each slice's start, a mask CP
does not rebuild), whatever the model: the refusals by name (context.py) say why for the
cases known."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.parallel.pipeline_stage import output_of, probe

TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4}  # otherwise half types: 5e-2
"""Of the output's largest magnitude: CP only reorders the attention's sums (measured 1e-15
of it in float64, 1e-7 in float32, and in a float64 model that computes its norms in float32
too); a position gone wrong moves it by 1e-2 and more."""


class Proof:
    """The whole model's output on a probe batch, taken before CP is installed."""

    def __init__(self, model: nn.Module, size: int) -> None:
        self.tokens = probe(model, 4 * size)
        with torch.no_grad():
            self.expected = output_of(model(self.tokens))

    @staticmethod
    def possible(model: nn.Module) -> bool:
        """A whole model (not a pipeline stage) with real weights and an embedding."""
        weights = list(model.parameters())
        return ("causal_lm" not in model.__dict__ and bool(weights)
                and not any(p.is_meta for p in weights)
                and any(isinstance(m, nn.Embedding) for m in model.modules()))

    def check(self, model: nn.Module, kind: str, group: Any, rank: int, size: int) -> None:
        """Every cp rank's slice of the output against the whole one's; ValueError on every
        rank (they agree through one all-gather) when any differs."""
        with torch.no_grad():
            got = output_of(model(self.tokens.chunk(size, dim=1)[rank]))
        mine = self.expected.chunk(size, dim=1)[rank]
        scale = self.expected.abs().max().clamp_min(1e-30)
        error = torch.tensor([float((got - mine).abs().max() / scale)
                              if got.shape == mine.shape else float("inf")])
        errors = [torch.empty_like(error) for _ in range(size)]
        dist.all_gather(errors, error, group=group)
        worst = max(range(size), key=lambda r: float(errors[r]))
        tolerance = TOLERANCE.get(self.expected.dtype, 5e-2)
        if float(errors[worst]) > tolerance:
            raise ValueError(
                f"context parallel on {kind} does not reproduce its own forward on a probe "
                f"sequence of {self.tokens.shape[1]} tokens: cp rank {worst}'s slice differs "
                f"by {float(errors[worst]):.1e} of the output's size (tolerance "
                f"{tolerance:.0e}); the model does something by position that the slices do "
                "not keep (a position counted from its input's start, a mask context "
                "parallel does not rebuild): build the mesh without cp")
