"""Compute time on one GPU: PaLM's training FLOPs (recompute included) at the hardware's
achievable matmul rate, memory-bound work (norms, activations, residuals) at memory
bandwidth, the host's fixed cost per layer, and the optimizer step."""

from __future__ import annotations

from meshlab.plan.formulas import training_flops_per_token
from meshlab.plan.shapes import ModelShape
from meshlab.plan.stage import Stage

ADAMW_BYTES = 80  # bytes moved per parameter by one AdamW step (see optimizer_seconds)


def flops_per_token(model: ModelShape, recompute: str, layers: int) -> tuple[float, float]:
    """(model, hardware) training FLOPs per token through ``layers`` layers and the output
    projection: 6N + attention (PaLM), the hardware's with recompute added."""
    layer_model, layer_hw = training_flops_per_token(
        matmul_params=_layer_matmul_params(model), layers=1, seq=model.seq_len,
        attn_width=model.heads * model.head_dim, recompute=recompute)
    out_flops = 6.0 * model.vocab * model.hidden  # output projection, last stage
    return layer_model * layers + out_flops, layer_hw * layers + out_flops


def microbatch_seconds(stage: Stage) -> tuple[float, float]:
    """Forward and backward compute of one micro-batch on one GPU, host cost included."""
    lay, hw = stage.layout, stage.hardware
    # one micro-batch on the busiest stage, one GPU (tp shares each matmul); the forward
    # is a third of the model FLOPs, the backward the rest plus any recompute
    model_flops, hardware_flops = flops_per_token(stage.model, lay.recompute, stage.layers)
    rate = hw.flops_per_s(stage.dtypes.compute)
    forward_flops = model_flops / 3 * stage.tokens / lay.tp
    flops_mb = hardware_flops * stage.tokens / lay.tp
    memory_s = memory_bound_bytes(stage) / (hw.memory_bandwidth_gbs * 1e9)
    t_f = forward_flops / rate + memory_s / 3
    t_b = flops_mb / rate + memory_s - t_f
    # the host's fixed cost per layer: hidden behind the math on an asynchronous device
    overhead = (hw.layer_overhead_us + hw.fsdp_overhead_us * (lay.zero >= 2)
                + hw.tp_overhead_us * (lay.tp > 1)) * 1e-6 * stage.layers
    if lay.recompute == "full":
        overhead *= 4 / 3  # the forward's operators run twice
    return _with_host(stage, t_f, overhead / 3), _with_host(stage, t_b, overhead * 2 / 3)


def memory_bound_bytes(stage: Stage) -> float:
    """Bytes the non-matmul work of one micro-batch moves (forward and backward).

    Eager PyTorch runs each elementwise step as its own kernel, reading and writing
    whole tensors: per token and layer, two RMSNorms (~7 passes over the hidden state
    each), RoPE on queries and keys (~3 passes), attention reading q, k, v and writing
    its output, two residual adds (3 passes each) and SwiGLU (~5 passes over the
    feed-forward width, per routed expert); the backward moves about twice as much.
    """
    m, lay = stage.model, stage.layout
    q, kv = m.heads * m.head_dim, m.n_kv_heads * m.head_dim
    ffn = m.ffn * (m.top_k if m.experts else 1)
    per_token = (14 * m.hidden + 3 * (q + kv) + (2 * q + 2 * kv) + 6 * m.hidden
                 + 5 * ffn) / lay.tp
    return 3 * per_token * stage.dtypes.activations * stage.tokens * stage.layers


def optimizer_seconds(stage: Stage) -> float:
    """AdamW on the local shard: memory-bound. torch's default (foreach) AdamW passes
    over its four fp32 tensors (parameter, gradient, two moments) about 20 times a step:
    ~80 bytes per parameter (measured: 3.5M parameters in 25 ms at 13 GB/s)."""
    dense, expert = stage.params
    shard = stage.layout.shard_group if stage.layout.zero >= 1 else 1
    return (dense + expert) / shard * ADAMW_BYTES / (stage.hardware.memory_bandwidth_gbs * 1e9)


def _layer_matmul_params(model: ModelShape) -> int:
    m = model
    ffn = (m.top_k * m.expert_params + m.hidden * m.experts) if m.experts else m.expert_params
    return m.attention_params + ffn


def _with_host(stage: Stage, device_s: float, host_s: float) -> float:
    return max(device_s, host_s) if stage.hardware.asynchronous else device_s + host_s
