"""How a run is split and trained: parallel degrees, ZeRO stage, batch, precision, recompute.

The degrees are the mesh's: their names, order, the ``dp`` alias and every rule on them
come from ``meshlab.mesh`` (a Layout is valid only if its ``MeshSpec`` is), so the planner
accepts exactly the meshes ``%mesh init`` builds. The other keys are the planner's own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from meshlab.mesh import ALIASES as MESH_ALIASES
from meshlab.mesh import AXES, OPTIONS, MeshSpec
from meshlab.plan.context_formulas import CONTIGUOUS_CP, CP_IMPLEMENTATIONS
from meshlab.plan.formulas import (
    EVERY_H,
    OPTIMIZER_KINDS,
    PLANNED_RECOMPUTE,
    REPLICA_SYNC,
    ZERO_STAGES,
)
from meshlab.plan.hardware import ATTENTION_KERNELS
from meshlab.plan.precision import PRECISIONS, Precision
from meshlab.schedules import BUILDERS, TAKES_VIRTUAL, stages_per_rank

OPTIMIZERS = OPTIMIZER_KINDS
"""build_optimizer's kinds: the optimizer's state bytes per parameter, zero_bytes' K
(formulas.optimizer_bytes_per_param)."""
QAT_SCHEMES = ("none", "8da4w", "8da8w", "4w")
"""ParallelPlan's qat schemes (meshlab.parallel.precision; "none": no QAT): fake-quantized
weights (4 or 8 bits) and, for 8da*, 8-bit dynamic activations in every Linear's forward."""

SHARD_UNITS = ("layer", "weight")
DEFAULT_SCHEDULE = "1f1b"
"""The schedule of a layout that names none: the only one a layout without a pipeline has."""
ASYNC_TP_IMPLEMENTATIONS = ("torch", "te")
"""Who runs async TP: torch.compile's micro-pipeline pass, or Transformer Engine."""
ALIASES = {**MESH_ALIASES, "mbs": "micro_batch", "m": "microbatches", "ac": "recompute",
           "sp": "sequence_parallel", "v": "virtual", "grad_accum": "microbatches",
           "cp_impl": "context_parallel"}
"""Short names ``Layout.parse`` and search constraints take: the mesh's, then the planner's
(without a pipeline, the micro-batches are gradient accumulation's micro-steps)."""
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "meshlab": {"reduce_fp32": True, "pipeline_grads_unsharded": True, "loss_parallel": False},
    "megatron": {}}
"""Whose code a plan counts, as the Layout fields that differ from the defaults (Megatron-LM's
counts): meshlab reduces in fp32 under bf16, under a pipeline FSDP2 accumulates a stage's
gradients unsharded, and the loss sees whole logits (its sequence parallelism re-gathers as
Megatron's does: ParallelPlan.sp_regather)."""
# whole numbers >= 1
_COUNTS = ("virtual", "micro_batch", "microbatches", "sync_every", "cp_chunks")

