"""Softmax over the last dimension in Triton: one program per row, the row in one block.

The forward keeps its output y; the backward needs only y and the incoming gradient:
dx = y * (dy - sum(dy * y)).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from meshlab.kernels.spec import KernelSpec, check_rows, nbytes, num_warps, random_tensor


@triton.jit
def _forward(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * n + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < n
    x = tl.load(x_ptr + offsets, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # shifted by the max so exp cannot overflow
    tl.store(y_ptr + offsets, (e / tl.sum(e, axis=0)).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(dy_ptr, y_ptr, dx_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * n + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < n
    y = tl.load(y_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=mask)


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, n)
        y = torch.empty_like(x2)
        block = triton.next_power_of_2(x2.shape[1])
        _forward[(x2.shape[0],)](x2, y, x2.shape[1], BLOCK=block, num_warps=num_warps(block))
        ctx.save_for_backward(y)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        dx = torch.empty_like(y)
        block = triton.next_power_of_2(y.shape[1])
        _backward[(y.shape[0],)](dy.reshape(y.shape).contiguous(), y, dx, y.shape[1],
                                 BLOCK=block, num_warps=num_warps(block))
        return dx.view(dy.shape)


def softmax(x: torch.Tensor) -> torch.Tensor:
    """Softmax of x (..., n) over its last dimension."""
    check_rows("x", x)
    return _Softmax.apply(x)


def softmax_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain torch softmax over the last dimension."""
    return torch.softmax(x, dim=-1)


SPEC = KernelSpec(
    name="softmax", kernel=softmax, reference=softmax_reference,
    inputs=lambda rows, n, dtype, device: (random_tensor((rows, n), dtype, device, seed=0),),
    bytes_moved=lambda args: 2 * nbytes(args[0]))  # reads x, writes y
