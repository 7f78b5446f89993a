"""Closed-form estimates, each with its source: memory (ZeRO, Korthikanti), training FLOPs
(PaLM appendix B), the alpha-beta cost of a ring collective (each all-reduce algorithm's:
``meshlab.plan.allreduce_formulas``; context parallelism's collectives and memory:
``meshlab.plan.context_formulas``).

Plain Python: the planner runs in the notebook, in ``meshlab plan`` and on the ranks alike.
"""

from __future__ import annotations

import math
from typing import Any

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")
PLANNED_RECOMPUTE = (*RECOMPUTE_MODES, "op")
"""What the planner costs: meshlab.parallel's modes and torchtitan's per-op selective
checkpointing ("op": every other matmul's output and attention's kept, the rest recomputed)."""
REPLICA_SYNC = ("every_step", "local_sgd", "diloco", "edit", "a_edit", "parameter_server")
"""How dp_replicate replicas agree: gradients reduced every step (DDP, HSDP), parameters
averaged every H steps (local SGD), DiLoCo's outer step every H steps, EDiT's (the same
outer step, block by block in the next forward), A-EDiT's (after a time budget), or through
parameter servers (gradients pushed, parameters pulled, a bounded staleness)."""
EVERY_H = ("local_sgd", "diloco", "edit", "a_edit")
"""The modes that synchronise every H optimizer steps (a_edit: the steps its time budget
holds; meshlab.parallel's ParallelPlan gives a_edit a budget in seconds instead)."""


