"""Context parallel: each rank of the cp axis holds a contiguous slice of every sequence.

Attention needs every earlier key, so each rank all-gathers K and V along the sequence and
masks causally from its own offset. torch's context_parallel has no CPU sharding strategy
for the flash-attention op (causal or backward) in 2.13, so on CPU this is meshlab's own,
exact implementation ("meshlab"); its backward sums the key/value gradients from every rank.
(A ring pass would keep only one remote chunk in memory at a time; the all-gather is
simpler.) On CUDA ranks the default is torch's own ring attention ("torch"), attached to the
attention core the way torchtitan does, with contiguous slices (no load balancing) so the
RoPE offsets stay those of meshlab's slices.

A transformers causal LM (LlamaForCausalLM and the like, calling attention through
transformers' AttentionInterface) takes the same all-gather, registered as an attention
implementation of its own that wraps the model's own (eager or sdpa): the keys and values
of the whole sequence go into the model's attention function with a mask for this rank's
queries, so what that function does (Gemma's logit softcapping, sinks, a float32 softmax)
comes along; and a forward pre-hook on its decoder gives the rotary embedding this rank's
positions (``position_ids`` from the rank's offset) when the caller gives none. It trains
on whole, unpadded sequences: a padding attention_mask, a KV cache or torch's ring
attention are refused with the fix to make.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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


# the models apply_cp splits (compose refuses others before any rank builds anything)
TAKES = ("meshlab's Transformer and transformers' causal LMs (model.embed_tokens, model.layers, "
         "model.norm, lm_head; attention through "
         "transformers' AttentionInterface)")


def takes(model: nn.Module) -> bool:
    from meshlab.models import Transformer
    from meshlab.parallel.pipeline import is_causal_lm

    if isinstance(model, Transformer):
        return True
    decoder = _decoder(model)
    return is_causal_lm(model) and decoder is not None and decoder._can_set_attn_implementation()


def _decoder(model: nn.Module) -> Any:
    """The transformers decoder (model.model, a PreTrainedModel holding the layers) of a
    causal LM or of one of its pipeline stages; None for any other model."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    inner = getattr(model, "model", None)
    if isinstance(inner, PreTrainedModel) and hasattr(inner, "layers"):
        return inner
    return None


IMPLEMENTATIONS = ("auto", "meshlab", "torch")


def apply_cp(model: nn.Module, mesh: DeviceMesh, *, seq_len: int, axis: str = "cp",
             impl: str = "auto") -> nn.Module:
    """Make every attention layer attend across the cp ranks' slices of the sequence.

    impl: "meshlab" (all-gather K/V, any device), "torch" (torch's ring attention, CUDA
    only) or "auto" (torch's on CUDA, meshlab's elsewhere). A transformers causal LM (or a
    pipeline stage of one) takes meshlab's only, whatever the device.
    """
    cp = mesh[axis]
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    if seq_len % size:
        raise ValueError(f"cp={size} must divide the sequence length {seq_len}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS}")
    from meshlab.models import Transformer

    if not isinstance(model, Transformer):
        if _decoder(model) is None:
            raise ValueError(f"context parallel is applied to {TAKES}, not yet to "
                             f"{type(model).__name__}: build the mesh without cp")
        return _apply_cp_transformers(model, cp, seq_len=seq_len, impl=impl)
    if impl == "auto":
        impl = "torch" if cp.device_type == "cuda" else "meshlab"
    if impl == "torch" and cp.device_type != "cuda":
        raise ValueError(f"impl='torch': torch's context parallel attention has no "
                         f"{cp.device_type} sharding strategy in torch {torch.__version__}; "
                         "use impl='meshlab' (or 'auto')")
    chunk = seq_len // size
    offset = rank * chunk
    transformer: Any = model  # a meshlab Transformer
    transformer.seq_offset = offset  # RoPE positions start where our slice does

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = gather_sequence(k, group, 2), gather_sequence(v, group, 2)  # (B,H,T,D)
        query_pos = torch.arange(offset, offset + q.shape[2], device=q.device)[:, None]
        keys_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=keys_pos <= query_pos)

    if impl == "torch":
        core = _torch_ring_attention(cp)
    for block in cast(nn.ModuleDict, model.layers).values():
        attention: Any = block.attention
        attention.core = core
    return model


_NAMES = itertools.count()  # transformers' attention registry is global: one name per apply


