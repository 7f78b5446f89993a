"""The attention a GPU runs, where a dry run's fake CPU tensors would run another.

A training step's attention in transformers passes no mask (``is_causal``: no padding, one
sequence a row, so a flash kernel runs); given fake position ids, which it cannot read for
packed sequences, transformers builds a sequence x sequence mask the kernel then keeps.
Within ``causal_without_mask`` fake position ids are what the dry run gives: one sequence a
row.

torch's CPU attention kernel (FlashAttention's) takes values as wide as the queries and
keys; for values narrower than them (multi-head latent attention: DeepSeek's 192-wide
queries and keys, 128-wide values) it falls back to the math path, which keeps every
score. A GPU runs those through a fused kernel (memory-efficient or cuDNN attention) that
keeps the queries, keys, values, output and an fp32 log-sum-exp per head and token. Within
``FusedAttention`` such a call on fake tensors runs the memory-efficient kernel's op, whose
shapes torch computes on any device. Plain torch, rank side.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class FusedAttention(TorchFunctionMode):
    """F.scaled_dot_product_attention with values narrower than the queries, on fake
    tensors: the memory-efficient kernel's op (the module's docstring)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and _narrow_values(*args[:3]):
            return _efficient(*args, **kwargs)
        return func(*args, **kwargs)


def _narrow_values(q: Any = None, k: Any = None, v: Any = None) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return (all(type(t) is FakeTensor for t in (q, k, v))  # not a DTensor: its own rules
            and v.shape[-1] < q.shape[-1])


def _efficient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
               is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> torch.Tensor:
    if enable_gqa and k.shape[-3] != q.shape[-3]:  # the kernel takes a key per head
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], -3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], -3)
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # the kernel adds a bias
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill(
            ~attn_mask, float("-inf"))
    out = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)
    return out[0]


@contextlib.contextmanager
def causal_without_mask() -> Iterator[None]:
    """Within: transformers skips the causal mask of a step whose position ids are fake, as
    it does for real ones of one sequence a row (the module's docstring). Nothing where the
    model did not import transformers (importing it costs a worker a second)."""
    if "transformers" not in sys.modules:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor
    from transformers import masking_utils

    packed = masking_utils.find_packed_sequence_indices

    def one_sequence_a_row(position_ids: torch.Tensor) -> torch.Tensor | None:
        # the dry run's rows are one sequence each (positions 0, 1, ...): nothing packed
        return None if isinstance(position_ids, FakeTensor) else packed(position_ids)

    masking_utils.find_packed_sequence_indices = one_sequence_a_row
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = packed
