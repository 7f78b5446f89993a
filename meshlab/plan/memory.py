"""Memory per GPU: ZeRO's parameter, gradient and optimizer bytes, Korthikanti's activations
(counted for the model's own attention, MLP and dropout) times the micro-batches the schedule
keeps in flight, the logits, and communication buffers."""

from __future__ import annotations

from meshlab.plan.formulas import layer_activation_bytes, zero_bytes
from meshlab.plan.stage import Stage

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb


def memory_per_gpu(stage: Stage, inflight: float) -> dict[str, float]:
    """Bytes per GPU: params, grads, optimizer, activations, buffers, total; ``inflight`` is
    the peak of micro-batch chunks in flight (from the pipeline simulation)."""
    lay, dt, m = stage.layout, stage.dtypes, stage.model
    dense, expert = stage.params
    kw = dict(stage=lay.zero, param_bytes=dt.params, grad_bytes=dt.grads,
              optimizer_bytes=dt.optimizer)
    states = zero_bytes(round(dense), dp=lay.shard_group, **kw)
    if expert:  # experts are sharded over the data ranks outside their ep group
        experts = zero_bytes(round(expert), dp=lay.shard_group // lay.ep, **kw)
        states = {k: states[k] + experts[k] for k in states}

    def layer_bytes(recompute: str) -> float:  # counted for 2-byte activations
        return layer_activation_bytes(
            seq=stage.seq, batch=lay.micro_batch, hidden=m.hidden, heads=m.heads,
            q_width=m.heads * m.head_dim, kv_width=m.n_kv_heads * m.head_dim,
            ffn=m.ffn * (m.top_k if m.experts else 1), gated=m.gated_ffn, dropout=m.dropout,
            tp=lay.tp, sequence_parallel=lay.sequence_parallel, recompute=recompute,
            scores=not lay.flash_attention) * dt.activations / 2

    chunk_layers = stage.layers / lay.stages_per_rank
    activations = layer_bytes(lay.recompute) * chunk_layers * inflight
    if lay.recompute == "full":  # one layer's activations exist while it is recomputed
        activations += layer_bytes("none")
    # fp32 logits and their gradient for the loss, on the last stage (vocab-parallel)
    activations += 2 * 4 * stage.tokens * m.vocab / lay.tp
    if lay.zero == 3:  # a unit gathered, the next prefetched, its gradients unsharded
        buffers = float(stage.shard_unit_params * (2 * dt.params + dt.grads))
    elif lay.zero == 2:  # parameters stay gathered (counted above): a unit's gradients
        buffers = float(stage.shard_unit_params * dt.grads)
    else:  # DDP buckets
        buffers = 2.0 * DDP_BUCKET_BYTES
    out = {"params": states["params"], "grads": states["grads"],
           "optimizer": states["optimizer"], "activations": activations,
           "buffers": buffers}
    out["total"] = sum(out.values())
    return out
