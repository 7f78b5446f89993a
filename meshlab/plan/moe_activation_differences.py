"""What meshlab's MoE layer (meshlab.models.moe: SwiGLU experts, three stacked weights) keeps
for its backward beyond the planner's count of a dense MLP top_k times as wide, and the
transient its backward peaks in: the activations row's MoE terms for
meshlab.plan.activation_differences. Each is a fact of the layer's code, computed from the
model's shape and the layout; none is fitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlab.plan.differences import Differences


def expert_weights(known: Differences) -> float:
    """Elements of one MoE layer's experts on this rank: its ep share, whole on every tp
    rank (meshlab's MoE is not split by tp)."""
    m = known.model
    return m.experts // known.layout.ep * m.expert_params


def saved_bytes(known: Differences, tokens: float) -> float:
    """What one MoE layer keeps for one micro-batch, as fused kernels keep it, whole on
    every tp rank: its input, each token's copy for each of its experts and each expert's
    output (moe_routed_bytes), and the experts' intermediates (SwiGLU's gate, up projection
    and product for each token-expert pair)."""
    m, act = known.model, known.dt.activations
    pairs = tokens * m.top_k
    return act * (tokens * m.hidden + 2 * pairs * m.hidden + 3 * pairs * m.ffn)


def held_terms(known: Differences, tokens: float) -> list[tuple[str, float]]:
    """Per MoE layer and micro-batch in flight, what meshlab's MoE keeps beyond the planner's
    count: under tp the whole sequence's (the planner splits the MLP's intermediates and,
    under sequence parallelism, its input)."""
    lay, m, act = known.layout, known.model, known.dt.activations
    if lay.tp == 1:
        return []
    split = 3 * tokens * m.top_k * m.ffn * act
    if lay.sequence_parallel:
        split += tokens * m.hidden * act
    return [("meshlab's MoE is not split by tp: it keeps the whole sequence's intermediates "
             "where the planner counts its tp share", split * (1 - 1 / lay.tp))]


def backward_peak(known: Differences, tokens: float) -> float:
    """The most an MoE layer's backward holds at once beyond what the forward saved, the
    larger of two moments. In the first expert's backward, after its down projection: the
    layer's input gradient, that weight's gradient, and the SwiGLU product's backward on
    the expert's token-expert pairs (its output gradient, the gate's and the up
    projection's, less the product it frees), large where few local experts take many
    pairs each. After every expert's: the gradients of each expert's slice of the stacked
    weights (kept until unbind's backward stacks them) and one weight's stacked copy, 4/3
    of the experts' weights, and the input gradient; the layer's own saved tensors are
    freed by then. FSDP2 keeps the output projection's gradient unsharded until its root
    unit's post-backward, the end of the backward. Gradients are as wide as activations
    where this is compared (not_reconciled: fp32, or FSDP2's unsharded gradients in bf16)."""
    m, act = known.model, known.dt.activations
    pairs = tokens * m.top_k / (m.experts // known.layout.ep)  # an expert's, evenly routed
    first = (m.hidden * m.ffn + 3 * pairs * m.ffn) * act
    stacked = 4 / 3 * expert_weights(known) * act - saved_bytes(known, tokens)
    output = m.vocab / known.layout.tp * m.hidden * act if known.fsdp and known.last else 0.0
    return max(first, stacked) + tokens * m.hidden * act + output
