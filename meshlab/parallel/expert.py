"""Expert parallel: each rank of the ep axis keeps n_experts / ep of every MoE layer's experts.

Tokens travel to the rank that holds their expert and back with all-to-all, through
``all_to_all`` below: the plain dist.all_to_all_single is invisible to autograd, and the
experts would silently get no gradient (torch's autograd version,
torch.distributed.nn.functional.all_to_all_single, warns it is deprecated since torch 2.13).
ep is carved out of dp_shard x cp (meshlab.mesh), so the ranks of an ep group also hold
different data.

Two kinds of MoE layer are split, both through the one exchange below (``exchange``):

- meshlab's own (meshlab.models.moe.MoE): apply_ep installs the dispatch on each layer
  (``moe.dispatch``), so the model itself never imports this module.
- a transformers MoE model (Mixtral, Qwen3-MoE, OLMoE, ...): the experts modules and their
  stacked (num_experts, ...) weights are those its config's ``base_model_ep_plan`` names
  ("ep_dispatch_experts" and "grouped_gemm", transformers' own EP plan). apply_ep keeps this
  rank's slice of those weights and replaces the experts module's forward: the router's
  global expert ids are exchanged, and the arrived tokens run through the module's own
  forward (whatever ``config._experts_implementation`` it uses) on local expert ids with
  weight 1, as transformers' AllToAllEP does; the routing weights are applied on the way back.
  The router's auxiliary loss is not made global: with ``output_router_logits`` and labels,
  each rank's aux loss sees only its own tokens (as under any data parallelism).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshlab.mesh import axis_size
from meshlab.models.moe import MoE, index_add_rows
from meshlab.parallel.accumulate import gradient_sync
from meshlab.parallel.blocks import clean_name, owner_of
from meshlab.parallel.materialize import mark_slice

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


# the models apply_ep splits (compose refuses others before any rank builds anything)
TAKES = ("meshlab's Transformer and transformers' MoE models whose config has an EP plan "
         "(base_model_ep_plan: Mixtral, Qwen3-MoE, OLMoE, ...)")

# the styles of transformers' EP plan apply_ep knows: the experts module, and a weight stacked
# along its first dimension (one slice per expert)
EXPERTS, STACKED = "ep_dispatch_experts", "grouped_gemm"


def takes(model: nn.Module) -> bool:
    from meshlab.models import Transformer

    return isinstance(model, Transformer) or bool(_experts_modules(model))


def apply_ep(model: nn.Module, mesh: DeviceMesh, *, axis: str = "ep",
             average: bool = True) -> nn.Module:
    """Keep this rank's slice of the experts, send tokens to their experts' ranks, and
    average gradients like one process would (``average=False``: not yet; a trainer that
    goes on to replace the parameters, as tensor parallel does, calls ``average_gradients``
    once they are final: hooks and marks sit on parameter objects)."""
    ep = mesh[axis]
    size, rank = ep.size(), ep.get_local_rank()
    from meshlab.models import Transformer

    if not isinstance(model, Transformer) and _ep_plan(model):
        kept = _apply_ep_transformers(model, ep.get_group(), size, rank)
        _remember_experts(model, kept)
        if average:
            average_gradients(model, mesh)
        return model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        if isinstance(model, Transformer):
            raise ValueError("expert parallelism needs an MoE model: ModelConfig(n_experts=...)")
        raise ValueError(f"expert parallel (ep={size}) is applied to {TAKES}; "
                         f"{type(model).__name__} has neither meshlab's MoE layers nor an EP plan "
                         "in its config: build the mesh without ep")
    for moe in moes:
        if moe.n_experts % size:
            raise ValueError(f"ep={size} must divide n_experts={moe.n_experts}")
        local = moe.n_experts // size
        for name in ("w1", "w2", "w3"):
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local]
                                            .clone()))
            mark_slice(moe, name, dim=0, start=rank * local)
        moe.dispatch = partial(dispatch_and_combine, group=ep.get_group(), ranks=size,
                               local=local)
        moe.register_buffer("tokens_received", torch.zeros(local, dtype=torch.long),
                            persistent=False)
    _remember_experts(model, {id(p) for moe in moes for p in (moe.w1, moe.w2, moe.w3)})
    if average:
        average_gradients(model, mesh)
    return model


EXPERT_NAMES = "_meshlab_expert_parameters"


def _remember_experts(model: nn.Module, kept: set[int]) -> None:
    """The expert slices' names (ids do not survive a strategy that replaces parameters)."""
    names = {clean_name(n) for n, p in model.named_parameters() if id(p) in kept}
    object.__setattr__(model, EXPERT_NAMES, names)


