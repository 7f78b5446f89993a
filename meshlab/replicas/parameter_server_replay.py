"""The one-process reference of the parameter server (meshlab.replicas.parameter_server):
the run's logs (which version of each piece every worker computed each clock's gradient on,
and the order every server applied them in) replayed in one process from the same initial
weights; losses and parameters compared at verify's tolerances (float64: 1e-9, 1e-8)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.replicas.parameter_server import ParameterServerSync, mean_in_order

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshlab.parallel.compose import ParallelPlan
    from meshlab.verify.comparison import Comparison
    from meshlab.verify.training import LossFn


def compare_replayed(model: Any, mesh: DeviceMesh, plan: ParallelPlan, *, steps: int = 5,
                     batch: int = 8, seq: int = 16, lr: float = 1e-2,
                     dtype: torch.dtype = torch.float32, loss: LossFn | None = None,
                     vocab: int | None = None, seed: int = 0, optimizer: str = "adamw"
                     ) -> Comparison:
    """Train with the parameter server, then replay its logs in one process and compare
    every worker's losses and the final parameters (what verify dispatches to)."""
    return run_and_replay(model, mesh, plan, steps=steps, batch=batch, seq=seq, lr=lr,
                          dtype=dtype, loss=loss, vocab=vocab, seed=seed, optimizer=optimizer)[0]


def run_and_replay(model: Any, mesh: DeviceMesh, plan: ParallelPlan, *, steps: int = 5,
                   batch: int = 8, seq: int = 16, lr: float = 1e-2,
                   dtype: torch.dtype = torch.float32, loss: LossFn | None = None,
                   vocab: int | None = None, seed: int = 0, optimizer: str = "adamw"
                   ) -> tuple[Comparison, ParameterServerSync]:
    """``compare_replayed``, also returning the run's ParameterServerSync (its logs)."""
    from meshlab.models import ModelConfig, Transformer, global_batch, local_batch
    from meshlab.parallel.blocks import clean_name
    from meshlab.parallel.compose import build_optimizer, parallelize
    from meshlab.verify import comparison, training
    from meshlab.verify.training import one_process_optimizer, replica_rows

    if plan.mixed_precision:
        raise ValueError("mixed_precision=True with replica_sync='parameter_server': the "
                         "replay runs in the model's dtype; compare with mixed_precision=False")
    loss = loss or training.next_token_loss
    if isinstance(model, ModelConfig):
        cfg, seed = model, model.seed
        factory: Callable[[], nn.Module] = lambda: Transformer(cfg)  # noqa: E731
    else:
        factory = model

    def build() -> nn.Module:
        torch.manual_seed(seed)  # the replay starts from the parallel run's weights
        return factory().to(dtype)

    reference, servers = build(), build()  # a worker's weights, and the servers' whole
    shape = {"seq": seq, "vocab": vocab or comparison.vocab_size(reference), "seed": seed}
    parallel = parallelize(build(), mesh, replace(plan, seq_len=seq), seed=seed)
    opt = build_optimizer(parallel, mesh, plan, lr=lr, kind=optimizer)
    sync: ParameterServerSync = opt.replica_sync  # type: ignore[attr-defined]
    rank, ranks = comparison.data_rank(mesh)
    batches = [local_batch(step=s, batch=batch, rank=rank, ranks=ranks, **shape)
               for s in range(steps)]
    # each worker's losses stay local (averaged inside its replica): no sync across replicas
    losses = training.train(parallel, opt, batches, average_over=sync.within, loss=loss,
                          grad_accum=plan.grad_accum)
    sync.finish()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (sync.replica, losses, sync.used[:steps], sync.log))
    workers: dict[int, tuple[list[float], list[tuple[int, ...]]]] = {}
    notes = []
    for replica, worker_losses, used, _ in everyone:
        if workers.setdefault(replica, (worker_losses, used))[1] != used:
            notes.append(f"the ranks of replica {replica} computed on different versions")
    lags = sum((Counter(c - v for c, _, v in log) for *_, log in everyone), Counter())
    notes.append(f"replayed {sum(lags.values())} updates; staleness seen "
                 f"{dict(sorted(lags.items()))} (gradients by how many versions behind their "
                 f"clock; bound {plan.staleness})")
    names = [clean_name(n) for n, p in parallel.named_parameters() if p.requires_grad]
    pieces = dict(zip(names, sync.piece_map(), strict=True))
    history = [{n: p.detach().clone() for n, p in servers.named_parameters()}]
    server_opt = one_process_optimizer(servers, lr, optimizer, None)
    replayed: dict[int, list[float]] = {w: [] for w in workers}
    for c in range(steps):
        whole, grads = global_batch(step=c, batch=batch, **shape), []
        for w in range(sync.replicas):
            _load(reference, history, workers[w][1][c], pieces)
            reference.zero_grad(set_to_none=True)
            value = loss(reference, replica_rows(whole, w, sync.replicas))
            value.backward()
            if plan.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(reference.parameters(), plan.max_grad_norm)
            replayed[w].append(value.item())
            grads.append([p.grad if p.grad is not None else torch.zeros_like(p)
                          for p in reference.parameters()])
        for i, p in enumerate(servers.parameters()):
            p.grad = mean_in_order([g[i] for g in grads])
        server_opt.step()
        history.append({n: p.detach().clone() for n, p in servers.named_parameters()})
    loss_error = max(abs(a - b) / abs(b) for w in workers
                     for a, b in zip(workers[w][0], replayed[w], strict=True))
    worst, worst_error = "", 0.0
    for name, value in comparison.full_parameters(parallel).items():
        ref = history[steps][name]
        error = ((value - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        if error >= worst_error:
            worst, worst_error = name, error
    loss_rtol, param_rtol = comparison.TOLERANCES[dtype]
    result = comparison.Comparison(workers[sync.replica][0], replayed[sync.replica], loss_error,
                               worst_error, worst, loss_rtol, param_rtol, notes=notes)
    if len(notes) > 1:
        result.ok = False
    return result, sync


@torch.no_grad()
def _load(model: nn.Module, history: list[dict[str, torch.Tensor]], versions: tuple[int, ...],
          pieces: dict[str, torch.Tensor]) -> None:
    """A worker's parameters at a clock: each element at the version of its piece."""
    for name, p in model.named_parameters():
        value = history[versions[0]][name]
        for j, v in enumerate(versions):
            if v != versions[0]:
                value = torch.where(pieces[name] == j, history[v][name], value)
        p.copy_(value)


__all__ = ["compare_replayed", "run_and_replay"]
