"""The training loop every check in meshlab shares: a loss, the steps, and the optimizer one
process steps with. The parallel run, the one-process reference and the replays of
asynchronous runs all train through ``train``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshlab.models.llama import loss_fn
from meshlab.parallel.accumulate import micro_batches
from meshlab.parallel.optimizers import OPTIMIZERS
from meshlab.verify.anomaly import RerunOnAnomaly, random_state

if TYPE_CHECKING:
    from meshlab.verify.loss_curves import LossLog

LossFn = Callable[[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


def next_token_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
                    ) -> torch.Tensor:
    """The default loss: cross-entropy of the model's logits against the batch's targets. A
    model may return the logits, an output holding them (transformers' ``.logits``), or a
    tuple that starts with them."""
    inputs, targets = batch
    return loss_fn(logits_of(model(inputs)), targets)


def logits_of(out: Any) -> torch.Tensor:
    """The logits in what a model returned: themselves, transformers' ``.logits``, or the
    first of a tuple (nanoGPT returns (logits, loss))."""
    if isinstance(out, tuple | list):
        out = out[0]
    return getattr(out, "logits", out)


def replica_rows(batch: tuple[torch.Tensor, torch.Tensor], replica: int, replicas: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``replica``'s block of rows of a global batch: the rows its data ranks get
    when ``replicas`` replicas share it (local SGD, DiLoCo, EDiT)."""
    inputs, targets = batch
    rows = inputs.shape[0] // replicas
    return inputs[replica * rows:][:rows], targets[replica * rows:][:rows]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any],
          average_over: Any | None = None,
          step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, *,
          loss: LossFn = next_token_loss, grad_accum: int | list[int] = 1,
          log: LossLog | None = None, on_anomaly: RerunOnAnomaly | None = None
          ) -> list[float]:
    """Training steps; each returns its loss averaged over ``average_over`` (a process group),
    and records it in ``log`` (meshlab.verify.loss_curves: ``meshlab compare-losses``). With
    ``on_anomaly``, a non-finite or jumping loss re-runs its step before the optimizer steps
    (meshlab.verify.anomaly).

    ``step(inputs, targets)`` runs forward and backward and returns the loss; by default
    through the model's pipeline (a model ``parallelize`` split over a pp axis), or
    ``loss(model, (inputs, targets))`` then backward, in ``grad_accum`` micro-steps (one
    count, or one per step).
    """
    pipeline = getattr(model, "pipeline", None)
    # fp16: backward on the scaled loss (a pipeline scales its own, LossScaledOptimizer)
    scale: Callable[[torch.Tensor], torch.Tensor] = getattr(optimizer, "scale", lambda x: x)
    counts = grad_accum if isinstance(grad_accum, list) else [grad_accum] * len(batches)
    losses: list[float] = []

    def forward_backward(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if pipeline is not None:  # every pp rank gets the step's mean loss
            return torch.tensor(pipeline.step(inputs, targets), dtype=torch.float64,
                                device=inputs.device)
        k = counts[len(losses)]
        # on the batch's device: NCCL reduces only GPU tensors, and a GPU loss adds to no CPU one
        total = torch.zeros((), dtype=torch.float64, device=inputs.device)
        for micro_inputs, micro_targets in micro_batches(model, (inputs, targets), k):
            value = loss(model, (micro_inputs, micro_targets)) / k  # the batch's mean
            scale(value).backward()
            total += value.detach().double()
        return total

    # a replica_sync may refuse a fixed-length loop (A-EDiT) and hold a sync to apply at the end
    sync: Any = getattr(optimizer, "replica_sync", None)
    if hasattr(sync, "check_fixed_steps"):
        sync.check_fixed_steps(len(batches))
    for inputs, targets in batches:
        optimizer.zero_grad()
        rng = random_state() if on_anomaly is not None else ()
        value = (step or forward_backward)(inputs, targets).detach().clone()
        if on_anomaly is not None:
            value = on_anomaly.check(
                len(losses), model, value, rng,
                lambda: (step or forward_backward)(inputs, targets),  # noqa: B023 (called now)
                optimizer.zero_grad)
        optimizer.step()
        if average_over is not None:
            dist.all_reduce(value, group=average_over)
            value /= dist.get_world_size(average_over)
        losses.append(value.item())
        if log is not None:
            log.record(len(losses) - 1, losses[-1])
    if hasattr(sync, "finish"):
        sync.finish()
    return losses


def one_process_optimizer(model: torch.nn.Module, lr: float, kind: str, max_grad_norm: float | None
               ) -> torch.optim.Optimizer:
    """What build_optimizer makes, for one process, clipping with torch's own clip."""
    cls, extra = OPTIMIZERS[kind]
    optimizer = cls(model.parameters(), lr=lr, weight_decay=0.1, **extra)
    if max_grad_norm is not None:
        limit = max_grad_norm

        def clip(*_: Any) -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), limit)

        optimizer.register_step_pre_hook(clip)
    return optimizer
