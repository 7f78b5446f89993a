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
from meshlab.plan.layout import Layout
from meshlab.plan.precision import Precision
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

    @property
    def reduce_bytes(self) -> int:
        """Bytes of one gradient element as the data-parallel reductions move it."""
        return 4 if self.layout.reduce_fp32 else self.dtypes.grads

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

    @property
    def fsdp_units_kept(self) -> bool:
        """Under a pipeline, FSDP2's units stay gathered and their gradients unsharded from
        a stage's first micro-batch to its last (torch's PipelineStage neither reshards nor
        reduces until the last backward; torchtitan and meshlab do not reshard after the
        forward): one all-gather and one reduce-scatter of each unit a step. ZeRO-3 with
        per-layer units (FSDP2's) only: ZeRO-2 is Llama 3's FSDP, as the paper ran it."""
        lay = self.layout
        return lay.pp > 1 and lay.zero == 3 and lay.shard_unit == "layer"

    @property
    def fsdp_reduces_once(self) -> bool:
        """ZeRO-2/3 gradients reduce-scattered once a step, after the last micro-batch, where
        the layout says so (``reduce_once``: meshlab's accumulation, Megatron's distributed
        optimizer, torch's PipelineStage); else every micro-batch's (FSDP2's default, and
        meshlab's ParallelPlan.reduce_every_microbatch under a pipeline)."""
        return self.layout.reduce_once

    @cached_property
    def shard_units(self) -> list[float]:
        """Parameters of each unit FSDP gathers at once, in a layer's order, on one GPU: the
        layer (FSDP2 wraps each block, as torchtitan does), or each weight matrix (DeepSpeed
        ZeRO-3 and FSDP1 wrapping every Linear: QKV, output, MLP in, MLP out)."""
        m, lay = self.model, self.layout
        if lay.shard_unit == "layer":
            return [m.layer_params / lay.tp]
        q, kv = m.heads * m.head_width, m.n_kv_heads * m.head_width
        up = m.ffn * (2 if m.gated_ffn else 1)
        return [m.hidden * w / lay.tp for w in (q + 2 * kv, q, up, m.ffn)]

    @property
    def shard_unit_params(self) -> float:
        """The largest unit FSDP gathers (its buffers' size)."""
        return max(self.shard_units)

    def not_hidden_units(self, comm_s: float, compute_s: float) -> float:
        """``not_hidden`` for FSDP, unit by unit: the next unit's gather runs behind this
        unit's compute, so a big unit after a small one waits even when the totals match.
        ``comm_s`` and ``compute_s`` are a layer's, shared out by the units' sizes."""
        if not self.hardware.asynchronous:
            return comm_s
        units = self.shard_units
        total = sum(units)
        exposed = sum(max(0.0, comm_s * units[(i + 1) % len(units)] / total
                          - compute_s * u / total) for i, u in enumerate(units))
        return exposed + self.hardware.overlap_cost * (comm_s - exposed)

    def not_hidden(self, comm_s: float, compute_s: float) -> float:
        """What ``comm_s`` of communication running behind ``compute_s`` adds: the part
        that does not fit behind it, and the hardware's ``overlap_cost`` share of the part
        that does (its kernels slow the math). On CPU ranks: all of it."""
        if not self.hardware.asynchronous:
            return comm_s
        return max(0.0, comm_s - compute_s) + self.hardware.overlap_cost * min(comm_s,
                                                                              compute_s)
