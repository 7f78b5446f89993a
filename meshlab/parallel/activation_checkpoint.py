"""Activation checkpointing: trade recomputation in backward for activation memory.

"full" keeps only each block's input and recomputes the block in backward; "selective"
recomputes only the attention core (softmax(qkᵀ)v), the part whose activations grow with
the sequence squared (Korthikanti et al. 2022).
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def apply_ac(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint every block ("full") or every attention core ("selective")."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {MODES}")
    if mode == "none":
        return model
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = cast(nn.ModuleDict, model.layers)
    for name, block in list(layers.items()):
        if mode == "full":
            layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            attention: Any = block.attention
            core = attention.core

            def recomputed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           core: Any = core) -> torch.Tensor:
                return checkpoint(core, q, k, v, use_reentrant=False)

            attention.core = recomputed
    return model
