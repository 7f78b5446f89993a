"""One GPU of the busiest pipeline stage: the layers, tokens and parameters it works on.

Memory, compute and communication are all estimated from a ``Stage``: the first stage holds
the most micro-batches in flight, the last the output projection; the estimate takes the
worse of each, so a Stage has ceil(layers / pp) layers and (past one stage) one vocab x
hidden matrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from meshlab.plan.hardware import Hardware
from meshlab.plan.layout import Layout, Precision
from meshlab.plan.shapes import ModelShape


@dataclass(frozen=True)
class Stage:
    """What one GPU of the busiest stage runs: ``model`` split by ``layout`` on ``hardware``."""

    model: ModelShape
    layout: Layout
    hardware: Hardware

    @property
    def dtypes(self) -> Precision:
        return self.layout.dtypes

    @cached_property
    def layers(self) -> int:
        """Layers on the busiest stage."""
        return math.ceil(self.model.layers / self.layout.pp)

    @cached_property
    def seq(self) -> int:
        """Tokens of one sequence on one rank (cp splits the sequence)."""
        return self.model.seq_len // self.layout.cp

    @cached_property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return self.layout.micro_batch * self.seq

    @cached_property
    def params(self) -> tuple[float, float]:
        """(dense, expert) parameters one GPU holds before ZeRO sharding."""
        m, lay = self.model, self.layout
        expert = m.experts * m.expert_params * self.layers / lay.tp / lay.ep if m.experts else 0
        dense_layer = m.layer_params - (m.experts * m.expert_params if m.experts else 0)
        dense = self.layers * dense_layer / lay.tp
        if lay.pp == 1:
            dense += m.embedding_params / lay.tp
        else:  # the first stage holds the embedding, the last the output: about the same
            dense += m.vocab * m.hidden / lay.tp
        return dense, expert

    def not_hidden(self, comm_s: float, compute_s: float) -> float:
        """What of ``comm_s`` does not hide behind ``compute_s`` (on CPU ranks: all of it)."""
        return max(0.0, comm_s - compute_s) if self.hardware.asynchronous else comm_s