_BOOLS = {"1": True, "true": True, "yes": True, "on": True,
          "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A training layout; gpus = pp x dp_replicate x dp_shard x cp x tp (ep is carved out of
    dp_shard x cp, as in meshlab.mesh and torchtitan)."""

    # the degrees: meshlab.mesh.OPTIONS, in its order (MeshSpec documents each)
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    zero: int = 3
    """0: DDP; 1: optimizer states sharded; 2: + gradients (parameters gathered once per
    step and kept, as Llama 3 ran FSDP); 3: + parameters (FSDP2, gathered for every
    micro-batch's forward and backward). Sharded over dp_shard x cp; dp_replicate ranks
    hold copies of each shard (HSDP)."""
    sequence_parallel: bool = True
    """With tp > 1: norms and dropout run on sequence shards (all-gather / reduce-scatter
    instead of all-reduce, same bytes)."""
    sp_regather: bool = True
    """With sequence parallelism: the attention's and the MLP's first projections keep their
    input's sequence shard and gather it again in the backward (Megatron-LM, and meshlab's
    ParallelPlan.sp_regather). Off: they keep the gathered input, 4h bytes a token where
    Megatron keeps 4h/tp (torch's SequenceParallel)."""
    loss_parallel: bool = True
    """The loss on the vocabulary's shards (Megatron's vocab-parallel cross-entropy): fp32
    logits and their gradient, 8 bytes a logit over tp. Off: on the whole vocabulary on
    every tp rank, its backward holding the fp32 log-probabilities, their gradient and the
    logits', 12 bytes a logit, and a pipeline stage's own output beside (meshlab's: the
    user's loss runs on plain tensors)."""
    schedule: str = DEFAULT_SCHEDULE
    virtual: int = 1
    """Pipeline stages per rank, for the schedules that take it (meshlab.schedules'
    TAKES_VIRTUAL; the V-shaped ones hold 2 whatever it says)."""
    micro_batch: int = 1
    """Sequences per micro-batch on each data-parallel rank."""
    microbatches: int = 1
    """Micro-batches per step (pipeline micro-batches, or gradient accumulation)."""
    recompute: str = "none"
    """Activation checkpointing: none, selective (attention core), full (whole layer) or op
    (torchtitan's per-op selective checkpointing: every other matmul and attention kept)."""
    precision: str = "bf16"
    flash_attention: bool = True
    """Attention kernels that do not store the s x s scores (FlashAttention, SDPA)."""
    attention_kernel: str = "auto"
    """Which fused kernel runs attention (``hardware.ATTENTION_KERNELS``): its measured rate
    in the hardware profile costs it. auto: cudnn where the profile measured it (torch's
    SDPA picks cuDNN on Hopper and Blackwell once its cuDNN is past 9.15, from torch 2.11:
    check_prefer_cudnn_attention), else flash2, else attention's two products at the GEMM
    model's rates."""
    shard_unit: str = "layer"
    """What ZeRO-2/3 gathers and reduces at once: "layer" (FSDP2 per block, torchtitan) or
    "weight" (each weight matrix: DeepSpeed ZeRO-3, FSDP1 wrapping every Linear)."""
    overlap_grad_reduce: bool = True
    """Gradients reduced during the backward, bucket by bucket (torch DDP, FSDP, Megatron's
    --overlap-grad-reduce); off: after it, and under ZeRO-2/3 the parameters gathered
    before the forward (Megatron-LM before 2023, without --overlap-param-gather)."""
    reduce_once: bool = True
    """With zero 2 or 3 and gradient accumulation (several micro-batches): gradients
    accumulate unsharded and are reduce-scattered once, behind the last micro-batch's
    backward (meshlab's own accumulation and Megatron's distributed optimizer; FSDP2 with
    set_requires_gradient_sync(False) until the last micro-batch; torch's pipeline stage).
    Off: FSDP2's default, every backward reduce-scatters its gradients, under a pipeline too
    (meshlab's ParallelPlan.reduce_every_microbatch: a unit's gradients unsharded at a time,
    accumulated as shards). ZeRO-0/1 reduce once either way."""
    overlap_p2p: bool = True
    """Pipeline sends and receives behind compute; off: each blocks its stage until the
    transfer is done (Megatron-LM before --overlap-p2p-communication, 2023; DeepSpeed's
    pipeline engine)."""
    fused: bool = False
    """Memory-bound work fused into few kernels (torch.compile; Megatron's fused LayerNorm,
    bias-GeLU, bias-dropout-add and masked softmax): each fused region reads its inputs and
    writes its outputs once. Off: eager PyTorch, one kernel per operator."""
    reduce_fp32: bool = False
    """Gradients reduced across data-parallel ranks in fp32 (Megatron-LM with bf16 forces
    it; torchtitan's FSDP reduce_dtype default; meshlab's own mixed precision): twice a
    16-bit gradient's bytes on the wire."""
    pipeline_grads_unsharded: bool = False
    """With a pipeline and ZeRO-2/3: each stage accumulates its gradients unsharded, in the
    dtype they are reduced in, from its first micro-batch to its last (FSDP2 under torch's
    PipelineStage, as meshlab runs it). Off: ZeRO-2 holds a unit's at a time (Llama 3's
    FSDP, as the paper gives it)."""
    async_tp: bool = False
    """Tensor-parallel collectives run behind the GEMMs they feed (torchtitan's async TP,
    Megatron's --tp-comm-overlap): what the GEMMs cannot hide is exposed. Off: on the
    critical path."""
    async_tp_impl: str = "torch"
    """Which collectives ``async_tp`` hides (``ASYNC_TP_IMPLEMENTATIONS``). ``torch``:
    torch.compile's micro-pipeline TP fuses an all-gather with the matmuls that read it and a
    reduce-scatter with the one matmul that feeds it, so the backward's reduce-scatters of
    the attention's and the MLP's input gradients (sums of the q, k, v or gate and up
    matmuls, separate Linear layers in Llama-style models) stay exposed. ``te``: Transformer
    Engine's userbuffers (Megatron's --tp-comm-overlap) hide all of them."""
    offload_params: bool = False
    """With zero 2 or 3: the shards of parameters, gradients and optimizer states in host
    memory, copied over PCIe for every gather and reduce-scatter, the optimizer stepping on
    the CPU (FSDP2's CPUOffloadPolicy; ZeRO-Offload's placement of the states)."""
    offload_activations: bool = False
    """What each layer saves for backward copied to host memory in the forward and back in
    the backward; the device holds the layers being computed only."""
    replica_sync: str = "every_step"
    """How the dp_replicate replicas agree: every_step (gradients reduced each step: DDP,
    HSDP), local_sgd (parameters averaged every sync_every steps), diloco (an outer step on
    the averaged pseudo-gradient every sync_every steps), edit (that step's all-reduce run
    block by block behind the next forward), a_edit (the same after a time budget: planned
    as sync_every steps, what the budget holds at the planned step time) or parameter_server
    (each step's gradients pushed to and parameters pulled from shards held across the
    replicas, behind the next step's compute when staleness >= 1)."""
    sync_every: int = 1
    """H: optimizer steps between the replicas' synchronisations (local_sgd, diloco, edit,
    a_edit)."""
    staleness: int = 0
    """parameter_server: versions a worker's parameters may lag (0: it waits every step)."""
    context_parallel: str = "meshlab"
    """With cp > 1, how attention crosses the sequence slices (context_formulas.CP_IMPLEMENTATIONS):
    meshlab (K/V all-gathered, gradients all-reduced), torch (ring, CUDA only), ulysses
    (all-to-all to heads), chunked (Ulysses, attention in cp_chunks chunks) or all_gather
    (Llama 3's: gradients reduce-scattered)."""
    cp_chunks: int = 4
    """context_parallel=chunked: the chunks the sequence goes through attention in."""
    cp_offload: bool = False
    """context_parallel=chunked: key/value chunks wait in host memory between uses."""
    cp_balanced: bool = False
    """context_parallel=torch or meshlab: each rank holds chunks i and 2·cp-1-i of the
    sequence cut in 2·cp (head-tail), so causal attention costs every rank the same: torch's
    context_parallel() does this by default (_ContextParallelOptions.enable_load_balance),
    as does Megatron's get_batch_on_this_cp_rank. Off: contiguous slices, as meshlab's
    runtime holds them (the last rank's queries see every key: 2 - 1/cp times the mean)."""
    optimizer: str = "adamw"
    """The optimizer (OPTIMIZERS): its state bytes per parameter, sharded by ZeRO >= 1."""
    qat: str = "none"
    """Quantization-aware training (QAT_SCHEMES): the same memory (fake-quantized copies are
    transient), memory-bound fake-quant passes added to the compute."""

    def __post_init__(self) -> None:
        # the degrees are checked again, in full, by MeshSpec below: this names the fix first
        for name in (*OPTIONS, *_COUNTS):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}: "
                                 f"pass {name}=1 or more")
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero must be one of {ZERO_STAGES}, got {self.zero}")
        if self.recompute not in PLANNED_RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(PLANNED_RECOMPUTE)}, "
                             f"got {self.recompute!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"got {self.precision!r}")
        if self.shard_unit not in SHARD_UNITS:
            raise ValueError(f"shard_unit must be one of {', '.join(SHARD_UNITS)}, "
                             f"got {self.shard_unit!r}")
        if self.schedule not in BUILDERS:
            raise ValueError(f"schedule must be one of {', '.join(BUILDERS)}, "
                             f"got {self.schedule!r}")
        self._check_offload_and_replicas()
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got "
                             f"{self.optimizer!r}")
        if self.qat not in QAT_SCHEMES:
            raise ValueError(f"qat must be one of {', '.join(QAT_SCHEMES)}, got {self.qat!r}")
        if self.attention_kernel not in ("auto", *ATTENTION_KERNELS):
            raise ValueError(f"attention_kernel must be auto or one of "
                             f"{', '.join(ATTENTION_KERNELS)}, got {self.attention_kernel!r}")
        if self.async_tp_impl not in ASYNC_TP_IMPLEMENTATIONS:
            raise ValueError(f"async_tp_impl must be one of "
                             f"{', '.join(ASYNC_TP_IMPLEMENTATIONS)}, got {self.async_tp_impl!r}")
        if self.context_parallel not in CP_IMPLEMENTATIONS:
            raise ValueError(f"context_parallel must be one of {', '.join(CP_IMPLEMENTATIONS)}"
                             f", got {self.context_parallel!r}")
        if self.cp_offload and self.context_parallel != "chunked":
            raise ValueError(f"cp_offload with context_parallel={self.context_parallel}: only "
                             "chunked offloads key/value chunks; use context_parallel=chunked")
        if self.cp_balanced and self.context_parallel not in CONTIGUOUS_CP:
            raise ValueError(f"cp_balanced with context_parallel={self.context_parallel}: only "
                             f"{' and '.join(CONTIGUOUS_CP)} slice the sequence contiguously "
                             "(the others already split the work evenly); drop cp_balanced")
        if self.schedule in TAKES_VIRTUAL and self.virtual == 1:
            raise ValueError(f"schedule={self.schedule} with v=1 would run plain 1F1B: give "
                             "v=2 or more stages per rank, or schedule=1f1b")
        # MeshSpec's own checks (ep divides dp_shard x cp and is a multiple of cp, ...): a
        # layout is refused exactly where %mesh init would refuse its mesh
        _ = self.mesh_spec

    def _check_offload_and_replicas(self) -> None:
        """The rules meshlab.parallel's ParallelPlan keeps, so a plan is one it can run."""
        if self.offload_params and self.zero < 2:
            raise ValueError(f"offload_params with zero={self.zero}: the shards FSDP keeps are "
                             "what is offloaded; use zero=2 or zero=3")
        if self.replica_sync not in REPLICA_SYNC:
            raise ValueError(f"replica_sync must be one of {', '.join(REPLICA_SYNC)}, got "
                             f"{self.replica_sync!r}")
        if self.sync_every > 1 and self.replica_sync not in EVERY_H:
            raise ValueError(f"sync_every={self.sync_every} needs replica_sync="
                             f"{'/'.join(EVERY_H)}: {self.replica_sync} synchronises every step")
        if self.staleness < 0 or (self.staleness and self.replica_sync != "parameter_server"):
            raise ValueError(f"staleness={self.staleness} applies to "
                             "replica_sync=parameter_server only, as an integer >= 0")
        if self.replica_sync != "every_step" and self.dp_replicate < 2:
            raise ValueError(f"replica_sync={self.replica_sync} synchronises dp_replicate "
                             "replicas, and this layout has none: give dp_replicate=2 or more")
        if self.replica_sync != "every_step" and (self.pp > 1 or self.ep > 1):
            raise ValueError(f"replica_sync={self.replica_sync} with pp or ep is not verified "
                             "in meshlab.parallel: use pp=1 ep=1")

    @cached_property
    def mesh_spec(self) -> MeshSpec:
        """The mesh of this layout, as ``%mesh init`` and ``meshlab.mesh.build`` take it."""
        return MeshSpec(**{a: getattr(self, a) for a in OPTIONS})

    @property
    def gpus(self) -> int:
        return self.mesh_spec.size

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that see different sequences."""
        return self.dp_replicate * self.dp_shard

    @property
    def shard_group(self) -> int:
        """Ranks a ZeRO / FSDP shard is spread over (cp ranks hold the same weights)."""
        return self.dp_shard * self.cp

    @property
    def fsdp_accumulation(self) -> bool:
        """ZeRO-2/3 with several micro-batches and no pipeline: gradient accumulation, whose
        reduction ``reduce_once`` holds back to the last micro-batch."""
        return self.zero >= 2 and self.pp == 1 and self.microbatches > 1

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.micro_batch * self.microbatches * self.dp

    @property
    def dtypes(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages on each rank: ``virtual``, or 2 for the V-shaped schedules."""
        return stages_per_rank(self.schedule, self.virtual)

    def stride(self, axis: str) -> int:
        """Rank distance between neighbours of ``axis`` (tp: 1; its outer axes: more), in the
        mesh's order of axes."""
        if axis not in AXES:
            raise ValueError(f"unknown mesh axis {axis!r}: ask for one of {', '.join(AXES)}")
        return math.prod(getattr(self, a) for a in AXES[AXES.index(axis) + 1:])

    def describe(self) -> str:
        """``pp=4 dp_shard=8 tp=8 zero=1 mbs=1 m=16`` (the degrees > 1 and the choices; not
        whose code holds the memory, which a Plan says once)."""
        parts = [f"{a}={getattr(self, a)}" for a in OPTIONS if getattr(self, a) > 1]
        parts.append(f"zero={self.zero}")
        if self.pp > 1:
            parts.append(self.schedule + (f"/v{self.virtual}" if self.virtual > 1 else ""))
        parts.append(f"mbs={self.micro_batch} m={self.microbatches}")
        if self.recompute != "none":
            parts.append(f"ac={self.recompute}")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("sp=0")
        if not self.flash_attention:
            parts.append("flash_attention=0")
        elif self.attention_kernel != "auto":
            parts.append(f"attention_kernel={self.attention_kernel}")
        if self.shard_unit != "layer" and self.zero >= 2:
            parts.append(f"shard_unit={self.shard_unit}")
        if not self.overlap_grad_reduce:
            parts.append("overlap_grad_reduce=0")
        if self.zero >= 2 and not self.reduce_once:
            parts.append("reduce_once=0")
        if self.pp > 1 and not self.overlap_p2p:
            parts.append("overlap_p2p=0")
        if self.fused:
            parts.append("fused=1")
        if self.reduce_fp32 and self.dp * self.cp > 1:
            parts.append("reduce_fp32=1")
        if self.tp > 1 and self.async_tp:
            parts.append("async_tp=1" + (f" async_tp_impl={self.async_tp_impl}"
                                         if self.async_tp_impl != "torch" else ""))
        parts += [f"{k}=1" for k in ("offload_params", "offload_activations") if getattr(self, k)]
        if self.cp > 1:
            parts.append(f"cp_impl={self.context_parallel}")
            if self.context_parallel == "chunked":
                parts.append(f"cp_chunks={self.cp_chunks}" + (" cp_offload=1"
                                                               if self.cp_offload else ""))
            if self.cp_balanced:
                parts.append("cp_balanced=1")
        parts += [f"{k}={getattr(self, k)}" for k, default in (("optimizer", "adamw"),
                                                                ("qat", "none"))
                  if getattr(self, k) != default]
        if self.replica_sync != "every_step":
            parts.append(f"replica_sync={self.replica_sync}")
            parts.append(f"staleness={self.staleness}" if self.replica_sync == "parameter_server"
                         else f"sync_every={self.sync_every}")
        return " ".join(parts)

    @classmethod
    def parse(cls, text: str, **defaults: Any) -> Layout:
        """``"pp=4 dp=8 tp=8 zero=1 mbs=1 m=16 ac=full"`` (dp means dp_shard)."""
        return cls(**{**defaults, **cls.stated(text)})

    @classmethod
    def stated(cls, text: str) -> dict[str, Any]:
        """The values a layout string gives, by field name (what ``parse`` does not fill
        in from its defaults): ``"dp=8 m=4"`` -> {"dp_shard": 8, "microbatches": 4}."""
        values: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(cls)}
        for token in text.replace(",", " ").split():
            match = re.fullmatch(r"([a-z_][a-z0-9_]*)=(\S+)", token)
            key = ALIASES.get(match.group(1), match.group(1)) if match else ""
            if not match or key not in types:
                raise ValueError(f"layout {token!r}: write NAME=VALUE with NAME one of "
                                 f"{', '.join([*types, *ALIASES])}")
            if key in values:  # as MeshSpec.parse: "dp=2 dp_shard=4" is a typo, not a choice
                raise ValueError(f"layout {token!r}: {key} given twice in {text!r}: "
                                 "keep one")
            value = match.group(2)
            try:
                if types[key] == "int":
                    values[key] = int(value)
                elif types[key] == "bool":
                    values[key] = _BOOLS[value.lower()]
                else:
                    values[key] = value
            except ValueError:
                raise ValueError(f"layout {token!r}: {key} takes a whole number") from None
            except KeyError:  # a typo must not read as "on"
                raise ValueError(f"layout {token!r}: {key} takes 1/0, true/false, yes/no or "
                                 "on/off") from None
        return values
