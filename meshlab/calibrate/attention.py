"""Fused attention's throughput: each of SDPA's fused kernels that runs here, and SDPA's choice.

The planner costs fused attention at a share of the 16-bit peak per kernel
(``Hardware.attention_efficiency``), so each kernel is timed in bf16, causal, forward and
backward, on every rank at once, and its FLOPs counted as the planner counts them: the two
products over the unmasked half of the square forward, 2.5 times that backward (the kernel
recomputes the scores). A profile then reproduces the measured time exactly.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshlab.measure.timing import median_seconds, slowest, windowed_seconds
from meshlab.plan.compute import attention_backward
from meshlab.plan.layout import Layout

KERNELS = {"flash2": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
"""The planner's kernel names (``hardware.ATTENTION_KERNELS``) as SDPA's backends: its flash
backend is FlashAttention-2 on a GPU (on a CPU, torch's own kernel of the same algorithm)."""
# (batch, heads, positions, head_dim): a training shape on a GPU (the published rates' was
# 1 x 24 x 4,608 x 128); a CPU's small enough to take a fraction of a second
SHAPES = {"cpu": (1, 4, 512, 64), "cuda": (4, 16, 4096, 128)}


def attention_flops(batch: int, heads: int, positions: int, head_dim: int) -> float:
    """FLOPs of one causal forward and backward as the planner counts them."""
    forward = 2 * 2 * batch * heads * positions * positions * head_dim / 2
    return forward * (1 + attention_backward(Layout(flash_attention=True)))


def time_attention(device: torch.device, reps: int,
                   shape: tuple[int, int, int, int] | None = None) -> dict[str, float]:
    """Achieved TFLOP/s of each fused kernel that runs on ``device`` (the slowest rank's),
    by the planner's name; a kernel that does not run here is left out."""
    shape = shape or _shape(device)
    runs = [name for name, backend in KERNELS.items() if _runs(backend, shape, device)]
    if not runs:
        return {}
    seconds = []
    for name in runs:
        step = _step(KERNELS[name], shape, device)
        dist.barrier()  # every rank at once: shared cores and memory show
        seconds.append(median_seconds(step, device, reps, warmup=2) if device.type == "cuda"
                       else windowed_seconds(step, device, reps))
    flops = attention_flops(*shape)
    return {name: flops / s / 1e12
            for name, s in zip(runs, slowest(seconds, device), strict=True)}


def sdpa_default(device: torch.device, shape: tuple[int, int, int, int] | None = None
                 ) -> str:
    """The kernel SDPA picks by itself for a causal bf16 call of ``shape`` here, by the
    planner's name; "" when it picks one the planner has no name for (math, efficient)."""
    shape = shape or _shape(device)
    q = torch.empty(shape, dtype=torch.bfloat16, device=device)
    try:  # SDPA's own dispatch, a private op: without it, say nothing rather than guess
        choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
    except (AttributeError, RuntimeError):
        return ""
    return next((name for name, backend in KERNELS.items() if backend.value == choice), "")


def _shape(device: torch.device) -> tuple[int, int, int, int]:
    return SHAPES["cuda" if device.type == "cuda" else "cpu"]


def _runs(backend: SDPBackend, shape: tuple[int, int, int, int], device: torch.device
          ) -> bool:
    """Whether ``backend`` takes a causal bf16 call of ``shape`` on ``device``; the same
    answer on every rank (one rank's device may lack a kernel another's has)."""
    try:
        with warnings.catch_warnings():  # SDPA warns why each other backend would not run
            warnings.simplefilter("ignore", UserWarning)
            _step(backend, shape, device)()
        ok = 1
    except RuntimeError:  # "No viable backend": not built for, or not supported on, this device
        ok = 0
    flag = torch.tensor([ok], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _step(backend: SDPBackend, shape: tuple[int, int, int, int], device: torch.device
          ) -> Callable[[], None]:
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, device=device, requires_grad=True)
               for _ in range(3))
    grad = torch.randn(shape, dtype=torch.bfloat16, device=device)

    def step() -> None:
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(grad)
        q.grad = k.grad = v.grad = None

    return step
