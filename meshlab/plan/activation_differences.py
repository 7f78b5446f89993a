"""What the planner's activations (Korthikanti's count) and a dry run's with fused kernels
(meshlab.dry_run.fused_memory) count differently, each with its bytes, for one rank: the known
differences meshlab.plan.reconcile applies to the activations row. Each is a fact of the
schedule or of torch's implementation, computed from the model's shape and the layout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlab.plan import moe_activation_differences as moe_terms
from meshlab.plan import transformers_moe_differences as transformers_moe
from meshlab.plan.memory import layer_bytes, loss_bytes
from meshlab.plan.pipeline import inflight_of

if TYPE_CHECKING:
    from meshlab.plan.differences import Differences


HAND_WRITTEN = ("not compared for a hand-written model: its shape is read from its modules, "
                "and its own code (its TP plan, its root modules, its loss) is not yet "
                "reconciled with the planner's")


TRANSFORMERS_MOE_UNSPLIT = (
    "not compared for transformers' MoE layers without expert parallelism: every expert on "
    "every rank, FSDP2's units and the experts' backward not yet reconciled (under ep they "
    "are: transformers_moe_differences)")


def not_reconciled(known: Differences) -> str:
    """Why the activations row of ``known``'s rank is not compared ("" where it is): the
    layouts whose activations these terms do not yet account for."""
    lay, m = known.layout, known.model
    if known.dry.family == "other":
        return HAND_WRITTEN
    if m.experts and known.dry.family != "meshlab" and lay.ep == 1:
        return TRANSFORMERS_MOE_UNSPLIT
    if known.mixed and not known.fsdp:
        return ("not compared under autocast (16-bit compute without FSDP2): the 16-bit copy "
                "of every weight it keeps for each micro-batch in flight and its fp32 "
                "residual stream are not yet reconciled")
    if lay.cp > 1:
        return ("not compared under context parallelism: the ring's and the gathered keys' "
                "and values' buffers are not yet reconciled")
    if lay.recompute not in ("none", "full") or lay.offload_activations:
        return ("not compared with selective or per-op recomputation or offloaded "
                "activations: what they keep and recompute is not yet reconciled")
    return ""


def activation_terms(known: Differences, planner: float) -> list[tuple[str, float]]:
    """The activations row's differences for ``known``'s rank: what it holds at its peak
    (the micro-batches in flight on its stages, with what torch keeps beside Korthikanti's
    count), and the one transient the peak falls in (the loss's backward on the last stage,
    the embedding's gradient on the first, else the MLP's backward)."""
    lay, m, stage, dt = known.layout, known.model, known.stage, known.dt
    logits = loss_bytes(stage)  # the planner's
    chunk = stage.layers / lay.stages_per_rank
    pp_rank = known.run.coordinates.get("pp", 0)
    busiest = inflight_of(lay.schedule, lay.pp, lay.microbatches, lay.virtual, 0)
    inflight = inflight_of(lay.schedule, lay.pp, lay.microbatches, lay.virtual, pp_rank)
    layers = known.layers / len(known.run.stages)  # a chunk of this rank's
    out: list[tuple[str, float]] = []
    full = lay.recompute == "full"
    # what a layer keeps for each micro-batch in flight (under full recomputation its
    # input), and what the layer being recomputed saves again (the planner counts one)
    recomputed = layer_bytes(stage, "none") if full else 0.0
    per_layer = (planner - logits - recomputed) / (chunk * busiest)
    if (layers, inflight, known.last) != (chunk, busiest, True):
        mine = per_layer * layers * inflight + recomputed + logits * known.last
        out.append((f"this rank holds {inflight} micro-batches of {layers:g} layers"
                    + (" and the logits" if known.last else "")
                    + f"; the planner's busiest stage {busiest} of {chunk:g} and the logits",
                    mine - planner))
    if lay.recompute != "none" and not full:
        return out
    if full:
        out.append(("the layer being recomputed saves again what it kept (its input): "
                    "once, not twice", -per_layer))
    tokens = lay.micro_batch * m.seq_len / lay.cp  # a tp rank's, gathered
    sp = lay.tp > 1 and lay.sequence_parallel
    act = dt.activations
    split = lay.tp if sp and known.dry.family == "meshlab" else 1  # the stream between stages
    boundary = tokens * m.hidden * act / split
    received = receive_buffers(known, boundary)
    if received:
        out.append(("torch's pipeline stage allocates a buffer per micro-batch for what it "
                    "receives: the stage's input, and its output's gradient", received))
        # a micro-batch in flight on a stage fed by another rank: its first layer's saved
        # input is that buffer, counted once
        fed = [s for s in known.run.stages if s > 0 and s - 1 not in known.run.stages]
        if fed:
            out.append(("a micro-batch in flight keeps its received input as its first "
                        "layer's: counted once",
                        -inflight * boundary * len(fed) / len(known.run.stages)))
    kept = []  # beside Korthikanti's count, per layer and micro-batch
    kept.append(("FlashAttention's log-sum-exp, fp32 per query head and token",
                 4.0 * known.heads * tokens))
    kept.append(("a fused norm's statistic, fp32 per token (two norms a layer)",
                 2 * 4.0 * tokens / (lay.tp if sp else 1)))
    if known.dry.qk_norm:  # per head: the projections' outputs, and a statistic each
        heads = known.heads * (1 + m.n_kv_heads / m.heads)
        kept.append(("the attention's query and key norms keep the projections' outputs and "
                     "an fp32 statistic per head and token",
                     tokens * heads * (m.head_width * act + 4.0)))
    moe = m.experts and known.dry.family == "meshlab"
    if moe:
        share = (m.layers - m.dense_layers) / m.layers  # as moe_routed_bytes averages
        kept += [(what, b * share) for what, b in moe_terms.held_terms(known, tokens)]
    elif m.experts:
        kept += transformers_moe.held_terms(known, tokens)
    # under full recomputation only the layer being recomputed keeps them
    out += [(what, b * (1 if full else layers * inflight)) for what, b in kept]
    if known.dry.family == "transformers":  # the model's, once a micro-batch and stage
        rope = m.rope_head_dim or m.head_width
        out.append(("transformers' rotary angles, cos and sin, computed once a micro-batch",
                    inflight * len(known.run.stages) * 2 * tokens * rope * act))
    ffn = m.ffn * (m.top_k if m.experts else 1) / lay.tp
    # what a layer saved, one micro-batch (recomputed: all it saves, its input counted)
    one_layer = (recomputed if full else per_layer) + sum(b for _, b in kept)
    mlp = (moe_terms.backward_peak(known, tokens) if moe
           else layer_backward_bytes(known, tokens, ffn, one_layer))
    # the last stage's peak: the loss's backward, over before the MLP's begins
    logit = 12 + (act if lay.pp > 1 else 0)  # a pipeline stage keeps its output too
    loss = tokens * m.vocab * logit if known.last else 0.0  # tp gathers them whole
    # beside it, what the final norm and the output projection saved: their inputs (the
    # norm's this rank's part of the sequence, the projection's gathered whole)
    ends = tokens * m.hidden * act * (1 / split + 1) if known.last else 0.0
    # the first stage's: the embedding's gradient, its tp rows (FSDP holds it until its
    # post-backward), its micro-batch's layers freed
    one = (per_layer if full else one_layer) * layers
    rows = m.vocab / lay.tp * m.hidden
    embedding = rows * dt.grads - one if known.first and known.fsdp else 0.0
    # recomputed, a layer saves its all only in its own backward: not yet at the loss's,
    # no more at the embedding's
    away = one_layer - per_layer if full else 0.0
    # without FSDP or tp, the output projection's backward after the loss's: the logits'
    # fp32 gradient (and the logits a stage keeps), its weight's gradient before .grad
    # takes it, and its input's
    head = (tokens * m.vocab * (4 + (act if lay.pp > 1 else 0))
            + m.vocab * m.hidden * (4.0 if known.mixed else dt.grads) + tokens * m.hidden * act
            if known.last and lay.tp == 1 and not known.fsdp else 0.0)
    # a stage before the last under ep: the last micro-batch in flight's forward, at its
    # last MoE layer's combine, before any of their backwards took the gradient buffers
    forward = 0.0
    if m.experts and not moe and not known.last and not full:
        combine = transformers_moe.combine_transient(known, tokens)
        outputs = (inflight - 1) * 2 * boundary  # earlier micro-batches' outputs, and sent
        unreceived = -inflight * boundary if received else 0.0
        forward = combine + outputs + unreceived if combine else 0.0
    peak = max(mlp, loss + ends - away, head + ends - away, embedding - away, forward)
    if full and peak != mlp:
        out.append(("the layer recomputed in its backward, not there then", -away))
    if peak == head + ends - away:
        out.append(("the final norm's and the output projection's inputs, saved for the "
                    "loss's backward", ends))
        out.append(("the output projection's backward: the logits' fp32 gradient"
                    + (" and the logits the stage keeps" if lay.pp > 1 else "")
                    + ", its weight's gradient (before .grad takes it) and its input's",
                    head - logits))
    elif peak == loss + ends - away:  # without loss_parallel the planner counts it as torch does
        out.append(("the final norm's and the output projection's inputs, saved for the "
                    "loss's backward", ends))
        if lay.loss_parallel:
            out.append((f"the loss's backward on {'the gathered ' if lay.tp > 1 else ''}"
                        "logits: their fp32 log-probabilities, its gradient and theirs"
                        + (", and the logits the stage keeps" if lay.pp > 1 else "")
                        + f" ({logit:g} bytes a logit; the planner counts 8 over tp)",
                        loss - logits))
    elif peak == forward:
        out.append(("the last micro-batch in flight's forward at its last MoE layer's "
                    "combine: the pairs sent and arrived, the experts' outputs and them "
                    "weighted, the sum they go into; its shared experts not yet run "
                    "(transformers_moe_differences.combine_transient)", combine))
        if outputs:
            out.append(("each earlier micro-batch in flight's output, and a second tensor of "
                        "its size the dry run's send holds", outputs))
        if unreceived:
            out.append(("the output gradients not yet received for micro-batches in flight",
                        unreceived))
    elif peak == embedding - away:
        out.append(("the embedding's gradient (its tp rows), before FSDP takes it, its "
                    "micro-batch's layers freed", embedding - logits * known.last))
    else:  # the loss's backward is over; a pipeline's last stage still keeps its output
        kept_output = tokens * m.vocab * act if known.last and lay.pp > 1 else 0.0
        where = ("in the MoE layer: its experts' gradients, as unbind's backward stacks them "
                 "or in the first expert's (moe_activation_differences.backward_peak)" if moe
                 else "in the last layer's: the gradients it makes before it frees what it "
                      "read (layer_backward_bytes)")
        out.append((f"the backward at its peak, {where}"
                    + (", and the logits the stage keeps as its output" if kept_output else ""),
                    mlp + kept_output - logits * known.last))
        last_stage = max(known.run.stages) == known.dry.stages - 1
        if received and lay.pp > 1 and last_stage and known.dry.stages - 2 not in known.run.stages:
            # by the last micro-batch's backward the last stage's inputs received for the
            # others are freed
            out.append(("the last stage's inputs received for micro-batches done, freed by "
                        "then", -(lay.microbatches - inflight) * boundary))
    return out


def layer_backward_bytes(known: Differences, tokens: float, ffn: float, saved: float
                         ) -> float:
    """The most the stage's last layer's backward holds at once beyond what the forward
    saved (it runs first, with every micro-batch's saved tensors there; ``saved``: what one
    layer saved), at the highest of four moments, op by op as the dry run records them:

    - the gated product's backward: the down projection's weight gradient, the product's
      gradient, the activation recomputed beside it and the gate's and the up projection's
      gradients as they are made (4 T f), the product itself freed after the down
      projection read it (-T f), and the gradient coming into the layer (T h: made by the
      loss's backward on the last stage; on the others a receive buffer already counted,
      and the stage's output freed: -T h; in 16-bit compute without tp two more, its
      casts);
    - the attention's backward: the MLP's three weight gradients and the output
      projection's, the attention's own working set (its output's gradient, keys and values
      repeated to the query heads and their gradients with the queries': 6 T q on torch's
      CPU kernel), the MLP's saved tensors and its norm's input freed;
    - the query, key and value projections' backward: the input's gradient from each and
      their sum (4 T h, gathered under sequence parallelism), the queries' and their
      gradients (3 T q), every weight gradient of the layer, only the first norm's input
      left of what the layer saved;
    - the first norm's backward, op by op in fp32: every weight gradient of the layer, 6
      fp32 temporaries of its tokens x hidden (8 in 16-bit compute, its input and its
      gradient upcast), the layer's saved tensors freed.

    Weight gradients count where FSDP holds them until its post-backward (torch's tracker
    calls them temporaries until then): the layer's, and on the last stage the output
    projection's, held from the loss's backward to the root's post-backward; elsewhere they
    are in .grad at once."""
    m, lay, dt = known.model, known.layout, known.dt
    h, f, t, act = m.hidden, ffn, tokens, dt.activations
    q, kv = (n * m.head_width / lay.tp for n in (m.heads, m.n_kv_heads))
    weights = dt.grads if known.fsdp else 0.0
    gated = 3 if m.gated_ffn else 2
    normed = t / (lay.tp if lay.tp > 1 and lay.sequence_parallel else 1)  # the stream's
    stage_end = 0 if known.last else normed * h  # the stage's output, freed
    layer_weights = (gated * h * f + 2 * h * (q + kv)) * weights
    # in 16-bit compute without tp the incoming gradient is there twice more, cast to the
    # blocks' dtype (measured; under tp its gather takes their place)
    incoming = t * h * (3 if act < 4 and lay.tp == 1 else 1)
    product = h * f * weights + (gated * t * f + incoming - 2 * stage_end) * act
    freed = gated * t * f + t * h + stage_end  # the MLP's, the norm's input
    attention = (gated * h * f + h * q) * weights + (6 * t * q - freed) * act
    # the projections' input gradients summed, gathered whole under sp; by then only the
    # first norm's input is left of what the layer saved
    projections = layer_weights + (4 * t * h + 3 * t * q - stage_end) * act - (
        saved - normed * h * act)
    upcast = 6 if act >= 4 else 8
    norm = layer_weights + upcast * normed * h * 4 - saved - stage_end * act
    output = m.vocab / lay.tp * h * weights if known.last else 0.0
    return max(product, attention, projections, norm) + output


def receive_buffers(known: Differences, boundary: float) -> float:
    """Bytes of the buffers torch's pipeline stages on this rank receive into: one per
    micro-batch for each stage's input (unless the stage before is on this rank) and for
    its output's gradient (unless the stage after is); ``boundary``: one of them."""
    stages, last = known.run.stages, known.dry.stages - 1
    ends = sum((s > 0 and s - 1 not in stages) + (s < last and s + 1 not in stages)
               for s in stages)
    return ends * known.layout.microbatches * boundary
