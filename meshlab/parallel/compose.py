"""One entry point that applies the strategies in the order production trainers do.

Pipeline stages are split first (meshlab.parallel.pipeline.apply_pp), then on each stage:
tensor parallel, activation checkpointing, and data parallel (DDP, ZeRO-1, or FSDP2 for
ZeRO-2/3 and HSDP) last, as torchtitan does.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from meshlab.mesh import axis_size
from meshlab.parallel import combinations, fused_proof, precision, tp_inputs
from meshlab.parallel.activation_checkpoint import apply_ac
from meshlab.parallel.clip import clip_grad_norm_
from meshlab.parallel.ddp import apply_ddp
from meshlab.parallel.fsdp import apply_fsdp
from meshlab.parallel.materialize import Origins, materialize, on_meta, record
from meshlab.parallel.offload import apply_activation_offload
from meshlab.parallel.optimizers import OPTIMIZERS, check_sharding
from meshlab.parallel.parallel_plan import ParallelPlan
from meshlab.parallel.pipeline import apply_pp
from meshlab.parallel.replica_modes import PARAMETER_SERVER, SYNCS, TINY_PROOF, load
from meshlab.parallel.tensor import apply_tp, model_plan, unmatched
from meshlab.parallel.zero import apply_zero1

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def parallelize(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan, *, seed: int = 0,
                init: Callable[[nn.Module], None] | None = None,
                check: str | Callable[[Any], nn.Module] | None = None) -> nn.Module:
    """Split pipeline stages (with a pp axis: then ``model.pipeline.step(x, y)`` trains),
    then on each stage expert, context and tensor parallel, activation checkpointing and
    data parallel, in that order.

    A model built on the meta device is sharded first, then each rank allocates only its
    shards and fills them as ``materialize`` fills the whole model in one process: the
    model's own init (or ``init(module)``), seeded by ``seed`` and each module's name
    (meshlab.parallel.materialize).

    ``check="tiny"`` first trains the plan for two steps on a tiny copy of the model (the
    same class, shrunk) beside one process and raises, naming what differs, before the real
    model is touched; a hand-written model passes ``check=factory`` instead, a function of a
    meshlab.verify.tiny.TinySize (``model.tiny_proof`` keeps the comparison)."""
    combinations.check(plan, partial(axis_size, mesh))
    proof = None
    if check is not None:
        if check != "tiny" and not callable(check):
            raise ValueError(f"check={check!r}: expected 'tiny' (a tiny copy from the "
                             "model's config) or a factory of a TinySize, or None")
        factory = None if check == "tiny" else cast(Any, check)
        proof = load(TINY_PROOF)(model, mesh, plan, factory=factory)
    _check_model_supports(model, mesh, plan)
    axes = {a: axis_size(mesh, a) for a in ("tp", "cp", "ep")}
    precision.check_qat(plan, axes, model)
    precision.check_fp16_model(plan, model)
    if plan.qat is not None:  # before the strategies: they shard the fake-quantized Linears
        model = precision.apply_qat(model, plan.qat)
    if axes["tp"] > 1 and (tp_plan := _tp_plan(model, plan)) is not None:
        # fused projections' modules probed whole, before a pipeline splits the model
        fused_proof.capture(model, tp_plan, user=plan.tp_plan is not None,
                            vouched=proof is not None)
    origins = record(model, init) if on_meta(model) else None
    stage = partial(_parallelize_stage, mesh=mesh, plan=plan, origins=origins, seed=seed)
    if axis_size(mesh, "pp") > 1:
        model = apply_pp(model, mesh, schedule=plan.schedule(axis_size(mesh, "pp")),
                         split_points=plan.split_points, blocks=plan.blocks,
                         parallelize_stage=stage,
                         reduce_every_microbatch=plan.reduce_every_microbatch)
        # what no stage holds: the model's own tensors (meshlab's RoPE table)
        model = model if origins is None else materialize(model, origins, seed=seed)
    else:
        model = stage(model)
        if axes["tp"] > 1:  # a pipeline's stages get their inputs from each other
            tp_inputs.watch(model, mesh["tp"])
    if proof is not None:
        object.__setattr__(model, "tiny_proof", proof)
    return model


def _check_model_supports(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan) -> None:
    """Context and expert parallel split meshlab's own Transformer for now, and a pipeline
    also a transformers causal LM: any other model gets an error naming what to change,
    never a bare AttributeError. Checked before any rank builds anything, so every rank
    refuses alike (one refusing alone would leave its pipeline peers waiting)."""
    from meshlab.models import Transformer

    if axis_size(mesh, "tp") > 1 and (tp_plan := _tp_plan(model, plan)) is not None:
        # a model's own plan may name parts some configs lack (Qwen3-MoE's dense MLPs)
        missed = unmatched(model, tp_plan)
        if missed and (plan.tp_plan is not None or len(missed) == len(tp_plan)):
            some = [n for n, _ in model.named_modules() if n.count(".") >= 2][:3]
            raise ValueError(f"tp_plan entries {missed} name no module or parameter of "
                             f"{type(model).__name__}, so nothing there would be split: its "
                             f"modules are named like {', '.join(some)}; fix the patterns "
                             "(* stands for one part of a name)")
    if isinstance(model, Transformer):
        return
    if axis_size(mesh, "pp") > 1 and axis_size(mesh, "tp") > 1 and plan.sequence_parallel:
        raise ValueError(f"sequence_parallel=True with pp={axis_size(mesh, 'pp')} is applied "
                         f"to meshlab's Transformer only, not yet to {type(model).__name__} "
                         "(its stages pass whole-sequence activations): pass "
                         "sequence_parallel=False, or build the mesh without pp")
    from meshlab.parallel import context, expert

    if axis_size(mesh, "pp") > 1:  # its layout read off one forward, or why not (the fix)
        from meshlab.parallel.pipeline_stage import layout_of

        layout_of(model, plan.blocks)
    checks = [("cp", "context parallel", context.takes(model), context.TAKES),
              ("ep", "expert parallel", expert.takes(model), expert.TAKES)]
    for axis, what, takes, takers in checks:
        if axis_size(mesh, axis) > 1 and not takes:
            raise ValueError(f"{what} ({axis}={axis_size(mesh, axis)}) is applied to {takers}, "
                             f"not yet to {type(model).__name__}: build the "
                             f"mesh without {axis} (DDP, ZeRO-1/2/3, HSDP, TP and activation "
                             "checkpointing take any model of repeated blocks)")


def _tp_plan(model: nn.Module, plan: ParallelPlan) -> Any:
    """The TP plan the model takes: the user's, or the one it ships; None for meshlab's
    Transformer, which takes meshlab's own."""
    from meshlab.models import Transformer

    if isinstance(model, Transformer) and plan.tp_plan is None:
        return None
    return plan.tp_plan if plan.tp_plan is not None else model_plan(model)


