"""KernelSpec (what a benchmark or test needs to know about a kernel) and shared input checks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_ROW = 65536
"""Longest row a one-block-per-row kernel takes (register pressure on GPU, as in Liger-Kernel)."""


@dataclass(frozen=True)
class KernelSpec:
    """A Triton kernel, its plain-torch reference and how to build and size a problem for it."""

    name: str
    kernel: Callable[..., torch.Tensor]
    """meshlab's Triton version."""
    reference: Callable[..., torch.Tensor]
    """Plain torch, same signature."""
    inputs: Callable[[int, int, torch.dtype, torch.device], tuple[torch.Tensor, ...]]
    """(rows, n, dtype, device) -> the positional arguments for a rows x n problem, tensors
    that need gradients created with requires_grad=True (deterministic: a seeded generator)."""
    bytes_moved: Callable[[tuple[torch.Tensor, ...]], int]
    """bytes the forward reads and writes (for GB/s)."""
    flops: Callable[[tuple[torch.Tensor, ...]], int] | None = None
    """Floating-point operations of the forward, where they matter (these kernels are
    memory-bound, so None)."""


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int,
                  *, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """A seeded tensor of shift + scale * N(0, 1) values that requires grad."""
    x = shift + scale * torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return x.to(device=device, dtype=dtype).requires_grad_()


def nbytes(*tensors: torch.Tensor) -> int:
    """Total size of the tensors' elements in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)


def num_warps(block: int) -> int:
    """Warps per program for a row block of this many elements (Liger-Kernel's choice)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


def check_rows(name: str, t: torch.Tensor, *, max_row: int | None = MAX_ROW) -> None:
    """Raise ValueError unless t is a non-empty float tensor whose rows a kernel can take."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}; the Triton kernels take float32, "
                         "float16 or bfloat16: convert it with .float()")
    if t.dtype == torch.bfloat16 and t.device.type == "cpu":
        # Measured: the interpreter truncates fp32 -> bf16 instead of rounding to nearest.
        raise ValueError(f"{name} is bfloat16 on CPU, where Triton's interpreter rounds "
                         "bfloat16 results toward zero: use float32 or float16 on CPU, or a GPU")
    if t.dim() == 0 or t.numel() == 0:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected at least one "
                         "non-empty row (..., n)")
    if max_row is not None and t.shape[-1] > max_row:
        raise ValueError(f"{name} has rows of {t.shape[-1]} elements; this kernel holds a row "
                         f"in one block, at most {max_row}")
