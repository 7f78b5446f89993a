"""Context parallel: each rank of the cp axis holds a contiguous slice of every sequence.

Attention needs every earlier key, so each rank all-gathers K and V along the sequence and
masks causally from its own offset. torch's context_parallel has no CPU sharding strategy
for the flash-attention op (causal or backward) in 2.13, so on CPU this is meshlab's own,
exact implementation ("meshlab"); its backward sums the key/value gradients from every rank.
(A ring pass would keep only one remote chunk in memory at a time; the all-gather is
simpler.) On CUDA ranks the default is torch's own ring attention ("torch"), attached to the
attention core the way torchtitan does, with contiguous slices (no load balancing) so the
RoPE offsets stay those of meshlab's slices.

A transformers model (calling attention through transformers' AttentionInterface) takes
the same all-gather (meshlab.parallel.context_transformers): the keys and values of the
whole sequence go into the model's own attention function with a mask for this rank's
queries, and a forward pre-hook on its base model gives the rotary embedding this rank's
positions. It trains on whole, unpadded sequences: a padding attention_mask, a KV cache or
torch's ring attention are refused with the fix to make; a whole model is proved on a probe
sequence first (meshlab.parallel.context_proof).

Two more trade the slices for heads instead (both models, any device): "ulysses"
(DeepSpeed-Ulysses, meshlab.parallel.context_ulysses: an all-to-all gives each rank the
whole sequence for a cp-th of the heads, so the bytes per rank stay constant when sequence
and cp grow together) and "chunked" (FPDT-style, meshlab.parallel.context_chunked: Ulysses'
layout with the sequence through attention in ``cp_chunks`` chunks, each recomputed in
backward, the key/value chunks optionally in host memory, ``cp_offload``). This module is
the dispatcher: ``apply_cp(model, mesh, seq_len=..., impl=...)``.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from meshlab.mesh import axis_size
from meshlab.parallel.sequence_split import (
    HEAD_SPLIT,
    SliceOfSequence,
    decoder_of,
    gather_sequence,
)
from meshlab.parallel.sequence_split import sequence_slice as sequence_slice  # users' import

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# the models apply_cp splits (compose refuses others before any rank builds anything)
TAKES = ("meshlab's Transformer and transformers' models whose attention goes through "
         "transformers' AttentionInterface")


def takes(model: nn.Module) -> bool:
    from meshlab.models import Transformer

    if isinstance(model, Transformer):
        return True
    decoder = decoder_of(model)
    return decoder is not None and decoder._can_set_attn_implementation()


IMPLEMENTATIONS = ("auto", "meshlab", "torch", "ulysses", "chunked")


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
        if decoder_of(model) is None:
            raise ValueError(f"context parallel is applied to {TAKES}, not yet to "
                             f"{type(model).__name__}: build the mesh without cp")
        from meshlab.parallel.context_transformers import apply_cp_transformers

        return apply_cp_transformers(model, cp, seq_len=seq_len, impl=impl, tp=tp,
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


