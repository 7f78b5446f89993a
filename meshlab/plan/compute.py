"""Compute time on one GPU: each GEMM of a layer at the efficiency its shape reaches
(``meshlab.plan.gemm``), attention's products at theirs, memory-bound work (norms,
activations, residuals, unfused attention scores) at memory bandwidth, the output
projection and loss on the last stage, the host's fixed cost per layer, and the optimizer
step. The FLOP counts (PaLM's, for MFU) are kept apart from the time."""

from __future__ import annotations

from typing import Any

from meshlab.plan import gemm
from meshlab.plan.context_formulas import CONTIGUOUS_CP
from meshlab.plan.formulas import op_recomputed_params, training_flops_per_token
from meshlab.plan.hardware import Hardware
from meshlab.plan.layout import Layout
from meshlab.plan.shapes import ModelShape
from meshlab.plan.stage import Stage

ADAMW_BYTES = 80  # bytes moved per parameter by one AdamW step (see optimizer_seconds)


def flops_per_token(model: ModelShape, recompute: str, layers: int) -> tuple[float, float]:
    """(model, hardware) training FLOPs per token through ``layers`` layers and the output
    projection: 6N + attention (PaLM), the hardware's with recompute added."""
    layer_model, layer_hw = training_flops_per_token(
        matmul_params=_layer_matmul_params(model), layers=1, seq=model.seq_len,
        attn_width=model.heads * model.head_width,
        recompute="none" if recompute == "op" else recompute)
    if recompute == "op":
        layer_hw += 2.0 * op_recomputed_params(**_op_shape(model))
    out_flops = 6.0 * model.vocab * model.hidden  # output projection, last stage
    return layer_model * layers + out_flops, layer_hw * layers + out_flops


def microbatch_seconds(stage: Stage) -> tuple[float, float]:
    """Forward and backward of one micro-batch on the slowest pipeline rank, host included.

    Layers split evenly, the first ranks taking the remainder (Megatron, torchtitan); the
    last rank also runs the output projection and the loss, so it is the slowest unless it
    holds fewer layers."""
    parts, host_f, host_b = microbatch_parts(stage)
    t_f, t_b = (sum(f for f, _ in parts.values()), sum(b for _, b in parts.values()))
    return with_host(stage, t_f, host_f), with_host(stage, t_b, host_b)


def microbatch_parts(stage: Stage) -> tuple[dict[str, tuple[float, float]], float, float]:
    """The device time of one micro-batch on the slowest pipeline rank by kind of work
    (``COMPUTE_PARTS``: (forward, backward) each), and the host's fixed cost of its forward
    and backward (hidden behind the device's on an asynchronous one)."""
    lay, hw = stage.layout, stage.hardware
    per_layer = layer_parts(stage)
    out_gemm, out_loss = output_parts(stage)
    first = stage.layers
    last = stage.model.layers // lay.pp if lay.pp > 1 else first

    def rank(layers: int, output: bool) -> dict[str, tuple[float, float]]:
        parts = {k: (layers * f, layers * b) for k, (f, b) in per_layer.items()}
        if output:
            for key, (f, b) in (("gemm", out_gemm), ("memory", out_loss)):
                parts[key] = (parts[key][0] + f, parts[key][1] + b)
        return parts

    parts = max(rank(first, False), rank(last, True),
                key=lambda p: sum(f + b for f, b in p.values()))
    # the host's fixed cost per layer: hidden behind the math on an asynchronous device
    overhead = (hw.layer_overhead_us + hw.fsdp_overhead_us * (lay.zero >= 2)
                + hw.tp_overhead_us * (lay.tp > 1)) * 1e-6 * first
    if lay.recompute == "full":
        overhead *= 4 / 3  # the forward's operators run twice
    return parts, overhead / 3, overhead * 2 / 3


COMPUTE_PARTS = ("gemm", "attention", "memory")
"""A layer's device work by kind: weight GEMMs (and the output projection), attention's
products, and memory-bound work (norms, activations, residuals, scores, the loss)."""


def layer_seconds(stage: Stage) -> tuple[float, float]:
    """Forward and backward (recompute included) of one layer for one micro-batch."""
    parts = layer_parts(stage).values()
    return sum(f for f, _ in parts), sum(b for _, b in parts)


