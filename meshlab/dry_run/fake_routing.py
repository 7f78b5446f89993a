"""Routing without values, for a dry run (meshlab.dry_run.run): a top-k router's choices, and
the token counts expert parallelism exchanges, depend on values a fake tensor does not
have. Every expert gets the same share of the token-expert pairs (the planner's
assumption too), known in advance:

- meshlab's MoE routes pair j to expert j mod E, still running its router;
- a transformers MoE's experts run as ``grouped_mm`` (transformers' choice on a GPU: one
  grouped matmul over the pairs sorted by expert, whose shapes do not depend on the
  routing), and under expert parallelism meshlab's exchange is told the even sizes.

Plain torch, rank side.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from functools import partial
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def balanced_routing(model: nn.Module) -> int:
    """Every MoE layer of ``model`` routes its token-expert pairs evenly (see the module's
    docstring; ``values_known`` gives transformers' the sizes under expert parallelism).
    The number of layers changed."""
    from meshlab.models.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for moe in layers:
        moe.route = MethodType(_route_evenly, moe)  # type: ignore[method-assign]
        ep = moe.dispatch.keywords if isinstance(moe.dispatch, partial) else None
        moe.dispatch = partial(_exchange_evenly, group=ep["group"] if ep else None,
                               ranks=ep["ranks"] if ep else 1)
    grouped = [m for m in model.modules()
               if hasattr(getattr(m, "config", None), "_experts_implementation")
               and hasattr(m, "_is_expert_parallel")]
    for experts in grouped:
        # a copy: the user's config object (the factory's) keeps its own choice
        config: Any = copy.copy(experts.config)
        config._experts_implementation = "grouped_mm"
        experts.config = config
    return len(layers) + len(grouped)


@contextlib.contextmanager
def values_known() -> Iterator[None]:
    """Within: expert parallelism's exchange is told even sizes (``even_sizes``), and
    transformers' grouped experts run in any dtype on a fake CPU tensor (torch's
    grouped_mm takes bf16 only; other dtypes run transformers' own fallback, the same
    shapes and memory; where the model imported transformers: importing it costs a worker
    a second)."""
    from meshlab.parallel import expert

    counted = expert.routed_sizes
    expert.routed_sizes = even_sizes
    moe: Any = None
    if "transformers" in sys.modules:
        from transformers.integrations import moe
    can = moe._can_use_grouped_mm if moe else None

    def bf16_only(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> bool:
        return weight.dtype == torch.bfloat16 and bool(can and can(input, weight, offs))

    if moe:
        moe._can_use_grouped_mm = bf16_only
    try:
        yield
    finally:
        expert.routed_sizes = counted
        if moe and can:
            moe._can_use_grouped_mm = can


def even_sizes(flat: torch.Tensor, n_experts: int, group: Any, ranks: int
               ) -> tuple[list[int], list[int], torch.Tensor]:
    """meshlab.parallel.expert.routed_sizes under even routing: every rank sends each
    expert the same count, so it receives what it sends."""
    send, mine = _even_split(flat.numel(), n_experts, group, ranks)
    return send, [sum(mine)] * ranks, torch.tensor([mine] * ranks, device=flat.device)


def _even_split(pairs: int, n_experts: int, group: Any, ranks: int
                ) -> tuple[list[int], list[int]]:
    """Under even routing: the pairs this rank sends each rank, and those each of its
    local experts receives from every source alike."""
    import torch.distributed as dist

    local = n_experts // ranks
    me = dist.get_rank(group) if ranks > 1 else 0
    per_expert = _shares(pairs, n_experts)  # pairs each global expert gets
    send = [sum(per_expert[r * local:(r + 1) * local]) for r in range(ranks)]
    return send, per_expert[me * local:(me + 1) * local]


def _route_evenly(self: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scores = self.router(x).float()  # the router's own work; its choices need values
    weights, _ = scores.topk(self.top_k, dim=-1)
    weights = F.softmax(weights, dim=-1).type_as(x)
    pairs = torch.arange(x.shape[0] * self.top_k, device=x.device)
    return (pairs % self.n_experts).view(x.shape[0], self.top_k), weights


def _shares(pairs: int, parts: int) -> list[int]:
    """How many of ``pairs`` consecutive pair indices fall on each residue mod ``parts``."""
    return [pairs // parts + (1 if e < pairs % parts else 0) for e in range(parts)]


def _exchange_evenly(moe: Any, tokens: torch.Tensor, experts: torch.Tensor,
                     weights: torch.Tensor, *, group: Any, ranks: int) -> torch.Tensor:
    """meshlab.parallel.expert.exchange with the sizes of even routing known in advance
    (every rank sends each expert the same count, so it receives what it sends)."""
    from meshlab.models.moe import index_add_rows
    from meshlab.parallel.expert import all_to_all, run_local_experts

    flat = experts.flatten()
    order = flat.argsort(stable=True)
    token_of_pair = (torch.arange(flat.numel(), device=flat.device) // experts.shape[1])[order]
    send, mine = _even_split(flat.numel(), moe.n_experts, group, ranks)
    routed = tokens[token_of_pair]
    arrived = routed
    if ranks > 1:
        arrived = all_to_all(routed, send=send, recv=[sum(mine)] * ranks, group=group)
        received = moe.get_buffer("tokens_received")
        received.add_(torch.tensor(mine, device=received.device) * ranks)
    done = run_local_experts(moe, arrived, [mine] * ranks)
    returned = done
    if ranks > 1:
        returned = all_to_all(done, send=[sum(mine)] * ranks, recv=send, group=group)
    gate = weights.flatten()[order, None]
    out = torch.zeros_like(tokens)
    return index_add_rows(out, token_of_pair, (returned * gate).to(out.dtype))
