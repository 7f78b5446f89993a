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

Two more trade the slices for heads instead (both models, any device): "ulysses"
(DeepSpeed-Ulysses, meshlab.parallel.context_ulysses: an all-to-all gives each rank the
whole sequence for a cp-th of the heads, so the bytes per rank stay constant when sequence
and cp grow together) and "chunked" (FPDT-style, meshlab.parallel.context_chunked: Ulysses'
layout with the sequence through attention in ``cp_chunks`` chunks, each recomputed in
backward, the key/value chunks optionally in host memory, ``cp_offload``). This module is
the dispatcher: ``apply_cp(model, mesh, seq_len=..., impl=...)``.
"""

from __future__ import annotations

import inspect
import itertools
import sys
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from meshlab.mesh import axis_size

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


IMPLEMENTATIONS = ("auto", "meshlab", "torch", "ulysses", "chunked")
HEAD_SPLIT = ("ulysses", "chunked")  # heads split over cp (Ulysses' all-to-all)


def apply_cp(model: nn.Module, mesh: DeviceMesh, *, seq_len: int, axis: str = "cp",
             impl: str = "auto", chunks: int = 4, offload: bool = False) -> nn.Module:
    """Make every attention layer attend across the cp ranks' slices of the sequence.

    impl: "meshlab" (all-gather K/V, any device), "torch" (torch's ring attention, CUDA
    only), "ulysses" (all-to-all, heads split over cp), "chunked" (Ulysses' layout, the
    sequence through attention in ``chunks`` chunks, K/V chunks in host memory with
    ``offload``: ``model.cp_offload.moved``/``.fetched`` count the bytes) or "auto"
    (torch's on CUDA, meshlab's elsewhere). A transformers causal LM (or a pipeline stage
    of one) takes all but torch's, whatever the device.
    """
    cp = mesh[axis]
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    if seq_len % size:
        raise ValueError(f"cp={size} must divide the sequence length {seq_len}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl={impl!r} is not one of {IMPLEMENTATIONS}")
    from meshlab.models import Transformer
    from meshlab.parallel.context_chunked import KVOffload, check_chunks

    if impl == "chunked":
        check_chunks(chunks, seq_len)
    hooks = KVOffload() if impl == "chunked" and offload else None
    if hooks is not None:
        cast(Any, model).cp_offload = hooks  # bytes of K/V sent to host and fetched back
    tp = axis_size(mesh, "tp")
    if not isinstance(model, Transformer):
        if _decoder(model) is None:
            raise ValueError(f"context parallel is applied to {TAKES}, not yet to "
                             f"{type(model).__name__}: build the mesh without cp")
        return _apply_cp_transformers(model, cp, seq_len=seq_len, impl=impl, tp=tp,
                                      chunks=chunks, offload=hooks)
    if impl == "auto":
        impl = "torch" if cp.device_type == "cuda" else "meshlab"
    if impl == "torch" and cp.device_type != "cuda":
        raise ValueError(f"impl='torch': torch's context parallel attention has no "
                         f"{cp.device_type} sharding strategy in torch {torch.__version__}; "
                         "use impl='meshlab' (or 'auto')")
    transformer: Any = model  # a meshlab Transformer
    where = SliceOfSequence(rank)

    def locate(_: nn.Module, args: tuple[Any, ...]) -> None:
        where.set(args[0].shape[1])
        transformer.seq_offset = where.offset  # RoPE positions start where our slice does

    model.register_forward_pre_hook(locate)

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        keys, values = gather_sequence(k, group, 2), gather_sequence(v, group, 2)  # (B,H,T,D)
        offset = where.offset
        query_pos = torch.arange(offset, offset + q.shape[2], device=q.device)[:, None]
        keys_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=keys_pos <= query_pos)

    if impl == "torch":
        core = _torch_ring_attention(cp)
    if impl in HEAD_SPLIT:
        from meshlab.parallel.context_chunked import chunked_attention, sdpa_block
        from meshlab.parallel.context_ulysses import check_heads, meshlab_core

        cfg = transformer.cfg
        check_heads(cfg.n_heads, cfg.n_kv_heads, size, impl=impl, kind="meshlab's Transformer",
                    tp=tp)
        core = meshlab_core(group, cfg.n_heads // cfg.n_kv_heads,
                            _sdpa_whole if impl == "ulysses" else partial(
                                chunked_attention, chunks=chunks, attend=sdpa_block,
                                offload=hooks))
    for block in cast(nn.ModuleDict, model.layers).values():
        attention: Any = block.attention
        attention.core = core
    return model


def _sdpa_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over the whole sequence (Ulysses' local attention on a head slice)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


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


_NAMES = itertools.count()  # transformers' attention registry is global: one name per apply
_WRAPS: dict[str, str] = {}  # meshlab's implementation -> the model's own one it wraps


def _apply_cp_transformers(model: nn.Module, cp: DeviceMesh, *, seq_len: int, impl: str,
                           tp: int = 1, chunks: int = 4, offload: Any = None) -> nn.Module:
    """Context-parallel attention for a transformers causal LM (or a pipeline stage of one):
    all-gather K/V ("meshlab"), or heads split over cp ("ulysses", "chunked")."""
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
    # a rank holding two stages of one model (interleaved schedules) shares their config: the
    # second stage finds the first's implementation set, and wraps what that one wraps
    wrapped = _WRAPS.get(decoder.config._attn_implementation, decoder.config._attn_implementation)
    if wrapped not in ("eager", "sdpa"):
        raise ValueError(f"context parallel wraps the model's eager or sdpa attention, and "
                         f"{kind} uses {wrapped!r}: build it with attn_implementation='sdpa' "
                         "(or 'eager'), or build the mesh without cp")
    size, rank, group = cp.size(), cp.get_local_rank(), cp.get_group()
    _refuse_local_positions(decoder.config, kind)
    where = SliceOfSequence(rank)
    split = _head_split(decoder, kind, group, size, impl=impl, tp=tp, chunks=chunks,
                        offload=offload)

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
    """This cp rank's slice of (B, T) tokens or targets (T a multiple of cp)."""
    cp = mesh[axis]
    if tokens.shape[1] % cp.size():
        raise ValueError(f"sequence_slice: {tokens.shape[1]} tokens do not split evenly over "
                         f"cp={cp.size()}; expected a multiple of {cp.size()}: trim or pack the "
                         f"sequences to a multiple of {cp.size()} tokens")
    return tokens.chunk(cp.size(), dim=1)[cp.get_local_rank()].contiguous()
