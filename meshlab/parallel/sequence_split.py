"""The sequence split over the cp ranks: each rank's slice, where it starts, the whole
sequence gathered back, and the causal mask of a slice's queries over the whole sequence's
keys. What every context-parallel implementation shares (context, context_transformers)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from meshlab.parallel.blocks import owner_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

HEAD_SPLIT = ("ulysses", "chunked")  # heads split over cp (Ulysses' all-to-all)


class _GatherSequence(torch.autograd.Function):
    """All-gather along a dim; backward: sum the gradient over ranks, keep our chunk."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # every rank's queries used our keys
        rank, size = dist.get_rank(ctx.group), dist.get_world_size(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """The whole sequence from every rank's slice, differentiably."""
    return cast(torch.Tensor, _GatherSequence.apply(x, group, dim))


class SliceOfSequence:
    """Where this cp rank's slice starts in the current forward: ``rank * length`` of the
    slice the forward got, so a batch of any length cp divides keeps its positions (the
    plan's seq_len is not assumed). The slices must be equal, as ``sequence_slice`` makes
    them: it refuses a length cp does not divide, on every rank alike."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.offset = 0

    def set(self, length: int) -> None:
        self.offset = self.rank * length


def decoder_of(model: nn.Module) -> Any:
    """The transformers base model (``model.model``, ``model.gpt_neox``, ...: its
    ``base_model_prefix``) of a causal LM or of one of its pipeline stages, or the base model
    itself; None for any other model."""
    # a transformers model has loaded this module; importing it for any other model costs
    # 5 to 12 seconds (every family's import table, torchao, dynamo) in parallelize
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is None:
        return None
    PreTrainedModel = modeling.PreTrainedModel
    owner = owner_of(model)
    prefix = getattr(owner, "base_model_prefix", "") or ""
    inner = model._modules.get(prefix) if prefix else None
    if isinstance(inner, PreTrainedModel):
        return inner
    return model if isinstance(model, PreTrainedModel) else None  # a base model itself


def causal_mask(query_pos: torch.Tensor, keys_pos: torch.Tensor, *, window: int | None,
                additive: torch.dtype | None, chunk: int | None = None) -> torch.Tensor:
    """(Tq, Tk) mask of the keys each query sees (causal, within a sliding ``window``, or
    within its ``chunk``-token block): bool, or with ``additive`` a dtype, 0 / -inf-like
    scores for eager attention to add."""
    mask = keys_pos[None, :] <= query_pos[:, None]
    if window is not None:  # as transformers' sliding_window_overlay
        mask = mask & (keys_pos[None, :] > query_pos[:, None] - window)
    if chunk is not None:  # as transformers' chunked_overlay (Llama4's local layers)
        mask = mask & (keys_pos[None, :] // chunk == query_pos[:, None] // chunk)
    if additive is not None:
        return torch.zeros(mask.shape, dtype=additive, device=mask.device
                           ).masked_fill(~mask, torch.finfo(additive).min)
    return mask


def sequence_slice(tokens: torch.Tensor, mesh: DeviceMesh, *, axis: str = "cp") -> torch.Tensor:
    """This cp rank's slice of (B, T) tokens or targets (T a multiple of cp)."""
    cp = mesh[axis]
    if tokens.shape[1] % cp.size():
        raise ValueError(f"sequence_slice: {tokens.shape[1]} tokens do not split evenly over "
                         f"cp={cp.size()}; expected a multiple of {cp.size()}: trim or pack the "
                         f"sequences to a multiple of {cp.size()} tokens")
    return tokens.chunk(cp.size(), dim=1)[cp.get_local_rank()].contiguous()