def _parallelize_stage(model: nn.Module, *, mesh: DeviceMesh, plan: ParallelPlan,
                       origins: Origins | None = None, seed: int = 0) -> nn.Module:
    """Expert, context and tensor parallel, activation checkpointing, data parallel; a
    model on meta gets its memory after FSDP shards it, or before DDP needs it whole."""
    tp = axis_size(mesh, "tp")
    ep = axis_size(mesh, "ep") > 1
    if ep:
        from meshlab.parallel.expert import apply_ep

        # averaged once the parameters are final: TP replaces them (hooks sit on objects)
        model = apply_ep(model, mesh, average=False)
    if axis_size(mesh, "cp") > 1:
        from meshlab.parallel.context import apply_cp

        model = apply_cp(model, mesh, seq_len=plan.seq_len, impl=plan.context_parallel,
                         chunks=plan.cp_chunks, offload=plan.cp_offload)
    if tp > 1:
        model = apply_tp(model, mesh, sequence_parallel=plan.sequence_parallel,
                         plan=plan.tp_plan, sp_regather=plan.sp_regather)
    model = apply_ac(model, plan.activation_checkpoint, blocks=plan.blocks)
    if ep:
        from meshlab.parallel.expert import average_gradients

        average_gradients(model, mesh)
    fsdp = plan.data_parallel in ("zero2", "zero3") and data_parallel_ranks(mesh, plan) > 1
    if plan.mixed_precision and not fsdp:
        dtype = precision.compute_dtype(plan.mixed_precision)
        model = apply_autocast(model, mesh.device_type, dtype)
    if plan.offload_activations:
        model = apply_activation_offload(model, blocks=plan.blocks)
    if origins is not None and not fsdp:
        model = materialize(model, origins, seed=seed)
    alone = plan.replica_sync != "every_step"  # the replicas reduce nothing between syncs
    within = "dp_shard_cp" if axis_size(mesh, "cp") > 1 else "dp_shard"
    if plan.data_parallel != "none" and data_parallel_ranks(mesh, plan) > 1:
        if plan.data_parallel in ("ddp", "zero1"):
            # cp ranks hold replicas too, trained on other parts of the same sequences
            axis = within if alone else "dp_cp" if axis_size(mesh, "cp") > 1 else "dp"
            model = apply_ddp(model, mesh, axis=axis)
        elif plan.data_parallel in ("zero2", "zero3"):
            # mixed precision: bf16/fp16 compute, fp32 gradient reduction (the usual recipe)
            mixed = precision.compute_dtype(plan.mixed_precision)
            # With PP, do not reshard after forward: it would all-gather per micro-batch.
            reshard = plan.data_parallel == "zero3" and axis_size(mesh, "pp") == 1
            model = apply_fsdp(model, mesh, reshard_after_forward=reshard,
                               param_dtype=mixed,
                               reduce_dtype=torch.float32 if mixed else None,
                               blocks=plan.blocks, replicate=not alone,
                               offload=plan.offload_params)
    if origins is not None and fsdp:
        model = materialize(model, origins, seed=seed)
    return model