def zero_bytes(params: int, *, dp: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
               optimizer_bytes: float = 12) -> dict[str, float]:
    """Per-device bytes for params, grads and optimizer state under ZeRO stage 0-3.

    Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", section 5 / Figure 1, with Ψ = params, K = optimizer_bytes, N = dp and mixed
    precision (2-byte params and grads by default, K = 12 for fp32 Adam master weights,
    momentum and variance):

    - stage 0 (plain data parallel): (2 + 2 + K)Ψ
    - stage 1 (optimizer states sharded, P_os): 2Ψ + 2Ψ + KΨ/N
    - stage 2 (+ gradients sharded, P_os+g): 2Ψ + (2 + K)Ψ/N
    - stage 3 (+ parameters sharded, P_os+g+p): (2 + 2 + K)Ψ/N

    The 2s are ``param_bytes`` and ``grad_bytes``. Activations and buffers are not included.
    """
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {ZERO_STAGES}, got {stage!r}")
    if dp < 1:
        raise ValueError(f"dp (data-parallel degree) must be >= 1, got {dp!r}")
    if params < 0:
        raise ValueError(f"params must be >= 0, got {params!r}")
    p = float(param_bytes * params)
    g = float(grad_bytes * params)
    o = float(optimizer_bytes * params)
    # Each stage shards one more of optimizer state, gradients, parameters across the dp ranks.
    out = {
        "params": p / dp if stage >= 3 else p,
        "grads": g / dp if stage >= 2 else g,
        "optimizer": o / dp if stage >= 1 else o,
    }
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def activation_bytes_per_layer(*, seq: int, batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False,
                               recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for backward, per device.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    section 4 and Table 2 (16-bit activations, s = seq, b = batch, h = hidden, a = heads,
    t = tp):

    - no parallelism:                     s*b*h*(34 + 5*a*s/h)
    - tensor parallel:                    s*b*h*(10 + 24/t + 5*a*s/(h*t))
    - tensor + sequence parallel:         s*b*h/t*(34 + 5*a*s/h)
    - selective recompute (attention core recomputed, so the 5*a*s/h term is gone):
      s*b*h*34 with no parallelism, s*b*h*(10 + 24/t) with TP, s*b*h*34/t with TP + SP
    - full recompute (only the layer's input is kept): 2*s*b*h, or 2*s*b*h/t with SP

    With tp == 1 every variant reduces to the no-parallelism formula, so sequence_parallel
    changes nothing there. Table 2 lists full recompute as 2*s*b*h whatever t; dividing by t
    under SP reflects that the stored input is itself sequence-sharded.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if tp < 1:
        raise ValueError(f"tp (tensor-parallel degree) must be >= 1, got {tp!r}")
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = float(s * b * h)
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return 2 * sbh / t if sp else 2 * sbh
    attention_core = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        # SP shards the layer-norm and dropout activations that plain TP replicates.
        return sbh / t * (34 + attention_core)
    # Plain TP: 10*s*b*h (layer-norm inputs, dropout masks, ...) stays replicated on every rank.
    return sbh * (10 + 24 / t + attention_core / t)


def layer_activation_bytes(*, seq: int, batch: int, hidden: int, heads: int, q_width: int,
                           kv_width: int, ffn: int, gated: bool, dropout: bool, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           scores: bool = True, regather: bool = True) -> float:
    """Activation bytes one layer keeps for its backward, per device, in 16 bits: Korthikanti
    et al.'s section 4 count, term by term, for any attention width, grouped-query keys
    and values, a gated (SwiGLU) or plain MLP, with or without dropout.

    Per token (h = hidden, q = heads x head_dim, kv = kv_heads x head_dim, f = ffn, a =
    heads, s = seq): the two norms' inputs 4h; the QKV projection's input 2h; Q, K, V
    2q + 4kv; the attention scores (``scores``: unfused attention keeps its softmax, 2as,
    and with dropout its mask and output, 3as more); the output projection's input 2q; the
    MLP's input 2h; its intermediates (GELU: 4f, its input and output; SwiGLU: 6f, gate, up
    and their product); dropout's masks h after attention and h after the MLP. A GPT (q = kv
    = h, f = 4h, GELU, dropout) gives Korthikanti's 34h + 5as.

    TP shards all but the norms' and the projections' inputs and the dropout masks (10h
    with dropout, Korthikanti's 10); sequence parallelism shards those too, the projections'
    inputs only where the backward gathers them again (``regather``, Megatron's; torch's
    SequenceParallel keeps them gathered: 4h whole). Selective recompute drops the scores;
    full recompute keeps the layer's input, 2h (sharded by SP).
    """
    if recompute not in PLANNED_RECOMPUTE:
        raise ValueError(f"recompute must be one of {PLANNED_RECOMPUTE}, got {recompute!r}")
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                        ("tp", tp), ("q_width", q_width), ("kv_width", kv_width),
                        ("ffn", ffn)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    h, sb, t = hidden, float(seq * batch), tp
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return 2 * sb * h / (t if sp else 1)
    if recompute == "op":  # the layer's input, the kept matmuls' outputs, attention's output
        kept = op_saved_widths(hidden=h, q_width=q_width, kv_width=kv_width, ffn=ffn,
                               gated=gated)
        return 2 * sb * (h / (t if sp else 1) + (sum(kept) + q_width) / t)
    replicated = 4 * h + 2 * h + 2 * h + (2 * h if dropout else 0)
    sharded = 2 * q_width + 4 * kv_width + 2 * q_width + (6 if gated else 4) * ffn
    if scores and recompute == "none":
        sharded += (5 if dropout else 2) * heads * seq
    gathered = 0 if regather or not sp else 4 * h  # the QKV's and the MLP's inputs, whole
    return sb * ((replicated - gathered) / (t if sp else 1) + gathered + sharded / t)


def op_matmuls(*, hidden: int, q_width: int, kv_width: int, ffn: int,
               gated: bool) -> list[tuple[int, int]]:
    """A Llama block's matmuls in the order its forward runs them, as (input, output) widths:
    Q, K, V, the attention output, then w1, w3 (gated) and w2 (torchtitan's model)."""
    h, q, kv = hidden, q_width, kv_width
    mlp = [(h, ffn), (h, ffn), (ffn, h)] if gated else [(h, ffn), (ffn, h)]
    return [(h, q), (h, kv), (h, kv), (q, h), *mlp]


def op_saved_widths(**shape: Any) -> list[int]:
    """Output widths per token of the matmuls torchtitan's per-op checkpointing keeps: the
    1st, 3rd, 5th... of each block ("Saves output of all compute ops, except every second
    mm", torchtitan 9dec370 parallelize_llama.py); the others are recomputed."""
    return [out for i, (_, out) in enumerate(op_matmuls(**shape)) if i % 2 == 0]


def op_recomputed_params(**shape: Any) -> int:
    """Weights per layer of the matmuls per-op checkpointing recomputes (the 2nd, 4th...)."""
    return sum(i * o for n, (i, o) in enumerate(op_matmuls(**shape)) if n % 2 == 1)


# -- FLOPs -------------------------------------------------------------------------------------


def training_flops_per_token(*, matmul_params: int, layers: int, seq: int, attn_width: int,
                             recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one token's forward and backward pass.

    Chowdhery et al. 2022, "PaLM", appendix B: 6N + 12·L·H·Q·T per token, where N counts the
    parameters of every matmul (the embedding lookup is not one; the output projection is),
    L layers, H·Q = ``attn_width`` (heads x head dim) and T = ``seq``. The second term is
    attention's QK^T and AV (2 FLOPs per multiply-add, forward 1x, backward 2x), counted over
    the full T x T square as PaLM and Megatron do, so MFU figures compare with theirs.

    Model FLOPs are what MFU divides by. Hardware FLOPs add what recomputation repeats: a
    full recompute reruns the forward (2N + 4·L·H·Q·T more), a selective one only the
    attention core (4·L·H·Q·T more), Korthikanti et al. 2022 section 5.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    dense, attention = 2.0 * matmul_params, 4.0 * layers * attn_width * seq  # forward
    model = 3 * dense + 3 * attention
    extra = {"none": 0.0, "selective": attention, "full": dense + attention}[recompute]
    return model, model + extra


# -- collectives ---------------------------------------------------------------------------


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def ring_steps(collective: str, n: int) -> int:
    """Latency terms (sequential message hops) of a ring collective among ``n`` ranks."""
    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}, got {collective!r}")
    if collective == "send_recv":
        return 1
    if n <= 1:
        return 0
    return 2 * (n - 1) if collective == "all_reduce" else n - 1


def bus_factor(collective: str, n: int) -> float:
    """Bytes each rank sends per byte of the buffer: the algorithmic factor of a ring.

    Thakur, Rabenseifner and Gropp 2005, and NCCL's performance notes (``busBw``): an
    all-reduce of S bytes sends 2(n-1)/n·S per rank (reduce-scatter, then all-gather);
    all-gather and reduce-scatter (S = the full buffer) (n-1)/n·S; an all-to-all (S = what
    one rank holds) (n-1)/n·S; a send/recv S.
    """
    steps = ring_steps(collective, n)
    if collective == "send_recv":
        return 1.0
    if n <= 1:
        return 0.0
    return steps / n


def collective_seconds(collective: str, n: int, nbytes: float, *, latency_s: float,
                       bandwidth_bytes_s: float) -> float:
    """Alpha-beta time of one collective: steps·alpha + factor·bytes/bandwidth.

    ``bandwidth_bytes_s`` is a bus bandwidth (what one rank's link carries), so the same
    number describes every collective and every group size, as in nccl-tests.
    """
    steps = ring_steps(collective, n)  # first: an unknown collective raises even for n = 1
    if n <= 1 and collective != "send_recv":
        return 0.0
    return steps * latency_s + bus_factor(collective, n) * nbytes / bandwidth_bytes_s


# -- optimizer states per kind (the K of zero_bytes, generalised) ---------------------------

OPTIMIZER_KINDS = ("adamw", "adamw_bf16", "adamw8bit", "adafactor", "sgd")
"""build_optimizer's kinds (meshlab.parallel.optimizers.OPTIMIZERS)."""
QUANT_BLOCK = 256
"""Values per 8-bit block, one fp32 scale each (torchao 0.18 AdamW8bit's block_size)."""
QUANT_MIN_NUMEL = 4096
"""torchao (after bitsandbytes) quantizes only tensors of at least this many values, in whole
blocks; the others keep their states in the parameters' dtype."""
STEP_BYTES = 4
"""The fp32 step counter torch's AdamW and Adafactor and torchao keep per tensor."""
QMAP_BYTES = 256 * 4
"""torchao's 8-bit code book: 256 fp32 values, one copy per quantized state tensor."""


def optimizer_state_bytes(kind: str, shape: tuple[int, ...] | list[int], *,
                          param_bytes: int = 4, block_size: int = QUANT_BLOCK) -> int:
    """State bytes an optimizer of ``kind`` keeps for one tensor of ``shape`` (the local shard
    a rank steps), its step counter included; ``param_bytes``: the parameters' dtype.

    - adamw: exp_avg + exp_avg_sq in the parameters' dtype, 2 x 4 B in fp32 (Loshchilov &
      Hutter 2019; ZeRO's K = 12 adds 4 B of fp32 master weights under mixed precision)
    - adamw_bf16: the same two moments in bf16, 2 x 2 B
    - adamw8bit: two 8-bit codes per value, one fp32 scale per block of 256 and a 256-entry
      fp32 code book per state (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
      Quantization"; torchao 0.18), for tensors torchao quantizes (QUANT_MIN_NUMEL)
    - adafactor: a matrix (..., R, C) keeps R + C second-moment factors per leading index, a
      vector its full second moment (Shazeer & Stern 2018, "Adafactor", section 3; no
      first moment with torch's default beta1 = None)
    - sgd (momentum): one buffer in the parameters' dtype, no step counter
    """
    if kind not in OPTIMIZER_KINDS:
        raise ValueError(f"optimizer kind={kind!r} is not one of {OPTIMIZER_KINDS}")
    n = math.prod(shape)
    if kind == "sgd":
        return n * param_bytes
    if kind == "adamw_bf16":
        return 2 * n * 2 + STEP_BYTES
    if kind == "adamw8bit" and n >= QUANT_MIN_NUMEL and n % block_size == 0:
        return 2 * (n + 4 * (n // block_size) + QMAP_BYTES) + STEP_BYTES
    if kind == "adafactor":
        factors = math.prod(shape[:-2]) * (shape[-2] + shape[-1]) if len(shape) > 1 else n
        return factors * param_bytes + STEP_BYTES
    return 2 * n * param_bytes + STEP_BYTES


def dim0_chunks(shape: tuple[int, ...] | list[int], ranks: int) -> list[tuple[int, ...]]:
    """The shards of a tensor cut on dim 0 over ``ranks`` as FSDP2 (torch.chunk) cuts it:
    ceil(rows / ranks) rows each, the last ones fewer or none."""
    if not shape:
        return [tuple(shape)] * ranks
    size = -(-shape[0] // ranks)
    return [(max(0, min(size, shape[0] - r * size)), *shape[1:]) for r in range(ranks)]


def sharded_state_bytes(kind: str, shapes: list[tuple[int, ...]], *, dp: int, stage: int,
                        param_bytes: int = 4) -> float:
    """Optimizer-state bytes per rank, averaged over the ``dp`` ranks, for parameters of
    ``shapes``: stage 0 keeps every tensor's state on each rank; stage 1 spreads whole tensors
    over the ranks (ZeroRedundancyOptimizer: the total / dp); stages 2 and 3 step dim-0
    shards (FSDP2), so a factored state (Adafactor's columns) and the step counters repeat
    on every rank."""
    if stage not in ZERO_STAGES or dp < 1:
        raise ValueError(f"stage must be one of {ZERO_STAGES} and dp >= 1, got {stage!r}, {dp!r}")
    def state(s: tuple[int, ...]) -> int:
        return optimizer_state_bytes(kind, s, param_bytes=param_bytes)
    if stage == 0:
        return float(sum(state(s) for s in shapes))
    if stage == 1:
        return sum(state(s) for s in shapes) / dp
    return sum(state(c) for s in shapes for c in dim0_chunks(s, dp)) / dp


def optimizer_bytes_per_param(kind: str, *, state_bytes: int = 4,
                              master_weights: bool = False) -> float:
    """zero_bytes' K for ``kind``: state bytes per parameter of large tensors (counters and
    code books left out; ``state_bytes``: AdamW's and SGD's state dtype, fp32 also under
    mixed precision), plus 4 B of fp32 master weights where the parameters are 16-bit.
    Adafactor's (R + C) factors per R x C matrix vanish per parameter: 0 here, exact with
    ``optimizer_state_bytes``."""
    per = {"adamw": 2.0 * state_bytes, "adamw_bf16": 4.0, "adamw8bit": 2 + 2 * 4 / QUANT_BLOCK,
           "adafactor": 0.0, "sgd": float(state_bytes)}
    if kind not in per:
        raise ValueError(f"optimizer kind={kind!r} is not one of {OPTIMIZER_KINDS}")
    return per[kind] + (4.0 if master_weights else 0.0)
