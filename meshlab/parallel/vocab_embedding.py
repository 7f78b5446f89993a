"""A vocabulary-parallel embedding whose gradient stays this rank's rows (Megatron-LM's
VocabParallelEmbedding, in torch's ParallelStyle).

torch's ``RowwiseParallel`` on an ``nn.Embedding`` shards the table by rows but hands its
weight a ``Replicate`` gradient at the whole vocabulary: every tp rank holds vocab x hidden
gradient bytes (Llama 3's 128,256 x 16,384 in fp32 is 7.8 GiB) where its rows are 1/tp of
that. ``VocabParallelEmbedding`` shards the table the same way (the same parameter, so FSDP2,
ties and checkpoints see no difference) and looks tokens up in this rank's rows only: a token
outside them reads row 0 and is zeroed, and the ranks' outputs sum to the table's (a
``Partial`` the style's output layout reduces, as torch's does). The gradient is then this
rank's rows, a ``Shard(0)`` DTensor like the weight.
"""

from __future__ import annotations

from types import MethodType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor.parallel import RowwiseParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class VocabParallelEmbedding(RowwiseParallel):
    """RowwiseParallel for an ``nn.Embedding``, computed on this rank's rows (module
    docstring); any other module is RowwiseParallel's."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if type(module).forward is nn.Embedding.forward:  # a subclass's own forward stays
            module.forward = MethodType(_on_local_rows, module)
        return module


def _on_local_rows(m: nn.Embedding, tokens: torch.Tensor) -> torch.Tensor:
    """The embedding's forward on this rank's rows of the table."""
    weight = m.weight
    if not isinstance(weight, DTensor) or weight.placements != (Shard(0),):
        return nn.Embedding.forward(m, tokens)  # not laid out as this style lays it out
    ids = tokens.to_local() if isinstance(tokens, DTensor) else tokens
    rows = weight.to_local()
    # Shard(0) splits as torch.chunk does: ceil(vocab / tp) rows a rank, the last fewer
    coordinate = weight.device_mesh.get_coordinate()
    assert coordinate is not None  # this rank holds the weight
    start = min(coordinate[0] * -(-weight.shape[0] // weight.device_mesh.size()),
                weight.shape[0])
    end = start + rows.shape[0]
    outside = (ids < start) | (ids >= end)
    padding = m.padding_idx if m.padding_idx is not None and start <= m.padding_idx < end \
        else None
    out = F.embedding((ids - start).masked_fill(outside, 0), rows,
                      None if padding is None else padding - start, m.max_norm, m.norm_type,
                      m.scale_grad_by_freq, m.sparse)
    out = out.masked_fill(outside.unsqueeze(-1), 0)
    return DTensor.from_local(out, weight.device_mesh, [Partial()], run_check=False)