def average_gradients(model: nn.Module, mesh: DeviceMesh, *, axis: str = "ep") -> None:
    """Average gradients over the data ranks as one process would, on the parameters the
    model holds now, and mark the expert slices for the gradient norm (each ep rank holds
    other experts, so the whole model's norm sums theirs)."""
    from meshlab.parallel.clip import PARTS

    names: set[str] = getattr(model, EXPERT_NAMES, set())
    experts = {id(p) for n, p in model.named_parameters() if clean_name(n) in names}
    _average_gradients(model, mesh, experts)
    group = mesh[axis].get_group()
    for p in model.parameters():
        if id(p) in experts:
            setattr(p, PARTS, group)


def _ep_plan(model: nn.Module) -> dict[str, str]:
    """transformers' EP plan of a model, or of the model a pipeline stage is part of (its
    config's ``base_model_ep_plan``), or {}."""
    owner = owner_of(model)
    plan = getattr(getattr(owner, "config", None), "base_model_ep_plan", None)
    return dict(plan) if isinstance(plan, dict) else {}


def _matches(pattern: str, name: str) -> bool:
    """Does module or parameter ``name`` (of the whole model) match a plan ``pattern``
    (relative to the base model, ``*`` standing for a layer index)?"""
    regex = re.escape(pattern).replace(r"\*", r"\d+")
    return re.fullmatch(rf"(?:.+\.)?{regex}", name) is not None


def _experts_modules(model: nn.Module) -> list[tuple[str, Any]]:
    """The experts modules the model's EP plan names, by name."""
    plan = _ep_plan(model)
    return [(name, module) for name, module in model.named_modules()
            if any(s == EXPERTS and _matches(p, name) for p, s in plan.items())]


def _apply_ep_transformers(model: nn.Module, group: Any, size: int, rank: int) -> set[int]:
    """Split the experts modules the model's EP plan names; the ids of the kept slices."""
    plan, kind = _ep_plan(model), type(model).__name__
    unknown = {p: s for p, s in plan.items() if s not in (EXPERTS, STACKED)}
    if unknown:
        raise ValueError(f"{kind}'s EP plan has {unknown}; meshlab's expert parallel splits "
                         f"only {EXPERTS!r} modules and their {STACKED!r} weights: build the "
                         "mesh without ep")
    modules = _experts_modules(model)
    if not modules and "causal_lm" not in model.__dict__:  # a stage's blocks may hold none
        raise ValueError(f"{kind}'s EP plan names experts modules {sorted(plan)} but the model "
                         "has none of them: build the mesh without ep")
    kept: set[int] = set()
    for name, experts in modules:
        n = getattr(experts, "num_experts", None)
        if not isinstance(n, int) or n % size:
            raise ValueError(f"ep={size} must divide the experts of {name} (num_experts={n}): "
                             f"build the mesh with an ep that divides {n}")
        local = n // size
        for pname, param in list(experts.named_parameters(recurse=False)):
            full = f"{name}.{pname}"
            stacked = any(s == STACKED and _matches(p, full) for p, s in plan.items())
            if not stacked or param.dim() < 1 or param.shape[0] != n:
                raise ValueError(f"{full} {tuple(param.shape)} is not a weight stacked over "
                                 f"the {n} experts in {kind}'s EP plan (expected "
                                 f"'{STACKED}' with first dimension {n}): build the mesh "
                                 "without ep")
            piece = nn.Parameter(param.detach()[rank * local:(rank + 1) * local].clone(),
                                 requires_grad=param.requires_grad)
            setattr(experts, pname, piece)
            mark_slice(experts, pname, dim=0, start=rank * local)
            kept.add(id(piece))
        experts.register_buffer("tokens_received", torch.zeros(local, dtype=torch.long),
                                persistent=False)
        own = experts.forward  # the model's own computation, on local expert ids
        experts.num_experts = local
        # an instance attribute: nn.Module.__call__ runs it in place of the class's forward
        experts.forward = partial(_transformers_dispatch, own, n, experts.tokens_received,
                                  group=group, ranks=size)
    return kept


