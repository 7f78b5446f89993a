"""Context parallel for a transformers model (or a pipeline stage of one): the same all-gather,
registered as an attention implementation of its own that wraps the model's own (eager or
sdpa), so what that function does (Gemma's logit softcapping, sinks, a float32 softmax) comes
along; a forward pre-hook on its base model gives the rotary embedding this rank's positions.
Ulysses and chunked split the heads instead. What CP cannot keep is refused by name, and a
whole model is proved on a probe sequence before it trains (context_proof)."""

from __future__ import annotations

import inspect
import itertools
import sys
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from meshlab.parallel.sequence_split import (
    HEAD_SPLIT,
    SliceOfSequence,
    causal_mask,
    decoder_of,
    gather_sequence,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


_NAMES = itertools.count()  # transformers' attention registry is global: one name per apply
_WRAPS: dict[str, str] = {}  # meshlab's implementation -> the model's own one it wraps


def apply_cp_transformers(model: nn.Module, cp: DeviceMesh, *, seq_len: int, impl: str,
                           tp: int = 1, chunks: int = 4, offload: Any = None) -> nn.Module:
    """Context-parallel attention for a transformers causal LM (or a pipeline stage of one):
    all-gather K/V ("meshlab"), or heads split over cp ("ulysses", "chunked")."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    decoder = decoder_of(model)
    kind = type(decoder).__name__
    if impl == "torch":
        raise ValueError(f"impl='torch': torch's ring attention is attached to meshlab's "
                         f"Transformer only, not yet to {kind}; use impl='meshlab' (or 'auto')")
    if not decoder._can_set_attn_implementation():
        raise ValueError(f"context parallel needs {kind} to call its attention through "
                         "transformers' AttentionInterface (ALL_ATTENTION_FUNCTIONS), which "
                         "it does not: build the mesh without cp")
    # a rank holding two stages of one model (interleaved schedules) shares their config: the
    # second stage finds the first's implementation set, and wraps what that one wraps
    wrapped = _WRAPS.get(decoder.config._attn_implementation, decoder.config._attn_implementation)
    if wrapped not in ("eager", "sdpa"):
        raise ValueError(f"context parallel wraps the model's eager or sdpa attention, and "
                         f"{kind} uses {wrapped!r}: build it with attn_implementation='sdpa' "
                         "(or 'eager'), or build the mesh without cp")
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    recurrent = sorted({type(m).__name__ for m in decoder.modules() if "Mamba" in type(m).__name__
                        and not any("Mamba" in type(c).__name__ for c in m.children())})
    if recurrent:
        raise ValueError(f"context parallel splits the sequence over cp={size}, and {kind} has "
                         f"state-space layers ({', '.join(recurrent)}) whose recurrence runs "
                         "from each token's state to the next across the whole sequence: no "
                         "rank can start its slice without the state the one before ends "
                         "with: build the mesh without cp")
    _refuse_local_positions(decoder.config, kind)
    where = SliceOfSequence(rank)
    split = _head_split(decoder, kind, group, size, impl=impl, tp=tp, chunks=chunks,
                        offload=offload)
    from meshlab.parallel.context_proof import Proof

    proof = Proof(model, size) if Proof.possible(model) else None  # before CP is installed

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  **kwargs: Any) -> tuple[torch.Tensor, Any]:
        """transformers' attention interface: (B, H, T/cp, D) local q, k, v in; the model's
        own attention function run on the keys and values of the whole sequence (gathered,
        or for a slice of the heads) with a mask for the queries it gets (so softcapping,
        its float32 softmax, all it does, come along)."""
        if attention_mask is not None:
            raise ValueError(f"context parallel got an attention mask of shape "
                             f"{tuple(attention_mask.shape)}; expected None (its attention "
                             "is causal over whole, unpadded sequences): pass "
                             "attention_mask=None")
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise ValueError(f"context parallel got a non-causal {type(module).__name__}; "
                             "expected causal attention: build the mesh without cp")
        own = (ALL_ATTENTION_FUNCTIONS[wrapped] if wrapped != "eager" else
               sys.modules[type(module).__module__].eager_attention_forward)
        window = kwargs.get("sliding_window")
        block = _attention_chunk(module)
        additive = query.dtype if wrapped == "eager" else None  # eager adds it to the scores

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
                ) -> torch.Tensor:
            """The model's own attention of (B, h, c, D) queries from ``start`` over the
            keys from 0: (B, h, c, D) out (transformers returns (B, c, h, D))."""
            query_pos = torch.arange(start, start + q.shape[2], device=q.device)
            keys_pos = torch.arange(k.shape[2], device=q.device)
            mask = causal_mask(query_pos, keys_pos, window=window, additive=additive,
                               chunk=block)
            return cast(torch.Tensor, own(module, q, k, v, mask[None, None], **kwargs)[0]
                        ).transpose(1, 2)

        if split is not None:  # weights of a head slice are no model's output
            return split(query, key, value, run).transpose(1, 2).contiguous(), None
        keys, values = gather_sequence(key, group, 2), gather_sequence(value, group, 2)
        query_pos = torch.arange(where.offset, where.offset + query.shape[2],
                                 device=query.device)
        mask = causal_mask(query_pos, torch.arange(keys.shape[2], device=query.device),
                           window=window, additive=additive, chunk=block)
        return cast(tuple[torch.Tensor, Any],
                    own(module, query, keys, values, mask[None, None], **kwargs))

    name = f"meshlab_cp_{next(_NAMES)}"
    AttentionInterface.register(name, attention)
    _WRAPS[name] = wrapped
    # an implementation create_causal_mask does not know: it passes the caller's mask through
    decoder.set_attn_implementation(name)
    if decoder.config._attn_implementation != name:
        raise ValueError(f"context parallel could not set {kind}'s attention implementation "
                         f"(it stayed {decoder.config._attn_implementation!r}): build the mesh "
                         "without cp")
    decoder.register_forward_pre_hook(_slice_inputs_hook(decoder, where), with_kwargs=True)
    if proof is not None:
        proof.check(model, kind, group, rank, size)
    return model


# how transformers names the attention of a layer (config.layer_types): those CP masks itself
LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention")


def _refuse_local_positions(config: Any, kind: str) -> None:
    """Refuse what would read positions from this rank's slice, or mask in a way meshlab does
    not rebuild, before any rank trains (a silent difference from one process otherwise)."""
    kinds = set(getattr(config, "layer_types", None) or ()) - set(LAYER_KINDS)
    if kinds:
        raise ValueError(f"context parallel rebuilds the attention masks of "
                         f"{', '.join(LAYER_KINDS)} layers, and {kind} also has "
                         f"{', '.join(sorted(kinds))} layers: build the mesh without cp")
    nope = [i for i, rope in enumerate(getattr(config, "no_rope_layers", None) or ()) if not rope]
    if getattr(config, "attn_temperature_tuning", False) and nope:
        raise ValueError(f"context parallel: {kind}'s attention temperature on its layers "
                         f"without RoPE ({nope[:4]}...) counts positions from 0 in each "
                         "rank's slice (torch.arange over the local tokens), so every cp "
                         "rank but the first would scale its queries as if its slice began "
                         "the sequence: build the mesh without cp, or the model with "
                         "attn_temperature_tuning=False")


def _attention_chunk(module: nn.Module) -> int | None:
    """The block length of a chunked-attention layer (Llama4's local layers), else None."""
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    kinds = getattr(config, "layer_types", None)
    if kinds and isinstance(index, int) and kinds[index] == "chunked_attention":
        return int(cast(Any, config).attention_chunk_size)
    return None


def _head_split(decoder: Any, kind: str, group: Any, size: int, *, impl: str, tp: int,
                chunks: int, offload: Any) -> Any:
    """For "ulysses" and "chunked": ``split(q, k, v, run)``, the heads split over cp and
    ``run(q, k, v, start)`` (one model attention call) on the whole sequence or chunk by
    chunk; None for the all-gather. Head counts that do not split are refused here."""
    if impl not in HEAD_SPLIT:
        return None
    from meshlab.parallel.context_chunked import chunked_attention
    from meshlab.parallel.context_ulysses import check_heads, refuse_head_parameters, ulysses

    config = decoder.config
    heads = config.num_attention_heads
    check_heads(heads, getattr(config, "num_key_value_heads", None) or heads, size, impl=impl,
                kind=kind, tp=tp)
    refuse_head_parameters(decoder, impl=impl)

    def split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: Any) -> torch.Tensor:
        if impl == "ulysses":
            return ulysses(q, k, v, group, lambda a, b, c: run(a, b, c, 0))
        return ulysses(q, k, v, group, partial(
            chunked_attention, chunks=chunks, attend=run, offload=offload))

    return split


def _slice_inputs_hook(decoder: nn.Module, where: SliceOfSequence) -> Any:
    """A forward pre-hook giving the decoder this rank's positions, and refusing what the
    all-gather attention cannot do (padding, a KV cache)."""
    positional = [p.name for p in inspect.signature(decoder.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
             ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        kwargs = {**dict(zip(positional, args, strict=False)), **kwargs}
        args = args[len(positional):]
        inputs = kwargs.get("input_ids")
        inputs = kwargs.get("inputs_embeds") if inputs is None else inputs
        if inputs is not None:
            where.set(inputs.shape[1])
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2 or not bool(mask.all()):
                raise ValueError(f"context parallel got an attention_mask of shape "
                                 f"{tuple(mask.shape)} that masks some tokens; expected "
                                 "None or all ones (its attention is causal over whole, "
                                 "unpadded sequences): pack sequences without padding and "
                                 "pass attention_mask=None")
            kwargs["attention_mask"] = None  # all ones: nothing to mask
        for cache in ("past_key_values", "cache"):
            if kwargs.get(cache) is not None:
                raise ValueError(f"context parallel got a KV cache ({cache}); expected None "
                                 f"(each rank holds only its slice of the keys): pass "
                                 f"{cache}=None, or build the mesh without cp to generate")
        kwargs["use_cache"] = False  # a cache would hold only this rank's keys
        if kwargs.get("position_ids") is None and inputs is not None:
            positions = torch.arange(where.offset, where.offset + inputs.shape[1],
                                     device=inputs.device)
            kwargs["position_ids"] = positions.unsqueeze(0)  # rotary angles of our slice
        return args, kwargs

    return hook
