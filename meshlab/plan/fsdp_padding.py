"""FSDP2's padding: each parameter is split on its first dimension into equal chunks, one per
rank of the shard group, padded to ceil(rows / n) rows; a weight with fewer rows than ranks
leaves some ranks a whole row each and others nothing but padding. A rank then holds more
than an even split, and a gathered unit more than the weights (meshlab.plan.differences
names both beside a dry run).

The tensors are a Llama-style model's (meshlab's Transformer or a transformers decoder),
split by tensor parallelism first as meshlab's plans split them: column-parallel weights
(q, k, v, gate, up, the output projection) and the embedding by rows, row-parallel ones (o,
down) by columns. Stacked experts have one row per expert. Pure Python.
"""

from __future__ import annotations

import math

from meshlab.plan.shapes import ModelShape

Tensor = tuple[int, int]
"""(rows, the elements of one row) of one parameter on one tensor-parallel rank."""


def layer_tensors(m: ModelShape, tp: int) -> list[Tensor]:
    """One block's parameters, tp-split."""
    q, kv = m.heads * m.head_width, m.n_kv_heads * m.head_width
    tensors = [(q // tp, m.hidden), (kv // tp, m.hidden), (kv // tp, m.hidden),
               (m.hidden, q // tp), (m.hidden, 1), (m.hidden, 1)]
    if m.experts:  # the router and the stacked experts: a row per expert
        return tensors + [(m.experts, m.hidden)] + [(m.experts, m.hidden * m.ffn // tp)] * 3
    up = [(m.ffn // tp, m.hidden)] * (2 if m.gated_ffn else 1)
    return tensors + up + [(m.hidden, m.ffn // tp)]


def root_tensors(m: ModelShape, tp: int, *, first: bool, last: bool) -> list[Tensor]:
    """The parameters outside the blocks a stage holds: the embedding on the first, the final
    norm and the output projection (unless tied to an embedding here) on the last."""
    tensors = [(m.vocab // tp, m.hidden)] if first else []
    if last:
        tensors.append((m.hidden, 1))
        if not (m.tied_embeddings and first):
            tensors.append((m.vocab // tp, m.hidden))
    return tensors


def elements(tensors: list[Tensor]) -> int:
    return sum(rows * row for rows, row in tensors)


def sharded(tensors: list[Tensor], ranks: int) -> int:
    """Elements one rank of ``ranks`` holds of ``tensors``, padding included."""
    return sum(math.ceil(rows / ranks) * row for rows, row in tensors)


def gathered(tensors: list[Tensor], ranks: int) -> int:
    """Elements of ``tensors`` gathered from ``ranks`` padded shards."""
    return ranks * sharded(tensors, ranks)
