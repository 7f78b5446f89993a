"""FPDT-style context parallel (Yao et al. 2024, the Fully Pipelined Distributed Transformer):
Ulysses' layout, the sequence through attention a chunk at a time.

After Ulysses' all-to-all each rank holds the whole sequence for a cp-th of the heads. The
sequence is then cut into ``cp_chunks`` chunks: query chunk i attends to key/value chunks
0..i (causal), so at most one chunk of queries against the keys so far is scored at once
(chunk x T scores instead of T x T). Each query chunk runs under activation checkpointing:
its backward recomputes its own scores, so backward never holds every chunk's. With
``cp_offload`` the key/value chunks stay in host memory between uses, copied to the device
for each query chunk that reads them (meshlab.parallel.offload's copies and byte count; on
CPU ranks the copy is host to host, so there the path is counted, not a saving). A model
that softmaxes in float32 (transformers' eager attention) matches one process only to
float32's rounding: a chunk's rows leave out the masked keys, so their sums run in another
order.

>>> ParallelPlan(context_parallel="chunked", cp_chunks=8, cp_offload=True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from meshlab.parallel.offload import ActivationOffload

AttendBlock = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
"""One query chunk against the keys before its end: (B, h, c, D) queries starting at
position ``start``, (B, hk, start + c, D) keys and values -> (B, h, c, D)."""


class KVOffload(ActivationOffload):
    """meshlab.parallel.offload's copies for key/value chunks: ``moved`` counts the bytes
    sent to host memory, ``fetched`` those copied back for a query chunk (forward and
    backward's recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.fetched = 0

    def unpack(self, packed: Any) -> torch.Tensor:
        tensor = super().unpack(packed)
        self.fetched += tensor.numel() * tensor.element_size()
        return tensor


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunks: int,
                      attend: AttendBlock, offload: KVOffload | None = None
                      ) -> torch.Tensor:
    """Causal attention of (B, h, T, D) q over (B, hk, T, D) k, v, one query chunk at a time,
    each recomputed in backward; with ``offload`` the key/value chunks wait in host memory."""
    keys, values = k.tensor_split(chunks, dim=2), v.tensor_split(chunks, dim=2)
    held: list[Any] = [*keys, *values]
    if offload is not None:  # to host now; each query chunk fetches what it reads
        held = [offload.pack(part) for part in held]
    outs, start = [], 0
    for i, part in enumerate(q.tensor_split(chunks, dim=2)):
        used = held[:i + 1] + held[chunks:chunks + i + 1]
        outs.append(checkpoint(_block, part, start, used, attend, offload,
                               use_reentrant=False))
        start += part.shape[2]
    return torch.cat(outs, dim=2)


def _block(q: torch.Tensor, start: int, used: list[Any], attend: AttendBlock,
           offload: KVOffload | None) -> torch.Tensor:
    """One query chunk: its key/value chunks fetched (from host with offload) and joined."""
    if offload is not None:
        used = [offload.unpack(part) for part in used]
    half = len(used) // 2
    keys, values = torch.cat(used[:half], dim=2), torch.cat(used[half:], dim=2)
    return attend(q, keys, values, start)


def sdpa_block(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int
               ) -> torch.Tensor:
    """meshlab's attention on one query chunk: SDPA masked causally from ``start``."""
    query_pos = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
    keys_pos = torch.arange(keys.shape[2], device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=keys_pos <= query_pos)


def check_chunks(chunks: int, seq_len: int) -> None:
    """Refuse more chunks than tokens, naming the fix."""
    if chunks > seq_len:
        raise ValueError(f"cp_chunks={chunks} cuts a {seq_len}-token sequence into more "
                         f"chunks than tokens; expected at most {seq_len}: use fewer "
                         "cp_chunks (seq_len / cp_chunks tokens per chunk)")
