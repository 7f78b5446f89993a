"""Does a parallel run train like one process? Losses and final parameters, compared.

Every rank also trains the reference (meshlab.verify.reference_run): the same model (same
seed) on the whole global batch, alone. Both runs then differ only by the order of
floating-point sums. Comparing one model
under many plans, ``with reusing_references():`` (meshlab.verify.reused_references) trains
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
comparison measures that floor (the same batches accumulated in the chunks the data ranks
split them into, at least 2) and holds both runs to 10x it where it exceeds the dtype's
tolerance, saying so in its notes.

Mixed precision is held against the same recipe in one process (FSDP2's parameter cast under
ZeRO-2/3, autocast elsewhere; fp16 adds dynamic loss scaling from the same initial scale),
with SGD: fp16 to 1e-4 (losses) and 1e-3 (parameters), measured 1e-5 and 6e-5 after 4 steps
on DDP, ZeRO-1/2/3, TP and PP; bf16, whose unit roundoff (2^-8) is 8x fp16's (2^-11), to 8x
that. Where the recipe's own rounding moves one process further (the floor above, measured
under the recipe) that raises them. With AdamW, bf16 alone moves the parameters by 0.45 of
their size from float32, where no check can hold: AdamW is refused. Near fp16's overflow
limit the runs can skip different steps (a data-parallel rank's local loss averages fewer
rows, so its fp16 activation gradients are dp times larger): the comparison then fails and
its notes give both skip counts. QAT runs fake quantization in both runs (float32: torchao
takes no float64) and is held to the one-process floor, with SGD.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from meshlab.mesh import axis_size
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import combinations
from meshlab.parallel.compose import (
    ParallelPlan,
    apply_autocast,
    build_optimizer,
    data_parallel_ranks,
    parallelize,
)
from meshlab.parallel.materialize import materialize
from meshlab.parallel.precision import (
    DTYPES,
    LossScaledOptimizer,
    apply_qat,
    cast_params_in_forward,
    precision_of,
)
from meshlab.parallel.ties import tied_groups
from meshlab.verify import reused_references
from meshlab.verify.comparison import (
    TOLERANCES,
    Comparison,
    data_rank,
    full_parameters,
    largest_of,
    relative_error,
    vocab_size,
)
from meshlab.verify.float64_variant import float64_throughout
from meshlab.verify.reference_run import train_reference
from meshlab.verify.training import LossFn, next_token_loss, train

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


REPLAYED = ("a_edit", "parameter_server")
"""Asynchronous replica_sync modes: checked against a one-process replay of their log."""

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
    parameters must be equal exactly (a note says where not).

    A float64 comparison runs the float64 variant of the model in both runs (every float32
    it asks for is float64: meshlab.verify.float64_variant), so parts it computes in
    float32 (norms, routers) leave no noise for an error to hide in."""
    check_comparable(plan, optimizer)
    combinations.check(plan, partial(axis_size, mesh))  # before the one-process run trains
    # activation checkpointing (and chunked CP's per-chunk checkpoint) recompute in backward,
    # outside any mode the forward saw: such runs keep the model's float32 parts, held to the
    # floor they measure instead
    recomputes = plan.activation_checkpoint != "none" or plan.context_parallel == "chunked"
    widen = dtype == torch.float64 and not recomputes
    with float64_throughout(widen) as widening:
        result = _compare(model, mesh, plan, steps=steps, batch=batch, seq=seq, lr=lr,
                          dtype=dtype, loss=loss, vocab=vocab, seed=seed, optimizer=optimizer,
                          batch_schedule=batch_schedule, on_meta=on_meta, widen=widen)
    if widening is not None and widening.widened:
        result.notes.insert(0, "the model computes parts in float32 even in float64 (norms, "
                               "a router's softmax, rotary angles): both runs computed them "
                               "in float64 (meshlab.verify.float64_variant)")
    return result


