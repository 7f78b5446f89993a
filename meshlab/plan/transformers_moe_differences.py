"""What a transformers MoE model's layers keep for their backward beside the planner's count:
the activations row's terms for meshlab.plan.activation_differences, where the dry run ran
transformers' own code (DeepSeek-V3's, Qwen's, Mixtral's: grouped experts with gate and up
in one weight, shared experts, a router; DeepSeek's multi-head latent attention and first
dense layers). Each is a fact of that code as fused kernels run it, computed from the
model's shape and the layout; none is fitted.

Per routed token-expert pair, transformers' experts keep what the planner counts for an MoE
layer (Megatron's): the token's copy, gate and up's output, their product and the expert's
output, 2 h + 3 f / tp. What differs is around them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlab.plan.differences import Differences


def held_terms(known: Differences, tokens: float) -> list[tuple[str, float]]:
    """Per layer of this rank's (averaged over them) and micro-batch in flight, what a
    transformers MoE model keeps beyond the planner's count."""
    m, lay, act = known.model, known.layout, known.dt.activations
    t, k, h = lay.tp, m.top_k, m.hidden
    dense = known.dense_layers / known.layers  # of this rank's layers, plain feed-forward
    moe = 1 - dense
    share = (m.layers - m.dense_layers) / m.layers  # the planner's routed average
    out = []
    if m.kv_lora_rank:
        n = known.heads
        qk, v, rope = m.head_width, m.v_head_dim or m.head_width, m.rope_head_dim
        kv, q_lora = m.kv_lora_rank, m.q_lora_rank
        # the latents and their norms' outputs, keys' nope part and values as kv_b projects
        # them, queries and keys with their rotary parts, the attention's output
        mla = (2 * q_lora + kv + rope + kv + n * (qk - rope + v) + 2 * n * qk + n * v)
        counted = 2 * (m.heads + m.n_kv_heads) * m.head_width / t  # Q, K, V, output: 2q + 2kv
        out.append(("multi-head latent attention keeps its latents (q's and kv's) and their "
                    "norms' outputs, kv_b's keys and values, the queries and keys with their "
                    "rotary parts and the output"
                    + (", every head on every tp rank" if n == m.heads and t > 1 else "")
                    + ", where the planner counts Q, K, V and the output",
                    act * tokens * (mla - counted)))
        norms = (1 if q_lora else 0) + 1
        out.append((f"MLA's {norms} latent norms' statistics, fp32 per token",
                    4.0 * tokens * norms))
    if dense:
        wide = 3 if m.gated_ffn else 2
        out.append((f"{known.dense_layers} of this rank's {known.layers} layers with a plain "
                    f"feed-forward {m.dense_ffn or m.ffn} wide, where the planner counts top_k "
                    "experts and their routed copies",
                    dense * act * tokens * wide * ((m.dense_ffn or m.ffn) - k * m.ffn) / t))
    # the routed copies (2 h a pair) on MoE layers only, where the planner averages them
    out.append(("each token's copies and the experts' outputs kept on the MoE layers only "
                "(the planner averages them over every layer)",
                act * tokens * 2 * k * h * (moe - share)))
    if moe and m.shared_ffn:
        wide = 3 if m.gated_ffn else 2
        out.append(("the shared experts keep gate's and up's outputs and their product",
                    moe * act * tokens * wide * m.shared_ffn / t))
    if moe:
        # the router's fp32 scores and its normalized top-k, the pairs' sort order and
        # indices (int64), the experts' weights per pair
        pairs = tokens * k
        out.append(("the router's fp32 scores and top-k, and the routed pairs' indices",
                    moe * (tokens * (4 * m.experts + 4 + 12 * k) + pairs * 40)))
    return out


def combine_transient(known: Differences, tokens: float) -> float:
    """What a stage's last MoE layer holds, beyond the micro-batch's saved tensors, when
    expert parallelism (meshlab.parallel.expert.exchange) adds its experts' outputs back
    into the tokens in the forward: the pairs sent, arrived, the experts' outputs and them
    weighted (4 x pairs x hidden) and the sum it adds into (tokens x hidden), the shared
    experts not yet run. 0 where the stage's last layer is not an MoE layer under ep."""
    m, lay = known.model, known.layout
    if lay.ep == 1 or known.dense_layers == known.layers:
        return 0.0
    shared = (3 if m.gated_ffn else 2) * m.shared_ffn / lay.tp
    return known.dt.activations * tokens * (4 * m.top_k * m.hidden + m.hidden - shared)