def apply_autocast(model: nn.Module, device_type: str,
                   dtype: torch.dtype | None = torch.bfloat16) -> nn.Module:
    """bf16 (or fp16) compute where FSDP's mixed precision does not reach: the model's
    forward runs under torch.autocast (weights, gradients and optimizer stay fp32)."""
    model.forward = torch.autocast(device_type, dtype=dtype)(model.forward)
    return model


def data_parallel_ranks(mesh: DeviceMesh, plan: ParallelPlan) -> int:
    """Ranks the data-parallel wrapper reduces gradients over: dp and cp, or with local SGD
    or DiLoCo only those inside a replica."""
    return combinations.data_parallel_ranks(partial(axis_size, mesh), plan)


def build_optimizer(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan, *, lr: float = 1e-2,
                    weight_decay: float = 0.1, kind: str = "adamw") -> torch.optim.Optimizer:
    """The optimizer of ``kind`` (meshlab.parallel.optimizers.OPTIMIZERS: adamw, adamw_bf16
    (bf16 moments), adamw8bit (torchao), adafactor, sgd with momentum 0.9), its states sharded
    over dp for ZeRO-1; with local SGD or DiLoCo, it synchronises the replicas after its steps."""
    if kind not in OPTIMIZERS:
        raise ValueError(f"optimizer kind={kind!r} is not one of {tuple(OPTIMIZERS)}")
    cls, extra = OPTIMIZERS[kind]
    check_sharding(kind, model.parameters())  # before training, on every rank alike
    args = {"lr": lr, "weight_decay": weight_decay, **extra}
    alone = plan.replica_sync != "every_step"
    if plan.replica_sync == "parameter_server":  # the servers step; workers push and pull
        return load(PARAMETER_SERVER)(model, mesh, plan, optimizer_class=cls, **args)
    if plan.data_parallel == "zero1" and axis_size(mesh, "dp_shard" if alone else "dp") > 1:
        optimizer = apply_zero1(model, mesh, axis="dp_shard" if alone else "dp",
                                optimizer_class=cls, **args)
    else:
        optimizer = cls(model.parameters(), **args)
    if plan.max_grad_norm is not None:
        limit = plan.max_grad_norm

        def clip(*_: Any) -> None:
            clip_grad_norm_(model, limit)

        optimizer.register_step_pre_hook(clip)
    if alone:
        sync = replica_sync(model, mesh, plan)
        optimizer.register_step_post_hook(sync.after_step)
        optimizer.replica_sync = sync  # type: ignore[attr-defined]  # for a look at its count
    if plan.mixed_precision == "fp16":  # scale(loss); step unscales, then clips, or skips
        optimizer = precision.LossScaledOptimizer(optimizer, model, init_scale=plan.loss_scale)
    return optimizer


def replica_sync(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan) -> Any:
    """The object that synchronises the replicas after optimizer steps (``after_step``)."""
    return load(SYNCS[plan.replica_sync])(model, mesh, plan)