def _compare(model: ModelConfig | Callable[[], torch.nn.Module], mesh: DeviceMesh,
             plan: ParallelPlan, *, steps: int, batch: int, seq: int, lr: float,
             dtype: torch.dtype, loss: LossFn, vocab: int | None, seed: int, optimizer: str,
             batch_schedule: Callable[[int], int] | None, on_meta: bool, widen: bool
             ) -> Comparison:
    if plan.replica_sync in REPLAYED:
        # which versions and how many local steps an asynchronous run took is known only
        # after it: its reference replays the run's own log, in one process
        from meshlab.replicas import edit_replay, parameter_server_replay

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
    vocab = vocab or vocab_size(reference)
    shape = {"seq": seq, "vocab": vocab, "seed": seed}
    precision, notes = dtype, []
    recipe: Callable[[torch.nn.Module], object] | None = None  # on every one-process run
    recipe_key: tuple[str, bool] | None = None  # which recipe: reuse keys on it
    if plan.mixed_precision:  # the reference: the same recipe, in one process
        kind = precision_of(plan.mixed_precision) or "bf16"
        precision = DTYPES[kind]
        # FSDP2 casts the parameters (the norms run in the low precision too); elsewhere autocast
        fsdp = plan.data_parallel in ("zero2", "zero3") and data_parallel_ranks(mesh, plan) > 1
        recipe = (partial(cast_params_in_forward, dtype=precision) if fsdp else
                  partial(apply_autocast, device_type=mesh.device_type, dtype=precision))
        recipe(reference)
        recipe_key = (kind, fsdp)
        how = (f"parameters cast to {kind} as FSDP2 casts them" if fsdp else f"autocast {kind}")
        scaled = (" + dynamic loss scaling", ", GradScaler") if kind == "fp16" else ("", "")
        notes = [f"{kind}{scaled[0]} against the same recipe in one process ({how}"
                 f"{scaled[1]}): held to {kind}'s tolerances"]
    if plan.qat is not None:
        notes.append(f"qat={plan.qat!r} in both runs: a reordered sum can cross a rounding "
                     "boundary of the fake quantization, so the tolerance is the floor below")
    sizes = [batch_schedule(s) if batch_schedule else batch for s in range(steps)]
    for s, size in enumerate(sizes):
        if size % batch:
            raise ValueError(f"batch_schedule gives {size} rows at step {s}: each step's batch "
                             f"must be a multiple of batch={batch}, the rows one micro-step "
                             "takes across the data ranks")
    replicas = [reference] + [build() for _ in range(axis_size(mesh, "dp_replicate") - 1)
                              if plan.replica_sync != "every_step"]
    for copy in replicas[1:]:
        if recipe is not None:
            recipe(copy)
    # the floor accumulates the chunks the data ranks split each batch into
    parts = max(2, data_rank(mesh)[1])
    # the settings the one-process run depends on: a reuse (reused_references) keys on them
    settings = (model if isinstance(model, ModelConfig) else factory, dtype, optimizer, lr,
                tuple(sizes), batch, seq, vocab, seed, loss, on_meta, widen, parts, recipe_key,
                reused_references.reference_plan(plan))
    alone = reused_references.trained(settings, replicas, lambda: train_reference(
        replicas, build, plan, shape, sizes, lr, optimizer, loss, TOLERANCES[precision], dtype,
        batch, recipe, parts, measure_floor=not widen or plan.qat is not None))
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
    largest = largest_of(list(expected.values()))  # a parameter zero up to roundoff: to this
    for name, value in full_parameters(parallel).items():
        ref = _mine(value, expected[name].detach(), mesh)
        error = relative_error(value, ref, largest)
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


def check_comparable(plan: ParallelPlan, optimizer: str) -> None:
    """Refuse a comparison no tolerance can hold, naming the pair and the fix."""
    if plan.mixed_precision and optimizer == "adamw":
        raise ValueError(f"mixed_precision={plan.mixed_precision!r} compared with "
                         "optimizer='adamw': AdamW "
                         "scales each element's step by its own gradient, so bf16's "
                         "rounding where a gradient nearly cancels moves parameters far "
                         "(in one process alone, bf16 against fp32 differs by 0.45 of the "
                         "parameters' size after 3 steps): pass optimizer='sgd', where "
                         "bf16 stays within 2e-4 (2e-2 on Gemma)")
    if plan.qat is not None and optimizer == "adamw":
        raise ValueError(f"qat={plan.qat!r} compared with optimizer='adamw': a reordered sum "
                         "that moves a value across a rounding boundary of the fake "
                         "quantization moves it a whole step, and AdamW's per-element steps "
                         "amplify that (in one process alone, 2 accumulated halves move the "
                         "parameters by 0.18 after 3 steps): pass optimizer='sgd' (1e-3)")


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
