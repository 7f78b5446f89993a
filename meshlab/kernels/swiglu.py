"""SwiGLU's gating, silu(gate) * up, in Triton: one program per row, the row in one block.

The backward recomputes silu and sigmoid from the saved gate and up rather than keeping them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from meshlab.kernels.spec import KernelSpec, check_rows, nbytes, num_warps, random_tensor
from meshlab.models import llama


@triton.jit
def _forward(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * n + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < n
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Round silu to the input dtype first, as F.silu(gate) * up does
    silu = (gate * tl.sigmoid(gate)).to(gate_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offsets, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _backward(dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * n + tl.arange(0, BLOCK)
    mask = tl.arange(0, BLOCK) < n
    dout = tl.load(dout_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = (gate * sig).to(gate_ptr.dtype.element_ty).to(tl.float32)
    # silu'(g) = sig * (1 + g * (1 - sig))
    dgate = dout * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(dgate_ptr + offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, (dout * silu).to(dup_ptr.dtype.element_ty), mask=mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate2 = gate.reshape(-1, gate.shape[-1]).contiguous()  # (rows, n)
        up2 = up.reshape(gate2.shape).contiguous()
        out = torch.empty_like(gate2)
        block = triton.next_power_of_2(gate2.shape[1])
        _forward[(gate2.shape[0],)](gate2, up2, out, gate2.shape[1], BLOCK=block,
                                    num_warps=num_warps(block))
        ctx.save_for_backward(gate2, up2)
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate2, up2 = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate2), torch.empty_like(up2)
        block = triton.next_power_of_2(gate2.shape[1])
        _backward[(gate2.shape[0],)](dout.reshape(gate2.shape).contiguous(), gate2, up2, dgate,
                                     dup, gate2.shape[1], BLOCK=block, num_warps=num_warps(block))
        return dgate.view(dout.shape), dup.view(dout.shape)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise, for gate and up of the same shape (..., n) and dtype."""
    check_rows("gate", gate)
    check_rows("up", up)
    if (gate.shape, gate.dtype, gate.device) != (up.shape, up.dtype, up.device):
        raise ValueError(f"gate is {tuple(gate.shape)} {gate.dtype} on {gate.device} but up is "
                         f"{tuple(up.shape)} {up.dtype} on {up.device}; they must match")
    return _SwiGLU.apply(gate, up)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch silu(gate) * up."""
    return F.silu(gate) * up


class FeedForward(llama.FeedForward):
    """Drop-in meshlab.models.llama.FeedForward whose gating is the Triton SwiGLU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


SPEC = KernelSpec(
    name="swiglu", kernel=swiglu, reference=swiglu_reference,
    inputs=lambda rows, n, dtype, device: (random_tensor((rows, n), dtype, device, seed=0),
                                           random_tensor((rows, n), dtype, device, seed=1)),
    bytes_moved=lambda args: 3 * nbytes(args[0]))  # reads gate and up, writes the product