def layer_parts(stage: Stage) -> dict[str, tuple[float, float]]:
    """(forward, backward) of one layer for one micro-batch by ``COMPUTE_PARTS``, recompute
    included: its GEMMs at their shapes' efficiency (``meshlab.plan.gemm``), attention's at
    theirs, and the memory-bound rest at memory bandwidth."""
    hw, dt, lay = stage.hardware, stage.dtypes, stage.layout
    dense_f = sum(gemm.seconds(hw, g, dt.compute, dt.activations) for g in layer_gemms(stage))
    dense_fb = sum(gemm.training_seconds(hw, g, dt.compute, dt.activations)
                   for g in layer_gemms(stage))
    attn_f = attention_seconds(stage)
    bandwidth = hw.memory_bandwidth_gbs * 1e9
    mem_f = (memory_bound_bytes(stage) + score_bytes(stage)) / 3 / bandwidth
    gemm_b, attn_b, mem_b = dense_fb - dense_f, attention_backward(lay) * attn_f, 2 * mem_f
    if lay.recompute == "full":
        gemm_b, attn_b, mem_b = gemm_b + dense_f, attn_b + attn_f, mem_b + mem_f
    elif lay.recompute == "op":  # the matmuls not kept, and every memory-bound op
        gemm_b, mem_b = gemm_b + dense_f * op_recomputed_share(stage.model), mem_b + mem_f
    elif lay.recompute == "selective" or (lay.cp > 1 and lay.context_parallel == "chunked"):
        # the attention core again (chunked: each chunk checkpointed)
        attn_b += attn_f
        mem_b += score_bytes(stage) / 3 / bandwidth
    return {"gemm": (dense_f, gemm_b), "attention": (attn_f, attn_b), "memory": (mem_f, mem_b)}


def attention_backward(layout: Layout) -> float:
    """Attention's backward over its forward: four products to two, and a fused kernel
    recomputes the scores QK^T (and their softmax) to save storing them: five to two
    (Dao et al. 2022, "FlashAttention", Algorithm 4)."""
    return 2.5 if layout.flash_attention else 2.0


def attention_seconds(stage: Stage) -> float:
    """Attention's two products in one layer's forward, one micro-batch, on the slowest cp
    rank. Fused (flash) attention skips the masked half of the causal square; with cp,
    meshlab's and torch's contiguous slices leave the last rank's queries against every key
    before them: (n - 1/2)/n of its square, not half, so that rank takes 2 - 1/n times the
    average. Head-tail slices (``cp_balanced``: torch's context_parallel() default), Ulysses
    and chunked (every position of their heads) and Llama 3's all-gather (2n balanced
    chunks): no skew. The products are costed at the all-gather's shapes (the same FLOPs
    for every impl)."""
    hw, dt, lay = stage.hardware, stage.dtypes, stage.layout
    products = attention_gemms(stage)
    if not lay.flash_attention:  # the scores are written and read back: a GEMM's roofline
        return sum(gemm.seconds(hw, g, dt.unconverted_compute, dt.activations)
                   for g in products)
    # the kernels' rates were measured in 16-bit
    share = attention_kernel_share(lay, hw) if dt.unconverted_compute == "bf16" else None
    if share:  # a fused kernel at its measured rate
        seconds = sum(g.flops for g in products) / (
            hw.tflops_peak(dt.unconverted_compute) * 1e12 * share)
    else:  # its two products at the GEMM model's rates; the s x s scores stay on chip
        seconds = sum(gemm.compute_seconds(hw, g, dt.unconverted_compute) for g in products)
    skew = 2 - 1 / lay.cp if lay.context_parallel in CONTIGUOUS_CP and not lay.cp_balanced \
        else 1.0
    return seconds * 0.5 * skew


def attention_kernel_share(layout: Layout, hw: Hardware) -> float | None:
    """The share of peak ``layout``'s fused attention kernel reaches on ``hw``. ``auto``:
    the kernel SDPA picks there (``hw.attention_default``, where calibrated), else cuDNN's,
    else FlashAttention-2's; None: the profile measured none, so attention is costed as two
    GEMMs. A kernel named but not measured on ``hw`` is refused, naming the ones that are."""
    rates = hw.attention_efficiency
    if layout.attention_kernel == "auto":
        if hw.attention_default:
            return rates[hw.attention_default]
        return rates.get("cudnn", rates.get("flash2"))
    if layout.attention_kernel not in rates:
        raise ValueError(f"attention_kernel={layout.attention_kernel}: the {hw.name} profile "
                         "has no measured rate for it (it has "
                         f"{', '.join(rates) or 'none'}); use attention_kernel=auto")
    return rates[layout.attention_kernel]