def _apply_cp_transformers(model: nn.Module, cp: DeviceMesh, *, seq_len: int, impl: str
                           ) -> nn.Module:
    """All-gather K/V attention for a transformers causal LM (or a pipeline stage of one)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    decoder = _decoder(model)
    kind = type(decoder).__name__
    if impl == "torch":
        raise ValueError(f"impl='torch': torch's ring attention is attached to meshlab's "
                         f"Transformer only, not yet to {kind}; use impl='meshlab' (or 'auto')")
    if not decoder._can_set_attn_implementation():
        raise ValueError(f"context parallel needs {kind} to call its attention through "
                         "transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS), which "
                         "it does not: build the mesh without cp")
    wrapped = decoder.config._attn_implementation
    if wrapped not in ("eager", "sdpa"):
        raise ValueError(f"context parallel wraps the model's eager or sdpa attention, and "
                         f"{kind} uses {wrapped!r}: build it with attn_implementation='sdpa' "
                         "(or 'eager'), or build the mesh without cp")
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    chunk = seq_len // size
    offset = rank * chunk

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """transformers' attention interface: (B, H, T/cp, D) local q, k, v in; the keys and
        values of the whole sequence gathered, then the model's own attention function run
        on them with a mask for this rank's queries (so softcapping, sinks, its float32
        softmax, all it does, come along)."""
        if attention_mask is not None:
            raise ValueError(f"context parallel got an attention mask of shape "
                             f"{tuple(attention_mask.shape)}; expected None (its attention "
                             "is causal over whole, unpadded sequences): pass "
                             "attention_mask=None")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise ValueError(f"context parallel got a non-causal {type(module).__name__}; "
                             "expected causal attention: build the mesh without cp")
        keys, values = gather_sequence(key, group, 2), gather_sequence(value, group, 2)
        query_pos = torch.arange(offset, offset + query.shape[2], device=query.device)[:, None]
        keys_pos = torch.arange(keys.shape[2], device=query.device)[None, :]
        mask = keys_pos <= query_pos
        window = kwargs.get("sliding_window")
        if window is not None:  # as transformers' sliding_window_overlay
            mask = mask & (keys_pos > query_pos - window)
        if wrapped == "eager":  # eager adds its mask to the scores
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device
                               ).masked_fill(~mask, torch.finfo(query.dtype).min)
        own = (ALL_ATTENTION_FUNCTIONS[wrapped] if wrapped != "eager" else
               sys.modules[type(module).__module__].eager_attention_forward)
        return cast(tuple[torch.Tensor, Any],
                    own(module, query, keys, values, mask[None, None], **kwargs))

    name = f"meshlab_cp_{next(_NAMES)}"
    AttentionInterface.register(name, attention)
    # an implementation create_causal_mask does not know: it passes the caller's mask through
    decoder.set_attn_implementation(name)
    if decoder.config._attn_implementation != name:
        raise ValueError(f"context parallel could not set {kind}'s attention implementation "
                         f"(it stayed {decoder.config._attn_implementation!r}): build the mesh "
                         "without cp")
    decoder.register_forward_pre_hook(_slice_inputs_hook(decoder, offset, chunk, seq_len, size),
                                      with_kwargs=True)
    return model


def _slice_inputs_hook(decoder: nn.Module, offset: int, chunk: int, seq_len: int, size: int
                       ) -> Any:
    """A forward pre-hook giving the decoder this rank's positions, and refusing what the
    all-gather attention cannot do (padding, a KV cache, a slice of the wrong length)."""
    positional = [p.name for p in inspect.signature(decoder.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {**dict(zip(positional, args, strict=False)), **kwargs}
        args = args[len(positional):]
        inputs = kwargs.get("input_ids")
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        if inputs is not None and inputs.shape[1] != chunk:
            raise ValueError(f"context parallel: this rank's slice has {inputs.shape[1]} "
                             f"tokens; expected seq_len/cp = {seq_len}/{size} = {chunk}: feed "
                             "each cp rank sequence_slice(tokens, mesh) of a "
                             f"{seq_len}-token batch (or set the plan's seq_len to the "
                             "batches' length)")
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or not bool(mask.all()):
                raise ValueError(f"context parallel got an attention_mask of shape "
                                 f"{tuple(mask.shape)} that masks some tokens; expected "
                                 "None or all ones (its attention is causal over whole, "
                                 "unpadded sequences): pack sequences without padding and "
                                 "pass attention_mask=None")
            kwargs["attention_mask"] = None  # all ones: nothing to mask
        if kwargs.get("past_key_values") is not None:
            raise ValueError("context parallel got a KV cache (past_key_values); expected "
                             "None (each rank holds only its slice of the keys): pass "
                             "past_key_values=None, or build the mesh without cp to generate")
        kwargs["use_cache"] = False  # a cache would hold only this rank's keys
        if kwargs.get("position_ids") is None and inputs is not None:
            positions = torch.arange(offset, offset + chunk, device=inputs.device)
            kwargs["position_ids"] = positions.unsqueeze(0)  # rotary angles of our slice
        return args, kwargs

    return hook


class _CausalAttention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _torch_ring_attention(cp: DeviceMesh) -> Any:
    """torch's context-parallel SDPA on local (B, H, T/cp, D) slices, as torchtitan wires it."""
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _cp_options,
        _enable_context_parallel_dispatcher,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    # Our slices are contiguous (rank r holds positions [r*T/cp, (r+1)*T/cp)); with load
    # balancing on, torch would assume its head-tail layout and mask the wrong blocks.
    _cp_options.enable_load_balance = False
    _enable_context_parallel_dispatcher()
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    ring = parallelize_module(_CausalAttention(), cp, style)
    return ring.__call__  # a bound method: nn.Module would register a module as a child


def sequence_slice(tokens: torch.Tensor, mesh: DeviceMesh, *, axis: str = "cp") -> torch.Tensor:
    """This cp rank's slice of (B, T) tokens or targets."""
    cp = mesh[axis]
    return tokens.chunk(cp.size(), dim=1)[cp.get_local_rank()].contiguous()
