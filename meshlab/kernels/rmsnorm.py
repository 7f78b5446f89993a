"""RMSNorm over the last dimension in Triton: one program per row, the row in one block.

Same numbers as meshlab.models.llama.RMSNorm: normalise in fp32, round to x's dtype, then
scale by the weight (so the result has torch's promoted dtype of x and weight). The forward
saves x and the per-row 1/rms; the backward recomputes the normalised row from them. grad
weight is summed over rows inside each program (one program per SM on GPU, per row on the CPU
interpreter) and the (programs, n) partial sums are added in torch: no atomics, deterministic.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from meshlab.kernels.spec import KernelSpec, check_rows, nbytes, num_warps, random_tensor
from meshlab.models import llama


@triton.jit
def _forward(x_ptr, w_ptr, y_ptr, rstd_ptr, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    # Round to x's dtype before scaling, as the model does: (x * rstd).type_as(x) * weight
    x_hat = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * n + cols, (x_hat * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, rows, n, rows_per_program,
              BLOCK: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    start = program * rows_per_program
    offsets = start.to(tl.int64) * n + cols
    for row in range(start, tl.minimum(start + rows_per_program, rows)):
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        dx_hat = dy * w
        # d/dx of x * rstd(x): rstd * (g - x_hat * mean(g * x_hat))
        dx = rstd * (dx_hat - x_hat * (tl.sum(dx_hat * x_hat, axis=0) / n))
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat.to(x_ptr.dtype.element_ty).to(tl.float32)
        offsets += n
    tl.store(dw_ptr + program * n + cols, dw, mask=mask)


def _programs(rows: int, device: torch.device) -> int:
    # On GPU one program per SM loops over rows; in the interpreter programs cost the same.
    if device.type == "cuda":
        return min(rows, torch.cuda.get_device_properties(device).multi_processor_count)
    return rows


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, n)
        rows, n = x2.shape
        weight = weight.contiguous()
        y = torch.empty(rows, n, dtype=torch.promote_types(x.dtype, weight.dtype),
                        device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(n)
        _forward[(rows,)](x2, weight, y, rstd, n, eps, BLOCK=block, num_warps=num_warps(block))
        ctx.save_for_backward(x2, weight, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x2, weight, rstd = ctx.saved_tensors
        rows, n = x2.shape
        rows_per_program = triton.cdiv(rows, _programs(rows, x2.device))
        programs = triton.cdiv(rows, rows_per_program)
        dx = torch.empty_like(x2)
        dw = torch.empty(programs, n, dtype=torch.float32, device=x2.device)
        block = triton.next_power_of_2(n)
        _backward[(programs,)](dy.reshape(rows, n).contiguous(), x2, weight, rstd, dx, dw, rows,
                               n, rows_per_program, BLOCK=block, num_warps=num_warps(block))
        return dx.view(dy.shape), dw.sum(0).to(weight.dtype), None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(mean(x², last dim) + eps) * weight, for x (..., n) and weight (n,)."""
    check_rows("x", x)
    check_rows("weight", weight)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight has shape {tuple(weight.shape)} but x has shape "
                         f"{tuple(x.shape)}: weight must be ({x.shape[-1]},), one scale per "
                         "element of x's last dimension")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device} but x is on {x.device}")
    return _RMSNorm.apply(x, weight, eps)


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain torch RMSNorm, the formula of meshlab.models.llama.RMSNorm."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class RMSNorm(llama.RMSNorm):
    """Drop-in meshlab.models.llama.RMSNorm computed by the Triton kernel (same parameters)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rmsnorm(x, self.weight, self.eps)


def _inputs(rows: int, n: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, ...]:
    # A weight away from 1, so that grad x depends on it
    return (random_tensor((rows, n), dtype, device, seed=0),
            random_tensor((n,), dtype, device, seed=1, scale=0.1, shift=1.0))


def _bytes_moved(args: tuple[torch.Tensor, ...]) -> int:
    x, weight = args
    # x in, y out, the weight, and a float32 1/rms per row
    return 2 * nbytes(x) + nbytes(weight) + 4 * (x.numel() // x.shape[-1])


SPEC = KernelSpec(name="rmsnorm", kernel=rmsnorm, reference=rmsnorm_reference, inputs=_inputs,
                  bytes_moved=_bytes_moved)
