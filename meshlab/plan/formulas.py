"""Closed-form estimates, each with its source: memory (ZeRO, Korthikanti), training FLOPs
(PaLM appendix B), and the alpha-beta cost of a ring collective.

Plain Python: the planner runs in the notebook, in ``meshlab plan`` and on the ranks alike.
"""

from __future__ import annotations

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")
REPLICA_SYNC = ("every_step", "local_sgd", "diloco", "edit", "a_edit", "parameter_server")
"""How dp_replicate replicas agree: gradients reduced every step (DDP, HSDP), parameters
averaged every H steps (local SGD), DiLoCo's outer step every H steps, EDiT's (the same
outer step, block by block in the next forward), A-EDiT's (after a time budget), or through
parameter servers (gradients pushed, parameters pulled, a bounded staleness)."""
EVERY_H = ("local_sgd", "diloco", "edit", "a_edit")
"""The modes that synchronise every H optimizer steps (a_edit: the steps its time budget
holds; meshlab.parallel's ParallelPlan gives a_edit a budget in seconds instead)."""


def zero_bytes(params: int, *, dp: int, stage: int, param_bytes: int = 2, grad_bytes: int = 2,
               optimizer_bytes: int = 12) -> dict[str, float]:
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
                           scores: bool = True) -> float:
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
    with dropout, Korthikanti's 10); sequence parallelism shards those too. Selective
    recompute drops the scores; full recompute keeps the layer's input, 2h (sharded by SP).
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    for name, value in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                        ("tp", tp), ("q_width", q_width), ("kv_width", kv_width),
                        ("ffn", ffn)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    h, sb, t = hidden, float(seq * batch), tp
    sp = sequence_parallel and t > 1
    if recompute == "full":
        return 2 * sb * h / (t if sp else 1)
    replicated = 4 * h + 2 * h + 2 * h + (2 * h if dropout else 0)
    sharded = 2 * q_width + 4 * kv_width + 2 * q_width + (6 if gated else 4) * ffn
    if scores and recompute == "none":
        sharded += (5 if dropout else 2) * heads * seq
    return sb * (replicated / (t if sp else 1) + sharded / t)


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
