"""Memory per GPU: ZeRO's parameter, gradient and optimizer bytes, Korthikanti's activations
(counted for the model's own attention, MLP and dropout) times the micro-batches the schedule
keeps in flight, the logits, and communication buffers; and what offloading moves to the
host's memory."""

from __future__ import annotations

from typing import Any

from meshlab.plan.context_formulas import context_parallel_memory
from meshlab.plan.formulas import (
    layer_activation_bytes,
    optimizer_bytes_per_param,
    sharded_state_bytes,
    zero_bytes,
)
from meshlab.plan.layout import Layout
from meshlab.plan.pipeline import accumulating_of
from meshlab.plan.stage import Stage

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


def layer_bytes(stage: Stage, recompute: str) -> float:
    """Activations one layer saves for backward, per micro-batch on one GPU."""
    lay, m = stage.layout, stage.model
    counted = layer_activation_bytes(  # for 2-byte activations
        seq=stage.seq, batch=lay.micro_batch, hidden=m.hidden, heads=m.heads,
        q_width=m.heads * m.head_width, kv_width=m.n_kv_heads * m.head_width,
        ffn=m.ffn * (m.top_k if m.experts else 1), gated=m.gated_ffn, dropout=m.dropout,
        tp=lay.tp, sequence_parallel=lay.sequence_parallel, recompute=recompute,
        scores=not lay.flash_attention, regather=lay.sp_regather)
    return (counted * stage.dtypes.activations / 2 + cp_bytes(stage, recompute)["kept"]
            + moe_routed_bytes(stage, recompute))


def moe_routed_bytes(stage: Stage, recompute: str) -> float:
    """What an MoE layer keeps beyond a dense MLP top_k times as wide, averaged over the
    layers (dense first layers keep none): each token's copy for each of its top_k experts
    and each expert's output the gate multiplies (Megatron's permuted tokens and its
    unpermute's input; meshlab's MoE the same), 2 x top_k x hidden a token. The layer reads
    its input whole under TP; full recomputation keeps only the layer's input."""
    m = stage.model
    if not m.experts or recompute == "full":
        return 0.0
    share = (m.layers - m.dense_layers) / m.layers
    return share * 2 * m.top_k * m.hidden * stage.tokens * stage.dtypes.activations


def optimizer_k(stage: Stage) -> float:
    """zero_bytes' K: the optimizer's state bytes per parameter (fp32 states for AdamW and
    SGD), with 4 B of fp32 master weights where the parameters are 16-bit; AdamW under
    bf16 gives ZeRO's 12, under fp32 8."""
    dt = stage.dtypes
    return optimizer_bytes_per_param(stage.layout.optimizer, master_weights=dt.params < 4)


