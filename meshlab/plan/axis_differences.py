"""The tp and ep rows of the reconciliation: what crosses the tensor- and expert-parallel
axes in torch (and meshlab, and transformers' TP plans) beside what the planner counts
(Megatron's), each difference with its bytes: functions of meshlab.plan.differences'
Differences."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshlab.plan.differences import Differences


def tp_terms(known: Differences, planner: float) -> list[tuple[str, float]]:
    lay, m, dt, mb = known.layout, known.model, known.dt, known.layout.microbatches
    out: list[tuple[str, float]] = []
    if known.layers != known.stage.layers:
        out.append((f"this rank holds {known.layers} layers, the planner's busiest stage "
                    f"{known.stage.layers}", planner * (known.layers / known.stage.layers - 1)))
    sp = lay.sequence_parallel
    ends = known.first + known.last
    if ends:
        out.append(("the embedding's output and the output projection's input cross tp "
                    "too", (2 if sp else 1) * ends * known.act * mb))
    if known.last:
        out.append(("the logits are gathered whole on every tp rank (no loss parallel)",
                    float(mb * known.tokens * m.vocab * dt.activations)))
    if sp:
        norms = 2 * known.layers + known.last
        size = 4.0 if known.mixed and not known.fsdp else dt.grads  # autocast: fp32 weights
        out.append(("the sequence-parallel norms' weight gradients are all-reduced",
                    float(norms * m.hidden * size)))
    else:
        out.append(("torch reduces each column-parallel projection's input gradient on its "
                    "own (q, k, v; gate, up): 5 all-reduces a layer's backward, where "
                    "Megatron's fused projections do 2", 3.0 * known.layers * known.act * mb))
    if known.mixed and not known.fsdp:
        # autocast: the residual stream (embedding, norms) stays fp32; only the matmuls'
        # outputs and their gradients are bf16
        # without sp: q, k, v's input gradients, and the MLP's two (gate and up; a
        # transformers MoE's output and its gate_up's input gradient, all fp32)
        fp32 = (2 * (2 * known.layers + ends) if sp else
                known.layers * (3 + (0 if known.whole_experts else 2)) + ends)
        if sp and lay.sp_regather:  # the parts gathered again (an MoE keeps its whole)
            fp32 += known.layers * (1 if known.whole_experts else 2)
        out.append(("autocast keeps the residual stream in fp32: what crosses tp from the "
                    "embedding and the norms (or back to them) is fp32",
                    fp32 * known.act * mb * (4 / dt.activations - 1)))
    moe = known.layers - known.dense_layers
    if m.experts and known.dry.family == "transformers" and not sp:
        out.append(("transformers' experts hold gate and up in one weight (gate_up_proj): "
                    "one all-reduce of their input gradient, not two",
                    -1.0 * moe * known.act * mb))
        if m.shared_ffn:
            out.append(("transformers' shared experts are an MLP of their own: its output "
                        "all-reduced, and its gate's and up's input gradients",
                        3.0 * moe * known.act * mb))
    if known.whole_attention and not sp:
        out.append((f"{known.dry.model}'s TP plan leaves the attention whole: nothing "
                    "crosses tp around it (its output, q's, k's and v's input gradients)",
                    -4.0 * known.layers * known.act * mb))
    if known.whole_experts and sp:
        again = lay.sp_regather  # and keeps what it gathered: nothing to gather again
        out.append(("meshlab's MoE gathers the whole sequence in each way and hands back "
                    "its part: no reduce-scatter around it"
                    + (", and no re-gather in the backward" if again else ""),
                    -(3.0 if again else 2.0) * known.layers * known.act * mb))
    elif known.whole_experts:
        out.append(("meshlab's MoE is not split by tp: nothing is all-reduced around it "
                    "(no gate and up input gradients either)",
                    -3.0 * known.layers * known.act * mb))
    return out


def ep_terms(known: Differences, planner: float) -> list[tuple[str, float]]:
    lay, out = known.layout, []
    moe = known.layers - known.dense_layers
    if moe != known.stage.layers:
        dense = f" ({known.dense_layers} with a plain feed-forward)" if known.dense_layers else ""
        out.append((f"this rank holds {moe} MoE layers{dense}, the planner's busiest "
                    f"stage {known.stage.layers}", planner * (moe / known.stage.layers - 1)))
        planner *= moe / known.stage.layers
    if lay.tp > 1:
        out.append(("the MoE routes the whole sequence on every tp rank (meshlab's gathers "
                    "it from sequence parallelism): tp times the tokens",
                    planner * (lay.tp - 1)))
        planner *= lay.tp
    if known.mixed and known.dry.family == "meshlab":
        # the tokens and their gradients leave in the stream's dtype, the experts' outputs
        # and theirs return in the matmuls' bf16: half the calls in fp32
        out.append(("autocast keeps the residual stream in fp32: tokens are dispatched "
                    "(and their gradients return) in fp32", planner / 2
                    * (4 / known.dt.activations - 1)))
    elif known.mixed:
        out.append(("autocast keeps the residual stream in fp32, and transformers' grouped "
                    "experts compute in their weights' fp32: every all-to-all is fp32",
                    planner * (4 / known.dt.activations - 1)))
    return out
