"""Synthetic token batches that every process can regenerate exactly.

The global batch is a function of (seed, step); a data-parallel rank takes its rows, so a
single process training on the global batch sees the same tokens as the whole cluster.
"""

from __future__ import annotations

import torch


def global_batch(*, step: int, batch: int, seq: int, vocab: int, seed: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (batch, seq): a random walk so there is something to learn."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    start = torch.randint(0, vocab, (batch, 1), generator=gen)
    steps = torch.randint(1, 4, (batch, seq), generator=gen)
    tokens = (start + steps.cumsum(dim=1)) % vocab  # (B, T + 1) after the start column
    tokens = torch.cat([start, tokens], dim=1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def local_batch(*, step: int, batch: int, seq: int, vocab: int, rank: int, ranks: int,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's rows of the global batch (batch must divide evenly)."""
    if batch % ranks:
        raise ValueError(f"global batch {batch} does not split over {ranks} data-parallel ranks")
    inputs, targets = global_batch(step=step, batch=batch, seq=seq, vocab=vocab, seed=seed)
    rows = slice(rank * batch // ranks, (rank + 1) * batch // ranks)
    return inputs[rows], targets[rows]
