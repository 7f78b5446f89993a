"""Mean cross-entropy of logits (N, V) against integer targets (N,), fused and chunked in Triton.

One program per row walks the vocabulary in chunks of BLOCK (at most MAX_CHUNK) columns.

Forward: an online logsumexp (running max and rescaled sum of exponentials) gives each row's
lse in one pass; the loss of a row is lse - logits[target]. Only lse (N floats) is saved.

Backward: one more chunked pass per row recomputes softmax = exp(logits - lse) and writes
(softmax - onehot(target)) * grad / n_valid straight into the gradient tensor, in the logits'
dtype. So the only (N, V) tensor this op allocates is the gradient autograd returns: no fp32
copy of half-precision logits (meshlab.models.llama.loss_fn makes one), no saved log-softmax
(F.cross_entropy keeps one, N x V, for its backward). Liger-Kernel goes one step further and
writes the gradient into the logits buffer during the forward, saving the backward's re-read
of the logits and the gradient's allocation at the price of destroying its input; meshlab
keeps its inputs intact and pays one extra read of the logits.

Rows whose target is ignore_index add nothing to the loss or the gradient, and the mean is
over the other rows, as in F.cross_entropy. The loss is float32 whatever the logits' dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from meshlab.kernels.spec import KernelSpec, check_rows, nbytes, num_warps, random_tensor

MAX_CHUNK = 32768
"""Vocabulary columns a program holds at once (Liger-Kernel's size); larger vocabularies loop."""


@triton.jit
def _forward(logits_ptr, target_ptr, loss_ptr, lse_ptr, vocab, ignore_index,
             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * vocab
    cols = tl.arange(0, BLOCK)
    running_max = tl.full((), -float("inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)  # of exp(logit - running_max)
    for start in range(0, vocab, BLOCK):
        x = tl.load(logits_ptr + start + cols, mask=start + cols < vocab,
                    other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) \
            + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(target_ptr + row)
    # Masked so an out-of-range target cannot read outside the row
    x_target = tl.load(logits_ptr + target, mask=(target >= 0) & (target < vocab),
                       other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(target != ignore_index, lse - x_target, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _backward(logits_ptr, target_ptr, lse_ptr, scale_ptr, grad_ptr, vocab, ignore_index,
              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * vocab
    grad_ptr += row * vocab
    cols = tl.arange(0, BLOCK)
    target = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    scale = tl.where(target != ignore_index, tl.load(scale_ptr), 0.0)  # grad / n_valid
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(logits_ptr + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp(x - lse) - tl.where(start + cols == target, 1.0, 0.0)
        tl.store(grad_ptr + start + cols, (grad * scale).to(grad_ptr.dtype.element_ty),
                 mask=mask)


def _block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), MAX_CHUNK)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
        rows, vocab = logits.shape
        loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(loss)
        block = _block(vocab)
        _forward[(rows,)](logits, target, loss, lse, vocab, ignore_index, BLOCK=block,
                          num_warps=num_warps(block))
        n_valid = (target != ignore_index).sum()  # a tensor: no host sync on GPU
        ctx.save_for_backward(logits, target, lse, n_valid)
        ctx.ignore_index = ignore_index
        return loss.sum() / n_valid

    @staticmethod
    def backward(ctx: Any, dloss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, target, lse, n_valid = ctx.saved_tensors
        grad = torch.empty_like(logits)
        scale = (dloss.float() / n_valid).reshape(1)
        block = _block(logits.shape[1])
        _backward[(logits.shape[0],)](logits, target, lse, scale, grad, logits.shape[1],
                                      ctx.ignore_index, BLOCK=block, num_warps=num_warps(block))
        return grad, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                  ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of logits (N, V) or (B, T, V) against targets (N,) or (B, T)."""
    check_rows("logits", logits, max_row=None)
    if logits.dim() not in (2, 3) or target.shape != logits.shape[:-1]:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} do not "
                         "fit: expected logits (N, V) with target (N,), or (B, T, V) with (B, T)")
    if target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"target has dtype {target.dtype}; "
                         "expected class indices (int64 or int32)")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}")
    vocab = logits.shape[-1]
    target = target.reshape(-1).contiguous()
    if target.device.type == "cpu":  # on GPU the check would cost a sync; the kernel masks
        bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
        if bad.any():
            raise ValueError(f"target holds {target[bad][0].item()}, outside 0..{vocab - 1} "
                             f"(the vocabulary) and not ignore_index={ignore_index}")
    return _CrossEntropy.apply(logits.reshape(-1, vocab).contiguous(), target, ignore_index)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor,
                            ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy on (N, V) logits, (B, T, V) flattened first; half logits in fp32."""
    logits = logits.reshape(-1, logits.shape[-1])
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return F.cross_entropy(logits, target.reshape(-1), ignore_index=ignore_index)


def _inputs(rows: int, n: int, dtype: torch.dtype,
            device: torch.device) -> tuple[torch.Tensor, ...]:
    target = torch.randint(0, n, (rows,), generator=torch.Generator().manual_seed(1))
    return random_tensor((rows, n), dtype, device, seed=0), target.to(device)


SPEC = KernelSpec(
    name="cross_entropy", kernel=cross_entropy, reference=cross_entropy_reference,
    inputs=_inputs,
    # reads logits and targets, writes a float32 loss and lse per row
    bytes_moved=lambda args: nbytes(*args) + 8 * args[1].numel())