def output_seconds(stage: Stage) -> tuple[float, float]:
    """The output projection and the loss, forward and backward, on the last stage."""
    (gf, gb), (lf, lb) = output_parts(stage)
    return gf + lf, gb + lb


def output_parts(stage: Stage) -> tuple[tuple[float, float], tuple[float, float]]:
    """(forward, backward) of the output projection's GEMM and of the loss over the
    vocabulary (fp32 logits, ~3 passes forward, twice that backward), on the last stage."""
    hw, dt, m, lay = stage.hardware, stage.dtypes, stage.model, stage.layout
    g = gemm.Gemm("output projection", stage.tokens, max(1, m.vocab // lay.tp), m.hidden)
    loss = 3 * 4 * stage.tokens * m.vocab / lay.tp / (hw.memory_bandwidth_gbs * 1e9)
    f = gemm.seconds(hw, g, dt.unconverted_compute, dt.activations)
    return ((f, gemm.training_seconds(hw, g, dt.unconverted_compute, dt.activations) - f),
            (loss, 2 * loss))


def layer_gemms(stage: Stage) -> list[gemm.Gemm]:
    """The weight GEMMs of one layer's forward, one micro-batch, one GPU (tp splits N of
    the column-parallel ones and K of the row-parallel ones)."""
    m, lay = stage.model, stage.layout
    tokens, t, h = stage.tokens, lay.tp, m.hidden
    q, kv = m.heads * m.head_width, m.n_kv_heads * m.head_width
    up = m.ffn * (2 if m.gated_ffn else 1)
    gemms = [gemm.Gemm("qkv projection", tokens, (q + 2 * kv) // t, h),
             gemm.Gemm("attention output", tokens, h, q // t)]
    if not m.experts:
        return [*gemms, gemm.Gemm("mlp up", tokens, up // t, h),
                gemm.Gemm("mlp down", tokens, h, m.ffn // t)]
    # each rank's experts see its ep group's tokens: top_k per token, spread evenly
    local = m.experts // lay.ep
    per_expert = max(1, tokens * m.top_k // local)
    return [*gemms, gemm.Gemm("router", tokens, m.experts, h),
            gemm.Gemm("expert up", per_expert, up // t, h, local),
            gemm.Gemm("expert down", per_expert, h, m.ffn // t, local)]


def attention_gemms(stage: Stage) -> list[gemm.Gemm]:
    """QK^T and the weighted sum of values, per sequence and local head: this rank's
    queries (cp splits them) against every key (cp gathers them)."""
    m, lay = stage.model, stage.layout
    heads = lay.micro_batch * m.heads // lay.tp
    return [gemm.Gemm("attention scores", stage.seq, m.seq_len, m.head_width, heads),
            gemm.Gemm("attention values", stage.seq, m.head_width, m.seq_len, heads)]


def score_bytes(stage: Stage) -> float:
    """Bytes unfused attention moves for its s x s scores (none under FlashAttention):
    writing the scores, reading them for the masked softmax, writing the probabilities,
    dropout's read, mask and write, the read by the weighted sum (~13 bytes a score in
    16-bit; fused: the scale, mask and softmax in one pass, ~9), twice that in the
    backward."""
    if stage.layout.flash_attention:
        return 0.0
    m, lay = stage.model, stage.layout
    scores = lay.micro_batch * m.heads / lay.tp * stage.seq * m.seq_len
    per_score = 9 if lay.fused else 13
    return 3 * per_score * scores * stage.dtypes.activations / 2


def memory_bound_bytes(stage: Stage) -> float:
    """Bytes the non-matmul work of one layer moves for one micro-batch (forward and
    backward).

    Eager PyTorch runs each elementwise step as its own kernel, reading and writing
    whole tensors: per token and layer, two norms (an RMSNorm written in PyTorch:
    ``EAGER_RMSNORM_PASSES``; a LayerNorm ~7), RoPE on queries and keys (~3 passes),
    attention reading q, k, v and writing its output, two residual adds (3 passes each)
    and SwiGLU (~5 passes over the feed-forward width, per routed expert); the backward
    moves about twice as much.
    Fused (``Layout.fused``), each region reads its inputs and writes its outputs once:
    residual add and norm together (4 passes, twice), RoPE 2, SwiGLU 3.
    """
    m, lay = stage.model, stage.layout
    q, kv = m.heads * m.head_width, m.n_kv_heads * m.head_width
    ffn = m.ffn * (m.top_k if m.experts else 1)
    if lay.fused:
        per_token = 8 * m.hidden + 2 * (q + kv) + (2 * q + 2 * kv) + 3 * ffn
    else:
        norm = LAYER_NORM_PASSES if m.layer_norm else EAGER_RMSNORM_PASSES
        per_token = (2 * norm * m.hidden + 3 * (q + kv) + (2 * q + 2 * kv) + 6 * m.hidden
                     + 5 * ffn)
    return 3 * per_token / lay.tp * stage.dtypes.activations * stage.tokens + qat_bytes(stage)


EAGER_RMSNORM_PASSES = 23
"""Passes over the (16-bit) hidden state an RMSNorm written in PyTorch makes in its forward:
Llama's, transformers' and torchtitan's ``norm_type="rmsnorm"`` (torchtitan/models/norms.py,
2024) upcast to float32 and run pow, mean, rsqrt, two products and the cast back as separate
kernels. Measured on an H100 (docs/guides/gpu.md, kernels table): 0.528 ms on 8,192 x 4,096
and 2.001 ms on 8,192 x 16,384 bf16 rows, against 22.5 and 90.1 us for one pass at the
2,980 GB/s the card copies at: 23.4 and 22.2 passes. Fused (compiled) it makes 2."""

LAYER_NORM_PASSES = 7
"""An eager LayerNorm: one torch kernel reading and writing the hidden state, with its
statistics; ~7 passes is this model's estimate, not a measurement."""


def qat_bytes(stage: Stage) -> float:
    """Bytes QAT's fake quantization moves in one layer, one micro-batch (torchao's
    FakeQuantizedLinear): an assumption, not a measurement. Each Linear's weight is read,
    scaled, rounded and written again (~4 passes) in the forward and its straight-through
    gradient passes once in the backward; the 8da* schemes do the same to each Linear's
    input (8-bit per-token dynamic activations). Memory does not change: the fake-quantized
    copies live for one matmul."""
    m, lay = stage.model, stage.layout
    if lay.qat == "none":
        return 0.0
    q = m.heads * m.head_width
    experts = m.top_k if m.experts else 1
    weights = m.layer_params / lay.tp
    inputs = 0.0 if lay.qat == "4w" else stage.tokens * (
        (2 + experts) * m.hidden + q + experts * m.ffn) / lay.tp
    return 5 * (weights + inputs) * stage.dtypes.activations


def optimizer_seconds(stage: Stage) -> float:
    """AdamW on the local shard: memory-bound. torch's default (foreach) AdamW passes
    over its four fp32 tensors (parameter, gradient, two moments) about 20 times a step:
    ~80 bytes per parameter (measured: 3.5M parameters in 25 ms at 13 GB/s); on the CPU
    where the states are offloaded."""
    dense, expert = stage.params
    shard = stage.layout.shard_group if stage.layout.zero >= 1 else 1
    hw = stage.hardware  # offloaded states step on the CPU, at the host's memory bandwidth
    bandwidth = hw.host_memory_bandwidth_gbs if stage.layout.offload_params \
        else hw.memory_bandwidth_gbs
    return (dense + expert) / shard * ADAMW_BYTES / (bandwidth * 1e9)


def op_recomputed_share(model: ModelShape) -> float:
    """Share of a layer's weight-matmul FLOPs that per-op checkpointing recomputes."""
    return op_recomputed_params(**_op_shape(model)) / _layer_matmul_params(model)


def _op_shape(model: ModelShape) -> dict[str, Any]:
    m = model
    return {"hidden": m.hidden, "q_width": m.heads * m.head_width,
            "kv_width": m.n_kv_heads * m.head_width, "ffn": m.ffn * (m.top_k if m.experts else 1),
            "gated": m.gated_ffn}


def _layer_matmul_params(model: ModelShape) -> int:
    m = model
    ffn = (m.top_k * m.expert_params + m.hidden * m.experts + m.shared_params if m.experts
           else m.expert_params)
    return m.attention_params + ffn


def with_host(stage: Stage, device_s: float, host_s: float) -> float:
    return max(device_s, host_s) if stage.hardware.asynchronous else device_s + host_s
