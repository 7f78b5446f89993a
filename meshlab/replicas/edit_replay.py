"""The one-process reference of EDiT and A-EDiT (meshlab.replicas.edit): ``simulate`` runs
the replicas and their penalised outer step in one process (what verify compares EDiT with),
and ``compare_replayed`` replays an A-EDiT run's logged step counts; float64, to 1e-9."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from meshlab.replicas.edit import (
    Batch,
    EDiTSync,
    SyncRecord,
    outer_sgd,
    squared_norm,
    train_rounds,
    units_of,
    weigh,
)
from meshlab.replicas.edit_penalty import Penalty, Running, clip_coefficient

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshlab.models import ModelConfig
    from meshlab.parallel.compose import ParallelPlan
    from meshlab.verify.comparison import Comparison
    from meshlab.verify.training import LossFn


def simulate(models: list[nn.Module], optimizers: list[torch.optim.Optimizer],
             batch_of: Callable[[int, int], Batch], rounds: Sequence[Sequence[int]],
             plan: ParallelPlan, *, penalty: Penalty | None = None, loss: LossFn | None = None,
             sync_last: bool = True,
             before_step: Callable[[int, int, torch.optim.Optimizer], None] | None = None
             ) -> list[list[float]]:
    """EDiT in one process, the reference: in round k replica r takes ``rounds[k][r]`` local
    steps on ``batch_of(r, local_step)`` (``before_step(r, local_step, optimizer)`` first,
    if given), then the replicas take the penalised outer step, block by block (not after
    the last round unless ``sync_last``). Returns each replica's losses."""
    from meshlab.verify.training import next_token_loss, train

    units = [[ps for _, _, ps in units_of(m, plan.blocks)] for m in models]
    backups = [[p.detach().clone() for p in ps] for ps in units[0]]
    outers = [outer_sgd(b, plan) for b in backups]
    running = [[Running() for _ in models] for _ in backups]
    penalty = (penalty or Penalty()) if plan.pseudo_grad_penalty else None
    losses: list[list[float]] = [[] for _ in models]
    for k, counts in enumerate(rounds):
        for r, (model, optimizer) in enumerate(zip(models, optimizers, strict=True)):
            for _ in range(counts[r]):
                step = len(losses[r])
                if before_step is not None:
                    before_step(r, step, optimizer)
                losses[r] += train(model, optimizer, [batch_of(r, step)],
                                   loss=loss or next_token_loss)
        if k < len(rounds) - 1 or sync_last:
            with torch.no_grad():
                for u, backup in enumerate(backups):
                    _penalised_step(backup, [ps[u] for ps in units], outers[u], running[u],
                                    penalty)
    return losses


def _penalised_step(backup: list[torch.Tensor], replicas: list[list[nn.Parameter]],
                    outer: torch.optim.Optimizer, running: list[Running],
                    penalty: Penalty | None) -> None:
    """One block's sync in one process: what EDiTSync computes across the ranks."""
    deltas = [[b - p for b, p in zip(backup, ps, strict=True)] for ps in replicas]
    average: list[torch.Tensor] | None
    if penalty is None:
        average = [torch.stack(ds).mean(dim=0) for ds in zip(*deltas, strict=True)]
    else:
        weights = weigh([float(squared_norm(ds).sqrt()) for ds in deltas], running, penalty)
        average = None
        if any(weights):  # summed in replica order, as the all-reduce sums
            average = [sum((d * w if w else torch.zeros_like(d)
                            for d, w in zip(ds, weights, strict=True)),
                           start=torch.zeros_like(ds[0])) for ds in zip(*deltas, strict=True)]
            coefficient = clip_coefficient(float(squared_norm(average).sqrt()), penalty)
            if coefficient < 1:
                average = [a * coefficient for a in average]
    if average is not None:
        for b, a in zip(backup, average, strict=True):
            b.grad = a
        outer.step()
        for b in backup:
            b.grad = None
    for ps in replicas:
        for p, b in zip(ps, backup, strict=True):
            p.copy_(b)