def weight_shapes(stage: Stage) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """(dense, expert) parameter tensors one GPU of ``stage`` holds before ZeRO sharding,
    as a Llama-style model lays them out (Linear weights out x in, tp-split; experts
    stacked E x out x in), the counts of ``Stage.params``."""
    m, lay = stage.model, stage.layout
    t, h = lay.tp, m.hidden
    q, kv = m.heads * m.head_width // t, m.n_kv_heads * m.head_width // t
    layer: list[tuple[int, ...]] = [(q, h), (kv, h), (kv, h), (h, q), (h,), (h,)]
    experts: list[tuple[int, ...]] = []
    f = m.ffn // t
    ffn: list[tuple[int, ...]] = [(f, h)] * (2 if m.gated_ffn else 1)
    ffn.append((h, f))
    if m.experts:
        layer.append((m.experts, h))
        experts = [(m.experts // lay.ep, *s) for s in ffn] * stage.layers
    else:
        layer += ffn
    dense = layer * stage.layers
    if lay.pp == 1:  # as Stage.params: the ends of the model, or one vocab x hidden matrix
        dense += [(m.vocab // t, h)] * (1 if m.tied_embeddings else 2) + [(h,)]
        dense += [(m.seq_len, h)] if m.learned_positions else []
    else:
        dense.append((m.vocab // t, h))
    return dense, experts


def factored_state_bytes(stage: Stage) -> float:
    """Adafactor's factored second moments and step counters on one GPU (formulas.
    optimizer_state_bytes summed over its tensors, ZeRO-sharded): its K of 0 per parameter
    is an asymptote that a small model's R + C factors per R x C matrix are far from."""
    lay = stage.layout
    if lay.optimizer != "adafactor":
        return 0.0
    dense, experts = weight_shapes(stage)
    # fp32 factors: meshlab steps fp32 parameters (the master weights under bf16)
    return (sharded_state_bytes("adafactor", dense, dp=lay.shard_group, stage=lay.zero)
            + (sharded_state_bytes("adafactor", experts, dp=lay.shard_group // lay.ep,
                                   stage=lay.zero) if experts else 0.0))


def cp_memory(stage: Stage) -> dict[str, float]:
    """context_formulas.context_parallel_memory for one layer of this stage, one micro-batch."""
    lay, m = stage.layout, stage.model
    return context_parallel_memory(
        lay.context_parallel, batch=lay.micro_batch, seq_len=m.seq_len,
        heads=m.heads // lay.tp, kv_heads=m.n_kv_heads // lay.tp, head_dim=m.head_width,
        cp=lay.cp, dtype_bytes=stage.dtypes.activations, chunks=lay.cp_chunks,
        offload=lay.cp_offload)


def cp_bytes(stage: Stage, recompute: str) -> dict[str, float]:
    """What CP changes in one layer's activations beyond Korthikanti's count of this rank's
    slice: ``kept`` per layer (gathered K/V, unfused scores against the whole sequence),
    ``transient`` once (ring chunks, a chunk's scores) and ``host`` per layer (offloaded
    K/V chunks)."""
    lay, m = stage.layout, stage.model
    if lay.cp == 1 or recompute == "full":  # full: only the layer's input is kept
        return {"kept": 0.0, "transient": 0.0, "host": 0.0}
    mem, e = cp_memory(stage), stage.dtypes.activations
    local = 2.0 * lay.micro_batch * stage.seq * (m.n_kv_heads // lay.tp) * m.head_width * e
    kept, transient = mem["kv_kept"] - local, mem["transient"]
    if not lay.flash_attention and recompute == "none":
        # Korthikanti's 2 (5 with dropout) bytes per 16-bit score, counted for L x L
        per_score = (5 if m.dropout else 2) / 2
        counted = lay.micro_batch * m.heads / lay.tp * stage.seq ** 2 * e * per_score
        if lay.context_parallel == "chunked":  # checkpointed chunks keep none
            kept -= counted
            transient += mem["scores"] * per_score
        else:
            kept += mem["scores"] * per_score - counted
    return {"kept": kept, "transient": transient, "host": mem["host"]}


def sharded_params(stage: Stage) -> float:
    """Parameter bytes of this GPU's ZeRO shards (experts sharded outside their ep group)."""
    lay = stage.layout
    dense, expert = stage.params
    return (dense / lay.shard_group + expert / (lay.shard_group // lay.ep)) * stage.dtypes.params


def loss_bytes(stage: Stage) -> float:
    """What the loss's backward holds on the last stage (``Layout.loss_parallel``)."""
    lay, tokens, vocab = stage.layout, stage.tokens, stage.model.vocab
    if lay.loss_parallel:  # fp32 logits and their gradient, vocab-parallel
        return 2 * 4 * tokens * vocab / lay.tp
    return tokens * vocab * (12 + (stage.dtypes.activations if lay.pp > 1 else 0))


def accumulating_share(lay: Layout, pp_rank: int) -> float:
    """The share of its stages pipeline rank ``pp_rank`` accumulates gradients for at once."""
    return accumulating_of(lay.schedule, lay.pp, lay.microbatches, lay.virtual,
                           pp_rank) / lay.stages_per_rank


def accumulated_params(stage: Stage) -> float:
    """Parameters whose gradients the busiest stage, an end stage, accumulates at once: those
    of the stages accumulating together (``accumulating_share``), its root unit (the
    embedding or the output) among them."""
    root = stage.model.vocab * stage.model.hidden / stage.layout.tp
    return (sum(stage.params) - root) * accumulating_share(stage.layout, 0) + root


def accumulation_transient(*, unit: float, root: float, embedding: float, grads: int,
                           reduced: float, mixed: bool) -> float:
    """Bytes of the largest transient beside gradients accumulated under a pipeline: a
    unit's 16-bit gradients (``unit`` elements) before they are added into the fp32 ones,
    the embedding's (``embedding``, this rank's rows of the vocabulary; 0 off the first
    stage) likewise, and the flat copy of the first units reduce-scattered while the
    others are held: the root unit's (``root``), then, its gradients freed, a block's.
    Without mixed precision gradients are added in as they come: the flat copies alone."""
    apart = max(unit, embedding) * grads if mixed else 0.0
    return max(apart, root * reduced, (unit - root) * reduced)


def pipeline_gradients(stage: Stage) -> float:
    """What FSDP2 under torch's PipelineStage holds beside the planner's ZeRO-2/3 buffers
    (``Layout.pipeline_grads_unsharded``; meshlab's expert parallelism reduces in hooks of
    its own), for the busiest stage, an end stage: the stage's gradients accumulated
    unsharded in the dtype they are reduced in, and the peak's transient. Under ZeRO-2 that
    is the largest of a unit's 16-bit gradients before they are added in (the planner's own
    count), the root unit's flat copy reduce-scattered first while the others are held, and
    the embedding's 16-bit gradient (its tp rows: meshlab.parallel.vocab_embedding). ZeRO-3
    counted the gradients unsharded, in their dtype, and keeps a unit's beside."""
    lay, dt, m = stage.layout, stage.dtypes, stage.model
    kept = lay.zero == 2 or (lay.zero == 3 and stage.fsdp_units_kept)  # unsharded all step
    if not (lay.pipeline_grads_unsharded and lay.reduce_once and lay.pp > 1 and kept
            and lay.shard_group > 1 and lay.ep == 1):
        return 0.0
    reduced, params, wider = stage.reduce_bytes, sum(stage.params), stage.reduce_bytes != dt.grads
    root = m.vocab * m.hidden / lay.tp
    if lay.zero == 2:  # a unit's 16-bit gradients are the planner's own count
        peak = accumulation_transient(unit=stage.shard_unit_params, root=root, embedding=root,
                                      grads=dt.grads, reduced=reduced, mixed=wider)
        return float(accumulated_params(stage) * reduced + peak
                     - stage.shard_unit_params * dt.grads)
    return float(params * (reduced - dt.grads) + stage.shard_unit_params * dt.grads * wider)


def memory_per_gpu(stage: Stage, inflight: float) -> dict[str, float]:
    """Bytes per GPU: params, grads, optimizer, activations, buffers and their total on the
    device, and what offloading keeps in host memory (``host``); ``inflight`` is the peak of
    micro-batch chunks in flight (from the pipeline simulation)."""
    lay, dt = stage.layout, stage.dtypes
    dense, expert = stage.params
    kw: dict[str, Any] = dict(stage=lay.zero, param_bytes=dt.params, grad_bytes=dt.grads,
              optimizer_bytes=optimizer_k(stage))
    states = zero_bytes(round(dense), dp=lay.shard_group, **kw)
    if expert:  # experts are sharded over the data ranks outside their ep group
        experts = zero_bytes(round(expert), dp=lay.shard_group // lay.ep, **kw)
        states = {k: states[k] + experts[k] for k in states}
    states["optimizer"] += factored_state_bytes(stage)
    shard = (dense + expert) / (lay.shard_group if lay.zero >= 2 else 1)
    if lay.replica_sync in ("diloco", "edit", "a_edit"):
        states["optimizer"] += 2 * 4 * shard  # the last synchronised fp32 parameters, momentum
    if lay.replica_sync == "parameter_server":
        # each rank's server steps 1/R of the shard; the versions pulled land in one fp32 copy
        states["optimizer"] = states["optimizer"] / lay.dp_replicate + 4 * shard
    host = 0.0
    if lay.offload_params:  # the shards on the host; ZeRO-2 keeps its gathered copy
        host = sharded_params(stage) + states["grads"] + states["optimizer"]
        states = {"params": states["params"] if lay.zero == 2 else 0.0, "grads": 0.0,
                  "optimizer": 0.0}

    chunk_layers = stage.layers / lay.stages_per_rank
    activations = layer_bytes(stage, lay.recompute) * chunk_layers * inflight
    cp = cp_bytes(stage, lay.recompute)  # with cp > 1: ring chunks, offloaded K/V
    activations += cp["transient"]
    host += cp["host"] * chunk_layers * inflight
    if lay.offload_activations:  # the device keeps the layer computed and the one copied
        kept = min(activations, 2 * layer_bytes(stage, lay.recompute))
        host += activations - kept
        activations = kept
    if lay.recompute == "full":  # one layer's activations exist while it is recomputed
        activations += layer_bytes(stage, "none")
    elif lay.recompute == "op":  # and what per-op checkpointing recomputes, for one layer
        activations += layer_bytes(stage, "none") - layer_bytes(stage, "op")
    activations += loss_bytes(stage)
    unit, layer_units = stage.shard_unit_params, lay.shard_unit == "layer"
    if lay.zero == 3 and stage.fsdp_units_kept:
        # under a pipeline the stage stays gathered and its gradients unsharded all step
        # (Stage.fsdp_units_kept); at the end each unit is resharded before its gradients
        # are copied out to be reduce-scattered. Reduced every micro-batch, they are a
        # unit's at a time
        kept_grads = sum(stage.params) if lay.reduce_once else unit
        buffers = float(sum(stage.params) * dt.params + kept_grads * dt.grads)
    elif lay.zero == 3:  # a unit gathered, the next prefetched, its gradients unsharded
        buffers = float(unit * (2 * dt.params + dt.grads))
    elif lay.zero == 2:  # parameters stay gathered (counted above): a unit's gradients
        buffers = float(unit * dt.grads)
        if layer_units and not dt.master_weights:  # FSDP2 keeps its shard beside them,
            # unless that shard is the optimizer's master copy (counted there)
            states["params"] += sharded_params(stage)
    else:  # DDP buckets
        buffers = 2.0 * DDP_BUCKET_BYTES
    buffers += pipeline_gradients(stage)
    if lay.reduce_once and lay.fsdp_accumulation:
        # the gradients accumulate unsharded, in the dtype they are reduced in (Megatron's
        # fp32 grad buffer under bf16), until the step's one reduce-scatter
        buffers += float((dense + expert) * stage.reduce_bytes)
    out = {"params": states["params"], "grads": states["grads"],
           "optimizer": states["optimizer"], "activations": activations,
           "buffers": buffers}
    out["total"] = sum(out.values())
    out["host"] = host
    return out
