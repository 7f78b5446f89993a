"""Does a parallel run train like one process? Losses and final parameters, compared.

Every rank also trains the reference: the same model (same seed) on the whole global batch,
alone. Both runs then differ only by the order of floating-point sums. Comparing one model
under many plans, ``with reusing_references():`` (meshlab.parallel.reused_references) trains
each distinct reference once.

Tolerances. Losses agree to ~1e-7 in fp32 (rtol 1e-5 below). Parameters after AdamW steps
do not: AdamW divides each element's step by that element's own gradient scale, so where a
summed gradient nearly cancels, a reordered sum changes the step a lot. Measured in ONE
process, training on the same 8 rows as one batch or as 4 accumulated chunks of 2 moves the
parameters of the default model by 9.0e-5 of their largest magnitude after 5 steps (fp32),
3e-13 in float64. So fp32 parameters are held to 2e-4 (twice that floor), and float64 runs,
where a real mistake cannot hide, to 1e-9 (losses) and 1e-8 (parameters: Mixtral's router
sums its gradient in float32 even in a float64 model, and TP reorders that sum: up to 6e-10
after 3 SGD steps).

A model can compute parts in a lower precision than it is given (Gemma's norms, in float32):
one process alone then moves further when only the order of its sums changes, and the
comparison measures that floor (the same batches in 2 accumulated halves) and holds both
runs to 10x it where it exceeds the dtype's tolerance, saying so in its notes. bf16
(mixed_precision) is held against fp32 to 5e-3 (losses) and 5e-2 (parameters), with SGD:
bf16 alone against fp32 in one process moves them by 1e-3 and 2e-4 (2e-2 on Gemma2), and
with AdamW by 0.45 of the parameters, where no check can hold.

fp16 (mixed_precision="fp16", dynamic loss scaling) is held against the same recipe in one
process (autocast fp16, GradScaler, same initial scale) to 1e-4 (losses) and 1e-3
(parameters), with SGD: measured 1e-5 and 6e-5 after 4 steps on DDP, ZeRO-1/2/3, TP and PP.
Near the scale's overflow limit the runs can skip different steps (a data-parallel rank's
local loss averages fewer rows, so its fp16 activation gradients are dp times larger; FSDP
computes every op in fp16 where autocast keeps norms in fp32): the comparison then fails and
its notes give both skip counts. QAT runs fake quantization in both runs (float32: torchao
takes no float64) and is held to the one-process floor, with SGD.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshlab.mesh import axis_size
from meshlab.models import ModelConfig, Transformer, global_batch, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import reused_references
from meshlab.parallel.accumulate import micro_batches
from meshlab.parallel.blocks import clean_name
from meshlab.parallel.compose import (
    OPTIMIZERS,
    ParallelPlan,
    apply_autocast,
    build_optimizer,
    parallelize,
)
from meshlab.parallel.materialize import materialize
from meshlab.parallel.precision import LossScaledOptimizer, apply_qat
from meshlab.parallel.ties import tied_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(slots=True)
class Comparison:
    """Losses and parameters of a parallel run beside the single-process reference."""

    losses: list[float]
    reference_losses: list[float]
    max_loss_error: float  # largest |loss - reference| / |reference|
    max_param_error: float  # largest |p - p_ref| of a parameter, relative to its max |p_ref|
    worst_param: str
    loss_rtol: float
    param_rtol: float
    notes: list[str] = field(default_factory=list)
    """What about the model bears on the comparison: tolerances it changed, and on a
    mismatch the causes meshlab can name."""
    skipped_steps: int | None = None
    """fp16: optimizer steps the parallel run skipped on overflow (None: no loss scaling)."""
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ok = (self.max_loss_error <= self.loss_rtol
                   and self.max_param_error <= self.param_rtol)

    def __str__(self) -> str:
        verdict = "matches one process" if self.ok else "DIFFERS from one process"
        lines = [f"{verdict}: losses within {self.max_loss_error:.1e} (tolerance "
                 f"{self.loss_rtol:.0e}), parameters within {self.max_param_error:.1e} "
                 f"(tolerance {self.param_rtol:.0e}; worst {self.worst_param})"]
        return "\n".join(lines + [f"  - {note}" for note in self.notes])


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index, number of ranks) among those that get different data rows."""
    for name in ("dp", "dp_shard", "dp_replicate"):
        if axis_size(mesh, name) > 1:
            return mesh[name].get_local_rank(), axis_size(mesh, name)
    return 0, 1


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered), under the plain model's names."""
    from torch.distributed.tensor import DTensor

    # FSDP over TP leaves a _StridedShard that torch gathers in two steps, warning each time
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return {clean_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for n, p in model.named_parameters()}
    finally:
        quiet.setLevel(level)


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


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any],
          average_over: Any | None = None,
          step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None, *,
          loss: LossFn = next_token_loss, grad_accum: int | list[int] = 1) -> list[float]:
    """Training steps; each returns its loss averaged over ``average_over`` (a process group).

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
        value = (step or forward_backward)(inputs, targets).detach().clone()
        optimizer.step()
        if average_over is not None:
            dist.all_reduce(value, group=average_over)
            value /= dist.get_world_size(average_over)
        losses.append(value.item())
    if hasattr(sync, "finish"):
        sync.finish()
    return losses


REPLAYED = ("a_edit", "parameter_server")
"""Asynchronous replica_sync modes: checked against a one-process replay of their log."""

TOLERANCES = {torch.bfloat16: (5e-3, 5e-2), torch.float16: (1e-4, 1e-3),
              torch.float32: (1e-5, 2e-4),
              torch.float64: (1e-9, 1e-8)}  # (loss, params)


def compare_with_single_process(model: ModelConfig | Callable[[], torch.nn.Module],
                                mesh: DeviceMesh, plan: ParallelPlan, *, steps: int = 5,
                                batch: int = 8, seq: int = 16, lr: float = 1e-2,
                                dtype: torch.dtype = torch.float32, loss: LossFn = next_token_loss,
                                vocab: int | None = None, seed: int = 0,
                                optimizer: str = "adamw",
                                batch_schedule: Callable[[int], int] | None = None,
                                on_meta: bool = False) -> Comparison:
    """Train ``steps`` AdamW steps both ways (on every rank) and compare.

    ``model`` is a meshlab ModelConfig or a factory of any model (a transformers model from
    its config, one written in a cell): it is called under the same seed for the reference
    and the parallel run, so both start from the same weights. ``loss(model, batch)`` gives
    a batch's loss (default: cross-entropy of the logits against the next tokens);
    ``vocab`` sizes the synthetic batches (default: the model's config); ``optimizer`` is
    adamw or sgd (with momentum). With local SGD or DiLoCo the reference is the same
    algorithm in one process: one model per replica, each on its replica's rows.
    ``batch_schedule(step)`` is the global batch at each step (a multiple of ``batch``, e.g.
    meshlab.parallel.accumulate.warmup): the parallel run takes more micro-steps of
    ``batch`` rows where it grows, the reference one step on the whole batch.
    ``on_meta``: both models are built on the meta device; the reference is materialized
    whole in one process, the parallel one sharded by parallelize, and their initial
    parameters must be equal exactly (a note says where not)."""
    if plan.replica_sync in REPLAYED:
        # which versions and how many local steps an asynchronous run took is known only
        # after it: its reference replays the run's own log, in one process
        from meshlab.parallel import edit_replay, parameter_server_replay

        module = (parameter_server_replay if plan.replica_sync == "parameter_server"
                  else edit_replay)
        return module.compare_replayed(model, mesh, plan, steps=steps, batch=batch, seq=seq,
                                       lr=lr, dtype=dtype, loss=loss, vocab=vocab, seed=seed,
                                       optimizer=optimizer)
    if isinstance(model, ModelConfig):
        cfg = model
        seed, vocab = cfg.seed, cfg.vocab_size

        def factory() -> torch.nn.Module:
            return Transformer(cfg)
    else:
        factory = model

    def build(whole: bool = True) -> torch.nn.Module:
        built = _build(whole)
        # the reference (and any one-process twin) fake-quantizes as parallelize does
        return apply_qat(built, plan.qat) if whole and plan.qat else built

    def _build(whole: bool) -> torch.nn.Module:
        torch.manual_seed(seed)  # the same weights for the reference and the parallel run
        if not on_meta:
            return factory().to(dtype)
        with torch.device("meta"):
            built = factory().to(dtype)
        return materialize(built, device="cpu", seed=seed) if whole else built

    reference = build()
    initial = {n: p.detach().clone()
               for n, p in reference.named_parameters(remove_duplicate=False)} if on_meta \
        else {}
    vocab = vocab or _vocab_size(reference)
    shape = {"seq": seq, "vocab": vocab, "seed": seed}
    precision, notes = dtype, []
    if plan.mixed_precision:
        if optimizer == "adamw":
            raise ValueError(f"mixed_precision={plan.mixed_precision!r} compared with "
                             "optimizer='adamw': AdamW "
                             "scales each element's step by its own gradient, so bf16's "
                             "rounding where a gradient nearly cancels moves parameters far "
                             "(in one process alone, bf16 against fp32 differs by 0.45 of the "
                             "parameters' size after 3 steps): pass optimizer='sgd', where "
                             "bf16 stays within 2e-4 (2e-2 on Gemma)")
        precision, notes = torch.bfloat16, [f"bf16 compute against one process in {dtype}: "
                                            "held to bf16's tolerances"]
        if plan.mixed_precision == "fp16":  # the reference: the same fp16 recipe, one process
            apply_autocast(reference, mesh.device_type, torch.float16)
            precision, notes = torch.float16, ["fp16 + dynamic loss scaling against the same "
                                               "recipe in one process (autocast fp16, "
                                               "GradScaler): held to fp16's tolerances"]
    if plan.qat is not None:
        if optimizer == "adamw":
            raise ValueError(f"qat={plan.qat!r} compared with optimizer='adamw': a reordered sum "
                             "that moves a value across a rounding boundary of the fake "
                             "quantization moves it a whole step, and AdamW's per-element steps "
                             "amplify that (in one process alone, 2 accumulated halves move the "
                             "parameters by 0.18 after 3 steps): pass optimizer='sgd' (1e-3)")
        notes.append(f"qat={plan.qat!r} in both runs: a reordered sum can cross a rounding "
                     "boundary of the fake quantization, so the tolerance is the floor below")
    sizes = [batch_schedule(s) if batch_schedule else batch for s in range(steps)]
    for s, size in enumerate(sizes):
        if size % batch:
            raise ValueError(f"batch_schedule gives {size} rows at step {s}: each step's batch "
                             f"must be a multiple of batch={batch}, the rows one micro-step "
                             "takes across the data ranks")
    replicas = [reference] if plan.replica_sync == "every_step" else (
        [reference] + [build() for _ in range(axis_size(mesh, "dp_replicate") - 1)])
    # the settings the one-process run depends on: a reuse (reused_references) keys on them
    settings = (model if isinstance(model, ModelConfig) else factory, dtype, optimizer, lr,
                tuple(sizes), batch, seq, vocab, seed, loss, on_meta,
                reused_references.reference_plan(plan))
    alone = reused_references.trained(settings, replicas, lambda: _train_reference(
        replicas, build, plan, shape, sizes, lr, optimizer, loss, precision, dtype, batch))
    ref_losses, loss_rtol, param_rtol = alone.losses, alone.loss_rtol, alone.param_rtol
    notes += alone.notes

    plan = replace(plan, seq_len=seq)
    rank, ranks = data_rank(mesh)
    batches = [local_batch(step=s, batch=size, rank=rank, ranks=ranks, **shape)
               for s, size in enumerate(sizes)]
    group = mesh["dp"].get_group() if ranks > 1 else None
    if axis_size(mesh, "cp") > 1:  # each cp rank trains on its slice of every sequence
        from meshlab.parallel.context import sequence_slice

        batches = [(sequence_slice(x, mesh), sequence_slice(y, mesh)) for x, y in batches]
        group = mesh["dp_cp"].get_group()
    # with a pp axis the model is this rank's stages and train() steps its pipeline
    parallel = parallelize(build(whole=False), mesh, plan, seed=seed)
    if initial:
        notes += _initial_differences(parallel, initial, mesh)
    opt = build_optimizer(parallel, mesh, plan, lr=lr, kind=optimizer)
    # a larger batch is more micro-steps of the same size, as a batch-size warm-up runs
    losses = train(parallel, opt, batches, average_over=group, loss=loss,
                   grad_accum=[plan.grad_accum * size // batch for size in sizes])

    replica = mesh["dp_replicate"].get_local_rank() if len(replicas) > 1 else 0
    # every name of a tied weight: the parallel model may hold it under either (a stage)
    expected = dict(replicas[replica].named_parameters(remove_duplicate=False))
    worst, worst_error = "", 0.0
    for name, value in full_parameters(parallel).items():
        ref = _mine(value, expected[name].detach(), mesh)
        error = ((value - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
        if error >= worst_error:
            worst, worst_error = name, error
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    if isinstance(opt, LossScaledOptimizer) and alone.scaler is not None:
        ref_skipped, ref_scale = alone.scaler
        notes.append(f"fp16 loss scaling: {opt.skipped_steps} of {steps} steps skipped on "
                     f"overflow (one process: {ref_skipped}), loss scale now "
                     f"{opt.loss_scale:g} (one process: {ref_scale:g})"
                     + ("; they skipped different steps: near the overflow limit a data rank's "
                        "fp16 gradients are dp times one process's (FSDP's fp16 also keeps no "
                        "op in fp32): start from a smaller loss_scale"
                        if opt.skipped_steps != ref_skipped else ""))
    result = Comparison(losses, ref_losses, loss_error, worst_error, worst, loss_rtol,
                        param_rtol, notes=notes,
                        skipped_steps=getattr(opt, "skipped_steps", None))
    if any(note.startswith(_UNEQUAL_START) for note in notes):
        result.ok = False
    if not result.ok:
        result.notes += _suspects(reference, worst)
    return result


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


def _train_reference(replicas: list[torch.nn.Module], build: Callable[[], torch.nn.Module],
                     plan: ParallelPlan, shape: dict[str, int], sizes: list[int], lr: float,
                     optimizer: str, loss: LossFn, precision: torch.dtype, dtype: torch.dtype,
                     batch: int) -> Reference:
    """Train the reference (``replicas[0]``; with local SGD or DiLoCo every replica) in this
    process, on the whole global batches, and measure the model's own floor."""
    reference = replicas[0]
    loss_rtol, param_rtol = TOLERANCES[precision]
    notes: list[str] = []
    if plan.replica_sync != "every_step":  # each replica trains alone on its rows
        return Reference(_train_replicas(replicas, plan, shape, sizes, lr, optimizer, loss),
                         loss_rtol, param_rtol, notes)
    whole = [global_batch(step=s, batch=size, **shape) for s, size in enumerate(sizes)]
    ref_opt = _optimizer(reference, lr, optimizer, plan.max_grad_norm)
    if plan.mixed_precision == "fp16":
        ref_opt = LossScaledOptimizer(ref_opt, reference, init_scale=plan.loss_scale,
                                      world=False)
    ref_losses = train(reference, ref_opt, whole, loss=loss)
    if not plan.mixed_precision and batch % 2 == 0:
        probe = (build, reference, ref_losses, whole, lr, optimizer, plan, loss)
        floor = _reordering_floor(*probe)
        above = floor[0] * FLOOR_MARGIN > loss_rtol or floor[1] * FLOOR_MARGIN > param_rtol
        random = _reordering_floor(*probe, halves=False) if above else (0.0, 0.0)
        if random[0] > loss_rtol or random[1] > param_rtol:  # no floor: chance
            notes.append(f"in one process alone, the same run with its random numbers "
                         f"drawn afresh moves the parameters by {random[1]:.1e}: the model "
                         "draws them in training (dropout?), so no comparison can hold")
        elif above:
            loss_rtol = max(loss_rtol, FLOOR_MARGIN * floor[0])
            param_rtol = max(param_rtol, FLOOR_MARGIN * floor[1])
            notes.append(f"in one process alone, the same batches in 2 accumulated halves "
                         f"move the losses by {floor[0]:.1e} and the parameters by "
                         f"{floor[1]:.1e}: {type(reference).__name__} computes parts in a "
                         f"lower precision than {dtype} (e.g. norms or a router's softmax "
                         f"in float32), so both runs can agree no closer: held to "
                         f"{FLOOR_MARGIN}x that")
    scaler = ((ref_opt.skipped_steps, ref_opt.loss_scale)
              if isinstance(ref_opt, LossScaledOptimizer) else None)
    return Reference(ref_losses, loss_rtol, param_rtol, notes, scaler)


def _mine(value: torch.Tensor, ref: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The part of a reference parameter this rank's parameter is: this rank's experts
    under expert parallelism, else all of it."""
    if value.shape != ref.shape and axis_size(mesh, "ep") > 1:
        n = value.shape[0]
        return ref[mesh["ep"].get_local_rank() * n:][:n]
    return ref


_UNEQUAL_START = "initialized unlike one process"


def _initial_differences(parallel: torch.nn.Module, initial: dict[str, torch.Tensor],
                         mesh: DeviceMesh) -> list[str]:
    """Where the sharded meta-device init differs from the whole model's in one process
    (it must not differ at all: both draw the same numbers)."""
    unequal = [name for name, value in full_parameters(parallel).items()
               if not torch.equal(value, _mine(value, initial[name], mesh))]
    if not unequal:
        return ["initialized on the meta device: every parameter equal to one process's "
                "materialize, exactly"]
    return [f"{_UNEQUAL_START}: {', '.join(unequal[:4])} (of {len(unequal)})"]


def _reordering_floor(build: Callable[[], torch.nn.Module], reference: torch.nn.Module,
                      ref_losses: list[float], batches: list[tuple[torch.Tensor, torch.Tensor]],
                      lr: float, optimizer: str, plan: ParallelPlan, loss: LossFn, *,
                      halves: bool = True) -> tuple[float, float]:
    """How far one process alone moves when only the order of its sums changes: the same
    batches in 2 accumulated halves. 1e-16 for a model that computes in its own dtype; a
    model computing parts in a lower one (Gemma's norms and Mixtral's router softmax in
    float32 inside a float64 model) shows that precision here, and no parallel run can
    agree more closely than this. ``halves=False``: the same run again, its random numbers
    drawn afresh, which moves only a model that draws them in training (dropout)."""
    twin = build()
    if not halves:
        torch.manual_seed(torch.initial_seed() + 1)
    losses = train(twin, _optimizer(twin, lr, optimizer, plan.max_grad_norm), batches,
                   loss=loss, grad_accum=2 if halves else 1)
    expected = dict(reference.named_parameters())
    params = max(((p.detach() - expected[n].detach()).abs().max()
                  / expected[n].detach().abs().max().clamp_min(1e-12)).item()
                 for n, p in twin.named_parameters())
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True)), params


FLOOR_MARGIN = 10
"""A parallel run reorders sums as much as 2 accumulated halves do, and AdamW amplifies such
differences unevenly: held to 10x the floor where the floor exceeds the dtype's tolerance."""


def _suspects(model: torch.nn.Module, worst: str) -> list[str]:
    """What in the model can make a parallel run differ from one process, named."""
    notes = []
    config = getattr(model, "config", None)
    # the rates a model's forward reads from its config (the rest are modules' own)
    rates = {f"config.{k}": v for k, v in vars(config).items()
             if k in ("attention_dropout", "hidden_dropout", "dropout")
             and isinstance(v, float) and v > 0} if config else {}
    rates |= {name: m.p for name, m in model.named_modules()
              if isinstance(m, torch.nn.Dropout) and m.p > 0}
    if rates:
        said = ", ".join(f"{k}={v}" for k, v in list(rates.items())[:4])
        notes.append(f"dropout is on ({said}): each run draws its own random masks, so they "
                     "cannot agree; set the rates to 0 for the comparison (e.g. "
                     "config.attention_dropout=0.0)")
    for group in tied_groups(model):
        if worst in group:
            notes.append(f"{worst} is tied to {', '.join(n for n in group if n != worst)}: "
                         "the parallel run must keep them one weight; a difference here says "
                         "it did not")
    return notes


def _optimizer(model: torch.nn.Module, lr: float, kind: str, max_grad_norm: float | None
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


def _train_replicas(models: list[torch.nn.Module], plan: ParallelPlan, shape: dict[str, int],
                    sizes: list[int], lr: float, kind: str, loss: LossFn) -> list[float]:
    """Local SGD, DiLoCo or EDiT in one process: replica r trains on the r-th block of rows
    of each global batch (the rows its data ranks get), and every ``plan.sync_every`` steps
    the replicas are averaged, or take DiLoCo's outer step (EDiT's: penalised, block by
    block, meshlab.parallel.edit_replay.simulate); returns the mean loss per step."""
    optimizers = [_optimizer(m, lr, kind, plan.max_grad_norm) for m in models]
    if plan.replica_sync == "edit":
        from meshlab.parallel.edit_replay import simulate

        def batch_of(r: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = global_batch(step=step, batch=sizes[step], **shape)
            rows = inputs.shape[0] // len(models)
            return inputs[r * rows:][:rows], targets[r * rows:][:rows]

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
        inputs, targets = global_batch(step=step, batch=size, **shape)
        rows = inputs.shape[0] // len(models)
        per_replica = [train(m, o, [(inputs[r * rows:][:rows], targets[r * rows:][:rows])],
                             loss=loss)[0]
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


def _vocab_size(model: torch.nn.Module) -> int:
    for config in (getattr(model, "cfg", None), getattr(model, "config", None)):
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int):
            return size
    raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__} (looked for "
                     "cfg.vocab_size and config.vocab_size): pass vocab=N")