def compare_replayed(model: ModelConfig | Callable[[], nn.Module], mesh: DeviceMesh,
                     plan: ParallelPlan, *, steps: int = 5, batch: int = 8, seq: int = 16,
                     lr: float = 1e-2, dtype: torch.dtype = torch.float32,
                     loss: LossFn | None = None, vocab: int | None = None, seed: int = 0,
                     optimizer: str = "adamw", history: list[SyncRecord] | None = None
                     ) -> Comparison:
    """A-EDiT for ``steps`` rounds on every rank, then its log replayed in one process: each
    replica takes the local steps it took in each round, on its own stream of batches, then
    the penalised outer step; losses and parameters compared (verify's tolerances).
    ``history``: a list the run's SyncRecords are appended to (steps per round)."""
    from meshlab.mesh import axis_size
    from meshlab.models import ModelConfig, Transformer, global_batch, local_batch
    from meshlab.parallel.compose import build_optimizer, parallelize
    from meshlab.verify import comparison
    from meshlab.verify.training import one_process_optimizer, replica_rows

    for axis in ("cp", "pp", "ep"):
        if axis_size(mesh, axis) > 1:
            raise ValueError(f"replica_sync={plan.replica_sync!r} is replayed on meshes of "
                             f"dp_replicate, dp_shard and tp only, not {axis}="
                             f"{axis_size(mesh, axis)}: build the mesh without {axis}")
    cfg = model if isinstance(model, ModelConfig) else None
    factory = (lambda: Transformer(cfg)) if cfg is not None else model
    seed, vocab = (cfg.seed, cfg.vocab_size) if cfg is not None else (seed, vocab)

    def build() -> nn.Module:
        torch.manual_seed(seed)  # the same weights in the run and in every replayed replica
        return factory().to(dtype)  # type: ignore[operator]

    replicas = [build() for _ in range(axis_size(mesh, "dp_replicate"))]
    shape = {"seq": seq, "vocab": vocab or comparison.vocab_size(replicas[0]), "seed": seed}
    rank, ranks = comparison.data_rank(mesh)
    parallel = parallelize(build(), mesh, replace(plan, seq_len=seq), seed=seed)
    opt = build_optimizer(parallel, mesh, plan, lr=lr, kind=optimizer)
    losses = torch.tensor(train_rounds(
        parallel, opt, lambda s: local_batch(step=s, batch=batch, rank=rank, ranks=ranks,
                                             **shape), steps, loss=loss), dtype=torch.float64)
    if axis_size(mesh, "dp_shard") > 1:  # the replica's loss: the mean over its data ranks
        dist.all_reduce(losses, group=mesh["dp_shard"].get_group())
        losses /= axis_size(mesh, "dp_shard")
    sync: EDiTSync = opt.replica_sync  # type: ignore[attr-defined]
    history = history if history is not None else []
    history += sync.history
    def batch_of(r: int, step: int) -> Batch:
        return replica_rows(global_batch(step=step, batch=batch, **shape), r, len(replicas))

    optimizers = [one_process_optimizer(m, lr, optimizer, plan.max_grad_norm) for m in replicas]
    replayed = simulate(replicas, optimizers, batch_of, [s.steps for s in sync.history], plan,
                        penalty=sync.penalty, loss=loss)
    mine = sync.replica
    expected = dict(replicas[mine].named_parameters(remove_duplicate=False))
    errors = {name: ((value - expected[name]).abs().max()
                     / expected[name].abs().max().clamp_min(1e-12)).item()
              for name, value in comparison.full_parameters(parallel).items()}
    worst = max(errors, key=lambda n: errors[n])
    reference = replayed[mine]
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses.tolist(), reference,
                                                         strict=True))
    counts = "; ".join(f"replica {r}: {[s.steps[r] for s in sync.history]}"
                       for r in range(len(replicas)))
    return comparison.Comparison(losses.tolist(), reference, loss_error, errors[worst], worst,
                             *comparison.TOLERANCES[dtype],
                             notes=[f"replayed {len(sync.history)} rounds; local steps per "
                                    f"round, {counts}"])
