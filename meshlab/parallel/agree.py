"""Refusals every rank agrees on. Ranks can refuse different things (a pipeline's ranks build
different stages; a meta-device model's ranks fill different parts): one rank raising alone
would leave the others waiting in their next collective, so each says whether it refused and
every rank raises when any did."""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree(problem: str | None, elsewhere: str) -> None:
    """Raise ValueError(``problem``) on a rank that has one, ``elsewhere`` on the rest, when
    any rank of the world has one; return on every rank when none has."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1 if problem else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() and problem is None:
            problem = elsewhere
    if problem:
        raise ValueError(problem)