def _transformers_dispatch(own: Callable[..., torch.Tensor], n_experts: int,
                           received: torch.Tensor, hidden_states: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                           group: Any, ranks: int) -> torch.Tensor:
    """A transformers experts module's forward under ep: (tokens, global top-k expert ids,
    their weights) -> the weighted sum of each token's experts, as the unsplit module."""
    local = n_experts // ranks

    def run(arrived: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(local, device=counts.device).repeat(ranks)
        # the length is known: no wait for the counts' values
        ids = ids.repeat_interleave(counts.flatten(), output_size=arrived.shape[0])[:, None]
        ones = arrived.new_ones(ids.shape)
        if arrived.shape[0]:
            return own(arrived, ids, ones)
        # no token for this rank's experts: a zero-row run keeps them in the backward graph,
        # so they get a (zero) gradient like the unsplit module's
        return own(arrived.sum(0, keepdim=True), ids.new_zeros(1, 1), ones.new_ones(1, 1))[:0]

    return exchange(hidden_states, top_k_index, top_k_weights, n_experts=n_experts,
                    run=run, received=received, group=group, ranks=ranks)


def _average_gradients(model: nn.Module, mesh: DeviceMesh, experts: set[int]) -> None:
    """The single-process gradient is the mean over all data ranks (with cp, the ranks
    holding different parts of the sequences count too: dp_cp).

    A replicated (non-expert) parameter sums its gradient over every such rank. An expert
    (``experts``: the ids of the kept slices) already received the gradients of every token
    routed to it from its ep group, so it only sums over its replicas in the other ep groups.
    Both then divide by the number of those ranks.
    """
    data = axis_size(mesh, "dp_cp")
    dp_group = mesh["dp_cp"].get_group() if data > 1 else None
    replicas = axis_size(mesh, "dp_shard_mod_ep") * axis_size(mesh, "dp_replicate")
    replica_group = _expert_replica_group(mesh) if replicas > 1 else None
    # gradient accumulation holds the reduction back to the last micro-step: the hook sees
    # the accumulated .grad, so reducing it every micro-step would scale the earlier ones
    # by 1/data again and again (a pipeline holds it for the whole step: sync.flush)
    sync = gradient_sync(model)
    reduced = [(p, replica_group if id(p) in experts else dp_group)
               for p in model.parameters() if p.requires_grad]

    def reduce(param: torch.Tensor, group: Any) -> None:
        assert param.grad is not None
        # a tensor-parallel gradient: the data ranks hold the same shard of it
        grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
        if group is not None:
            dist.all_reduce(grad, group=group)
        grad.div_(data)

    def reduce_all() -> None:
        for param, group in reduced:
            if param.grad is not None:
                reduce(param, group)

    sync.flushes.append(reduce_all)
    for p, group in reduced:
        p.register_post_accumulate_grad_hook(
            lambda param, group=group: reduce(param, group) if sync.now else None)


def _expert_replica_group(mesh: DeviceMesh) -> Any:
    dims = [d for d in ("dp_replicate", "dp_shard_mod_ep") if axis_size(mesh, d) > 1]
    sub = mesh[tuple(dims)]
    return sub.get_group() if len(dims) == 1 else sub._flatten("ep_replicas").get_group()


def dispatch_and_combine(moe: MoE, tokens: torch.Tensor, experts: torch.Tensor,
                         weights: torch.Tensor, *, group: Any, ranks: int, local: int
                         ) -> torch.Tensor:
    """meshlab's MoE layer: send each (token, expert) pair to the expert's rank among the
    ``ranks`` of ``group`` (each holding ``local`` experts), run it there, bring it back."""

    def run(arrived: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return run_local_experts(moe, arrived, counts.tolist())

    return exchange(tokens, experts, weights, n_experts=moe.n_experts, run=run,
                    received=moe.get_buffer("tokens_received"), group=group, ranks=ranks)


def run_local_experts(moe: MoE, arrived: torch.Tensor, counts: list[list[int]]
                      ) -> torch.Tensor:
    """Rows that arrived from each source, ``counts[source][e]`` for each local expert e in
    that order -> each row's expert output, in the same order. Each expert runs once on the
    rows of every source: autocast keeps a 16-bit copy of the weights of each call for its
    backward, so one call per source would keep ``ranks`` copies of every expert."""
    ranks, local = len(counts), len(counts[0])
    starts, at = [], 0
    for row in counts:
        starts.append([at + sum(row[:e]) for e in range(local)])
        at += sum(row)
    if ranks == 1:
        index = None
        grouped = arrived
    else:  # source-major -> expert-major
        index = torch.cat([torch.arange(starts[s][e], starts[s][e] + counts[s][e])
                           for e in range(local) for s in range(ranks)]).to(arrived.device)
        grouped = arrived[index]
    sizes = [sum(counts[s][e] for s in range(ranks)) for e in range(local)]
    done = torch.cat([moe.experts(rows, e) for e, rows in enumerate(grouped.split(sizes))])
    if index is None:
        return done
    return done[index.argsort()]


def routed_sizes(flat: torch.Tensor, n_experts: int, group: Any, ranks: int
                 ) -> tuple[list[int], list[int], torch.Tensor]:
    """(global expert ids, experts, group, ranks) -> the exchange's sizes: rows to each rank,
    rows from each rank, and rows from each source rank for each local expert. Counted here
    and told to every rank (a dry run, whose tensors have no values, knows them instead:
    meshlab.dry_run.fake_routing)."""
    counts = torch.bincount(flat, minlength=n_experts).view(ranks, n_experts // ranks)
    received_counts = torch.empty_like(counts)
    dist.all_to_all_single(received_counts, counts, group=group)  # sizes only: no autograd
    return counts.sum(1).tolist(), received_counts.sum(1).tolist(), received_counts


def exchange(tokens: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, *,
             n_experts: int, run: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             received: torch.Tensor, group: Any, ranks: int) -> torch.Tensor:
    """Tokens (N, dim) with their top-k global expert ids and weights (N, k) -> the weighted
    sum of their experts' outputs (N, dim), the experts spread evenly over the ``ranks`` of
    ``group``. ``run(arrived, counts)`` runs this rank's experts on the rows that arrived:
    ``counts[source, e]`` rows from each source rank for each local expert, in that order.
    ``received`` (local,) counts the rows each local expert got."""
    flat = experts.flatten()  # (N * k,) global expert ids
    order = flat.argsort(stable=True)  # group the pairs by expert, hence by owner rank
    token_of_pair = (torch.arange(flat.numel(), device=flat.device) // experts.shape[1])[order]
    send, recv, received_counts = routed_sizes(flat, n_experts, group, ranks)

    routed = tokens[token_of_pair]
    arrived = all_to_all(routed, send=send, recv=recv, group=group)
    received.add_(received_counts.sum(0).detach())
    done = run(arrived, received_counts)
    returned = all_to_all(done, send=recv, recv=send, group=group)  # the way back
    gate = weights.flatten()[order, None]
    out = torch.zeros_like(tokens)
    # the weights may be wider than the tokens (transformers' routers give float32)
    return index_add_rows(out, token_of_pair, (returned * gate).to(out.dtype))


class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single seen by autograd: each row's gradient goes back the way it came."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int],
                group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _all_to_all(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _all_to_all(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: Any
                ) -> torch.Tensor:
    out = rows.new_empty(sum(recv), *rows.shape[1:])
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def all_to_all(rows: torch.Tensor, *, send: list[int], recv: list[int], group: Any
               ) -> torch.Tensor:
    """Rows (N, ...) -> the rows the other ranks sent here (sum(recv), ...), in rank order:
    the first ``send[r]`` rows go to rank r of ``group`` after those for ranks < r, and
    ``recv[r]`` rows arrive from it. Differentiable."""
    return cast(torch.Tensor, _AllToAll.apply(rows, send, recv, group))
