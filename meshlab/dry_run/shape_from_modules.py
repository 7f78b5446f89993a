"""The planner's shape of a hand-written decoder, read from its modules (a dry run sets the
planner beside a model with no config the planner knows: nanoGPT as written).

From the model: its repeated blocks (meshlab.parallel.blocks), the token embedding (the
largest ``nn.Embedding``: vocabulary and width) and a learned position table beside it;
from one block, its ``nn.Linear`` layers (and GPT-2's ``Conv1D``): the down projection
(width in, hidden out) gives the feed-forward width, two projections up to it (or one to
twice it) a gated one, a key or value projection narrower than the queries grouped-query
attention; the head count from an attribute the
block, its attention or the model's config sets (``n_head``, ``num_heads``, ...). A shape
is returned only where its parameter count is the model's within ``AGREE`` (the planner's
shape has no biases): otherwise None, and the dry run says it has no planner rows.
Rank side: torch, no notebook.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from meshlab.plan.shapes import ModelShape

HEADS = ("n_head", "n_heads", "num_heads", "num_attention_heads", "heads")
KV_HEADS = ("n_kv_heads", "num_key_value_heads", "n_kv_head", "kv_heads")
AGREE = 0.05
"""How far the shape's parameter count may be from the model's: biases (which the planner's
shape leaves out) are a few percent of a toy model, under 0.1% of a real one."""


def shape_from_modules(model: nn.Module, seq: int | None) -> ModelShape | None:
    """``model``'s planner shape, or None where it cannot be read (the module's docstring)."""
    from meshlab.parallel.blocks import find_blocks, items

    try:
        _, blocks = find_blocks(model)
    except ValueError:
        return None
    layers = [block for _, block in items(blocks)]
    tables = sorted((m for m in model.modules() if isinstance(m, nn.Embedding)),
                    key=lambda m: -m.num_embeddings)
    if not layers or not tables or seq is None:
        return None
    token, hidden = tables[0], tables[0].embedding_dim
    linears = projections(layers[0])
    down = [(i, o) for i, o in linears if o == hidden and i > hidden]
    if len(down) != 1:
        return None
    ffn = down[0][0]
    # a gate and an up projection, or the two fused in one (Phi-3's gate_up_proj)
    up = sum({ffn: 1, 2 * ffn: 2}.get(o, 0) for i, o in linears if i == hidden)
    heads = _attribute(HEADS, layers[0], model)
    if not heads or hidden % heads:
        return None
    narrower = [o for i, o in linears if i == hidden and o < hidden]
    kv_heads = _attribute(KV_HEADS, layers[0], model) or (
        narrower[0] * heads // hidden if narrower else heads)
    head = getattr(model, "lm_head", None) or next(
        (m for m in model.modules() if isinstance(m, nn.Linear)
         and m.out_features == token.num_embeddings), None)
    shape = ModelShape(
        name=type(model).__name__, layers=len(layers), hidden=hidden, heads=heads,
        kv_heads=kv_heads, ffn=ffn, vocab=token.num_embeddings, seq_len=seq,
        gated_ffn=up >= 2,
        tied_embeddings=head is not None and head.weight is token.weight,
        learned_positions=any(t.embedding_dim == hidden for t in tables[1:]),
        layer_norm=any("LayerNorm" in type(m).__name__ for m in model.modules()))
    counted = sum(p.numel() for p in model.parameters())
    return shape if abs(shape.params / counted - 1) <= AGREE else None


def projections(block: nn.Module) -> list[tuple[int, int]]:
    """(width in, width out) of each ``nn.Linear`` in ``block``, and of each GPT-2 ``Conv1D``
    (transformers' transposed linear: weight (in, out), out as ``nf``)."""
    found = []
    for m in block.modules():
        weight, nf = getattr(m, "weight", None), getattr(m, "nf", None)
        if isinstance(m, nn.Linear):
            found.append((m.in_features, m.out_features))
        elif isinstance(nf, int) and isinstance(weight, torch.Tensor) and weight.dim() == 2 \
                and weight.shape[1] == nf:
            found.append((int(weight.shape[0]), nf))
    return found


def _attribute(names: tuple[str, ...], block: nn.Module, model: nn.Module) -> int | None:
    """The first positive int one of ``names`` is set to on the block, its submodules or
    the model's config."""
    for owner in [*block.modules(), getattr(model, "config", None)]:
        for name in names:
            value: Any = getattr(owner, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
