"""Activation checkpointing: trade recomputation in backward for activation memory.

"full" keeps only each block's input and recomputes the block in backward; "selective"
recomputes only the attention core (softmax(qkᵀ)v), the part whose activations grow with
the sequence squared (Korthikanti et al. 2022): on meshlab's blocks by wrapping their
``attention.core``, on any other model's blocks by an op-level policy (torch's selective
checkpointing, as torchtitan's op-level SAC) that keeps the matmuls' outputs and recomputes
the attention kernels and the elementwise ops between them.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from meshlab.parallel.blocks import find_blocks, items

MODES = ("none", "selective", "full")


def apply_ac(model: nn.Module, mode: str, *, blocks: str | None = None) -> nn.Module:
    """Checkpoint every block ("full") or every attention core ("selective"); the blocks are
    found, or taken from the path ``blocks``."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {MODES}")
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    _no_cache_in_training(model)
    container = find_blocks(model, blocks)[1]
    for key, block in items(container):
        core = getattr(getattr(block, "attention", None), "core", None)
        if mode == "full":
            container[key] = checkpoint_wrapper(block, preserve_rng_state=False)  # type: ignore[index]
        elif core is not None:  # meshlab's blocks name their attention core
            attention: Any = block.attention

            def recomputed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           core: Any = core) -> torch.Tensor:
                return checkpoint(core, q, k, v, use_reentrant=False)

            attention.core = recomputed
        else:  # any other model: recompute the attention kernels' ops, keep the rest
            container[key] = checkpoint_wrapper(  # type: ignore[index]
                block, preserve_rng_state=False,
                context_fn=partial(create_selective_checkpoint_contexts, _recompute_attention))
    return model


def _no_cache_in_training(model: nn.Module) -> None:
    """A transformers model builds a KV cache by default, also in training; recomputing a
    block would then attend to its keys twice. transformers' own gradient checkpointing
    turns the cache off in training, and so does this (per call: the config is untouched)."""
    if "use_cache" not in inspect.signature(model.forward).parameters:
        return

    def no_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, ({**kwargs, "use_cache": False} if module.training else kwargs)

    model.register_forward_pre_hook(no_cache, with_kwargs=True)


def _recompute_attention(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep the matmuls' outputs, recompute everything else: the attention kernels, and the
    cheap elementwise ops between. Keeping other outputs is not safe on any model: a later
    op may write into them in place (Mixtral divides its top-k weights in place, an MoE
    layer adds experts into a zeros tensor), which selective checkpointing refuses in
    backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    return (CheckpointPolicy.MUST_SAVE if op in _matmuls()
            else CheckpointPolicy.PREFER_RECOMPUTE)


def _matmuls() -> set[Any]:
    aten = torch.ops.aten
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
            aten.linear.default}
