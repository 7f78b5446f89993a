"""How many bytes a model needs per device: ZeRO and activation formulas, and a measurement.

Runs on the ranks. ``zero_bytes`` and ``activation_bytes_per_layer`` are the closed-form
estimates from the ZeRO and Megatron sequence-parallelism papers; ``measure`` counts the
bytes this process really holds for a module's parameters, gradients and optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

ZERO_STAGES = (0, 1, 2, 3)
RECOMPUTE_MODES = ("none", "selective", "full")


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


@dataclass(slots=True)
class MemoryReport:
    """Bytes this process holds for parameters, gradients and optimizer state."""

    params: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


def _local(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's own numel() is the global tensor's; we want this rank's shard.
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    return t


def _count(tensors: Iterable[torch.Tensor], seen: set[tuple[int, int, int]]) -> int:
    total = 0
    for tensor in tensors:
        t = _local(tensor)
        if t.device.type == "meta":  # no storage behind it
            continue
        nbytes = t.numel() * t.element_size()
        # Key on the byte range, not the storage alone: tied weights share one range and are
        # counted once, while views into one flat buffer (DDP grad buckets, FSDP1 flat params)
        # are distinct ranges and each count.
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()) * t.element_size(), nbytes)
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
    return total


def measure(model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state this process actually holds."""
    seen: set[tuple[int, int, int]] = set()  # shared, so no tensor counts in two categories
    params = list(model.parameters())  # already deduplicates tied parameters
    n_params = _count(params, seen)
    n_grads = _count((p.grad for p in params if p.grad is not None), seen)
    n_optim = 0
    if optimizer is not None:
        # ZeroRedundancyOptimizer (and similar wrappers) keep this rank's shard in `.optim`.
        inner = getattr(optimizer, "optim", None)
        opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        n_optim = _count((v for state in opt.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor)), seen)
    return MemoryReport(params=n_params, grads=n_grads, optimizer=n_optim)


def activation_bytes(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward of ``model`` on this process.

    Parameters that matmuls save are not activations and are left out; a tensor saved
    twice counts once. Compare plans (checkpointing, sequence parallel) by this number;
    it is not Korthikanti's per-layer formula, which also counts dropout masks.
    """
    params = {_data_ptr(_local(p)) for p in model.parameters()}
    seen: set[tuple[int, int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = _local(t)
        ptr = _data_ptr(local)
        key = (ptr, int(local.storage_offset()), local.numel())
        if ptr not in params and key not in seen and local.device.type != "meta":
            seen.add(key)
            total += local.numel() * local.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return total


def _data_ptr(t: torch.Tensor) -> int:
    # FSDP frees the storage of unsharded parameters between uses: no pointer to compare
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:
        return -1
