"""The one-process run a comparison is checked against: the same model trained alone on the
whole global batches (with local SGD, DiLoCo or EDiT every replica, in one process), and how
far the model moves when only the order of its sums changes: its own floor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from meshlab.models import global_batch
from meshlab.parallel.compose import ParallelPlan
from meshlab.parallel.precision import LossScaledOptimizer, precision_of
from meshlab.verify.comparison import largest_of, relative_error
from meshlab.verify.training import LossFn, one_process_optimizer, replica_rows, train


@dataclass(slots=True)
class Reference:
    """What the one-process run gives a comparison: its losses, the tolerances the model
    allows (raised to its own floor where it computes parts in a lower precision) and why."""

    losses: list[float]
    loss_rtol: float
    param_rtol: float
    notes: list[str]
    scaler: tuple[int, float] | None = None
    """fp16: (steps skipped on overflow, loss scale now)."""


def train_reference(replicas: list[torch.nn.Module], build: Callable[[], torch.nn.Module],
                    plan: ParallelPlan, shape: dict[str, int], sizes: list[int], lr: float,
                    optimizer: str, loss: LossFn, tolerances: tuple[float, float],
                    dtype: torch.dtype, batch: int,
                    recipe: Callable[[torch.nn.Module], object] | None = None,
                    parts: int = 2, measure_floor: bool = True) -> Reference:
    """Train the reference (``replicas[0]``; with local SGD or DiLoCo every replica) in this
    process, on the whole global batches, and measure the model's own floor: the dtype's
    ``tolerances`` (loss, params), raised to it where it is higher. ``recipe``: mixed
    precision's, put on the reference already and on the twin that measures the floor;
    ``parts``: the chunks the parallel run's data ranks split each batch into (the floor
    accumulates the same chunks, at least 2); ``measure_floor=False``: it computes in float64
    throughout (meshlab.verify.float64_variant), where the floor is float64's rounding, so
    it is not measured."""
    reference = replicas[0]
    loss_rtol, param_rtol = tolerances
    notes: list[str] = []
    if plan.replica_sync != "every_step":  # each replica trains alone on its rows
        losses = train_replicas(replicas, plan, shape, sizes, lr, optimizer, loss)
        if measure_floor and plan.replica_sync != "edit" and batch % (2 * len(replicas)) == 0:
            twins = [build() for _ in replicas]  # the same, each replica's rows in 2 halves
            for twin in twins:
                if recipe is not None:
                    recipe(twin)
            twin_losses = train_replicas(twins, plan, shape, sizes, lr, optimizer, loss,
                                         grad_accum=2)
            floor = (_largest_change(twin_losses, losses), _moved(twins[0], reference))
            loss_rtol, param_rtol = _held_to(floor, (loss_rtol, param_rtol), notes,
                                             f"{type(reference).__name__} computes parts in "
                                             f"a lower precision than {dtype}", 2)
        return Reference(losses, loss_rtol, param_rtol, notes)
    whole = [global_batch(step=s, batch=size, **shape) for s, size in enumerate(sizes)]
    ref_opt = one_process_optimizer(reference, lr, optimizer, plan.max_grad_norm)
    if plan.mixed_precision == "fp16":
        ref_opt = LossScaledOptimizer(ref_opt, reference, init_scale=plan.loss_scale,
                                      world=False)
    ref_losses = train(reference, ref_opt, whole, loss=loss)
    # mixed precision is held against the same recipe, whose own rounding the floor
    # measures as it measures float32 parts in a float64 model
    parts = parts if batch % parts == 0 else 2
    if measure_floor and batch % parts == 0:
        probe = (build, reference, ref_losses, whole, lr, optimizer, plan, loss, recipe)
        floor = _reordering_floor(*probe, parts=parts)
        above = floor[0] * FLOOR_MARGIN > loss_rtol or floor[1] * FLOOR_MARGIN > param_rtol
        random = _reordering_floor(*probe, parts=1, redraw=True) if above else (0.0, 0.0)
        if random[0] > loss_rtol or random[1] > param_rtol:  # no floor: chance
            notes.append(f"in one process alone, the same run with its random numbers "
                         f"drawn afresh moves the parameters by {random[1]:.1e}: the model "
                         "draws them in training (dropout?), so no comparison can hold")
        else:
            why = (f"{precision_of(plan.mixed_precision)}'s own rounding"
                   if plan.mixed_precision else
                   f"{type(reference).__name__} computes parts in a lower precision than "
                   f"{dtype}")
            loss_rtol, param_rtol = _held_to(floor, (loss_rtol, param_rtol), notes, why, parts)
    scaler = ((ref_opt.skipped_steps, ref_opt.loss_scale)
              if isinstance(ref_opt, LossScaledOptimizer) else None)
    return Reference(ref_losses, loss_rtol, param_rtol, notes, scaler)


def _held_to(floor: tuple[float, float], tolerances: tuple[float, float], notes: list[str],
             why: str, parts: int) -> tuple[float, float]:
    """The tolerances, raised to FLOOR_MARGIN x the floor where that is higher (and a note)."""
    if floor[0] * FLOOR_MARGIN <= tolerances[0] and floor[1] * FLOOR_MARGIN <= tolerances[1]:
        return tolerances
    notes.append(f"in one process alone, the same batches in {parts} accumulated parts move the "
                 f"losses by {floor[0]:.1e} and the parameters by {floor[1]:.1e}: {why}, so "
                 f"both runs can agree no closer: held to {FLOOR_MARGIN}x that")
    return (max(tolerances[0], FLOOR_MARGIN * floor[0]),
            max(tolerances[1], FLOOR_MARGIN * floor[1]))


def _largest_change(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def _moved(model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """How far ``model``'s parameters are from ``reference``'s, each relative to its size
    (to the largest parameter's where it is zero up to roundoff: comparison.ZERO)."""
    expected = {n: p.detach() for n, p in reference.named_parameters()}
    largest = largest_of(list(expected.values()))
    return max(relative_error(p.detach(), expected[n], largest)
               for n, p in model.named_parameters())


def _reordering_floor(build: Callable[[], torch.nn.Module], reference: torch.nn.Module,
                      ref_losses: list[float], batches: list[tuple[torch.Tensor, torch.Tensor]],
                      lr: float, optimizer: str, plan: ParallelPlan, loss: LossFn,
                      recipe: Callable[[torch.nn.Module], object] | None = None, *,
                      parts: int = 2, redraw: bool = False) -> tuple[float, float]:
    """How far one process alone moves when only the order of its sums changes: the same
    batches in ``parts`` accumulated chunks. 1e-16 for a model that computes in its own dtype; a
    model computing parts in a lower one (Gemma's norms and Mixtral's router softmax in
    float32 inside a float64 model) shows that precision here, and no parallel run can
    agree more closely than this. ``redraw``: the same run again, its random numbers
    drawn afresh, which moves only a model that draws them in training (dropout)."""
    twin = build()
    if redraw:
        torch.manual_seed(torch.initial_seed() + 1)
    opt = one_process_optimizer(twin, lr, optimizer, plan.max_grad_norm)
    if recipe is not None:  # the reference's mixed precision
        recipe(twin)
    if plan.mixed_precision == "fp16":
        opt = LossScaledOptimizer(opt, twin, init_scale=plan.loss_scale, world=False)
    losses = train(twin, opt, batches, loss=loss, grad_accum=parts)
    return _largest_change(losses, ref_losses), _moved(twin, reference)


FLOOR_MARGIN = 10
"""A parallel run reorders sums as much as accumulating its data ranks' chunks does, and AdamW
amplifies such differences unevenly: held to 10x the floor where the floor exceeds the dtype's
tolerance."""


def train_replicas(models: list[torch.nn.Module], plan: ParallelPlan, shape: dict[str, int],
                   sizes: list[int], lr: float, kind: str, loss: LossFn,
                   grad_accum: int = 1) -> list[float]:
    """Local SGD, DiLoCo or EDiT in one process: replica r trains on the r-th block of rows
    of each global batch (the rows its data ranks get), and every ``plan.sync_every`` steps
    the replicas are averaged, or take DiLoCo's outer step (EDiT's: penalised, block by
    block, meshlab.replicas.edit_replay.simulate); returns the mean loss per step."""
    optimizers = [one_process_optimizer(m, lr, kind, plan.max_grad_norm) for m in models]
    if plan.replica_sync == "edit":
        from meshlab.replicas.edit_replay import simulate

        def batch_of(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            return replica_rows(global_batch(step=step, batch=sizes[step], **shape), r,
                                len(models))

        every, steps = plan.sync_every, len(sizes)
        rounds = [[every] * len(models)] * (steps // every) + (
            [[steps % every] * len(models)] if steps % every else [])
        by_replica = simulate(models, optimizers, batch_of, rounds, plan, loss=loss,
                              sync_last=steps % every == 0)
        return [sum(ls) / len(ls) for ls in zip(*by_replica, strict=True)]
    params = [list(m.parameters()) for m in models]
    backup = [p.detach().clone() for p in params[0]]
    outer = torch.optim.SGD(backup, lr=plan.outer_lr, momentum=plan.outer_momentum,
                            nesterov=plan.outer_momentum > 0)
    losses = []
    for step, size in enumerate(sizes):
        whole = global_batch(step=step, batch=size, **shape)
        per_replica = [train(m, o, [replica_rows(whole, r, len(models))], loss=loss,
                             grad_accum=grad_accum)[0]
                       for r, (m, o) in enumerate(zip(models, optimizers, strict=True))]
        losses.append(sum(per_replica) / len(per_replica))
        if (step + 1) % plan.sync_every:
            continue
        with torch.no_grad():
            for i, saved in enumerate(backup):
                mean = torch.stack([ps[i] for ps in params]).mean(dim=0)
                if plan.replica_sync == "diloco":
                    saved.grad = saved - mean  # the pseudo-gradient, averaged
                else:
                    saved.copy_(mean)
            if plan.replica_sync == "diloco":
                outer.step()
            for ps in params:
                for p, saved in zip(ps, backup, strict=True):
                    p.copy_(saved)
    return losses
