"""ParallelPlan: how to parallelize a model on a mesh (the degrees come from the mesh). Each
field's checks that need nothing else run here; those that pair it with the mesh are
meshlab.parallel.combinations', run by parallelize."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from meshlab.parallel import precision
from meshlab.parallel.activation_checkpoint import MODES
from meshlab.parallel.context import IMPLEMENTATIONS
from meshlab.plan.formulas import EVERY_H as PLANNED_EVERY_H
from meshlab.plan.formulas import REPLICA_SYNC
from meshlab.schedules import Schedule, ScheduleError, build, canonical, check_virtual

DATA_PARALLEL = ("none", "ddp", "zero1", "zero2", "zero3")
EVERY_H = tuple(m for m in PLANNED_EVERY_H if m != "a_edit")  # a_edit: sync_seconds


@dataclass(kw_only=True, slots=True)
class ParallelPlan:
    """How to parallelize a model on a mesh; the degrees come from the mesh itself."""

    data_parallel: str = "zero3"
    """none, ddp, zero1 (DDP + sharded optimizer), zero2 or zero3 (FSDP2; HSDP with a
    dp_replicate axis)."""
    seq_len: int = 16
    """Sequence length of a batch; context parallelism splits it over the cp axis."""
    sequence_parallel: bool | None = None
    """With tp > 1, also split norms and the residual stream along the sequence; None: where
    the TP plan has it (meshlab's plan does, transformers' do not)."""
    sp_regather: bool = True
    """With sequence parallelism: the attention's and the MLP's gathered inputs are kept as
    this rank's part of the sequence and gathered again in the backward (Megatron-LM's
    memory: 4h bytes a token a layer become 4h/tp, for one more all-gather a module); False
    keeps them whole (torch's SequenceParallel)."""
    tp_plan: Mapping[str, Any] | None = None
    """With tp > 1: module pattern -> ColwiseParallel() | RowwiseParallel() | ... (torch
    style), or transformers' names ("colwise", ...); None: the model's own plan (meshlab's, or
    transformers' ``_tp_plan``)."""
    blocks: str | None = None
    """Path to the model's repeated blocks (e.g. "model.layers"), which FSDP shards one by one
    and activation checkpointing wraps; None: found (meshlab.parallel.blocks)."""
    activation_checkpoint: str = "none"
    """none, selective (attention core) or full (every block)."""
    mixed_precision: bool | str = False
    """bf16 (or True) or fp16 compute: on FSDP stages (zero2, zero3) parameters in that dtype
    with fp32 gradient reduction; on any other, torch.autocast around the forward, fp32
    weights. fp16 adds dynamic loss scaling: build_optimizer's optimizer then has
    ``scale(loss)`` (meshlab.parallel.precision)."""
    max_grad_norm: float | None = None
    """Clip the gradient to this norm before each optimizer step: the norm of the whole
    model across every axis (meshlab.parallel.clip), as one process would clip it."""
    pipeline_schedule: str | Schedule = "1f1b"
    """With a pp axis: a schedule meshlab builds (gpipe, 1f1b, interleaved_1f1b, looped_bfs,
    zb_h1, zbv, dualpipev: meshlab.schedules.BUILDERS) or a user's own Schedule
    (meshlab.schedules.parse), built for pp ranks."""
    microbatches: int = 2
    """Micro-batches per step through the pipeline (must divide the local batch)."""
    reduce_every_microbatch: bool = False
    """With a pp axis and zero2 or zero3: each micro-batch's gradients reduce-scattered as its
    backward ends and accumulated as shards, where torch's pipeline stage holds them
    unsharded, in the reduce dtype, until the last (meshlab.schedules.reducing_stage;
    Llama 3 405B's second stage 69.5 GiB instead of 79.8) for microbatches times the
    reduce-scatter bytes. Schedules of whole backwards only (not zb_h1, zbv, dualpipev)."""
    virtual: int = 1
    """Stages per rank for the looped schedules (interleaved_1f1b, looped_bfs)."""
    split_points: Sequence[str] | None = None
    """The blocks that open pipeline stages 1, 2, ... (torchtitan's names: ["layers.3"], or
    ["model.layers.3"] on a transformers model); None: blocks split as evenly as they go."""
    context_parallel: str = "auto"
    """With cp > 1: meshlab (all-gather K/V, any device), torch (torch's ring attention,
    CUDA only), ulysses (all-to-all, heads split over cp), chunked (FPDT-style: Ulysses'
    layout, the sequence through attention in cp_chunks chunks) or auto (torch's on CUDA,
    meshlab's elsewhere)."""
    cp_chunks: int = 4
    """context_parallel='chunked': chunks the sequence goes through attention in (scores of
    one chunk against the keys so far at a time, each recomputed in backward)."""
    cp_offload: bool = False
    """context_parallel='chunked': key/value chunks kept in host memory between uses."""
    replica_sync: str = "every_step"
    """How the dp_replicate replicas agree: every_step (their gradients reduced each step:
    DDP, HSDP), local_sgd (parameters averaged every sync_every steps), diloco (an outer
    Nesterov step on the averaged pseudo-gradient every sync_every steps), edit (EDiT: that
    outer step taken block by block in the next forward, with the pseudo-gradient penalty),
    a_edit (the same, each replica syncing after sync_seconds of local steps, so fast ones
    take more) or parameter_server (workers push gradients to parameter shards held across
    the replicas and compute on versions at most ``staleness`` behind)."""
    sync_every: int = 1
    """H: optimizer steps between synchronisations, with local_sgd, diloco or edit."""
    sync_seconds: float | None = None
    """A-EDiT's time budget: each replica takes local steps until this many seconds have
    passed since the last synchronisation (a_edit only)."""
    staleness: int = 0
    """parameter_server: how many versions behind the newest a worker's parameters may be
    when it computes a gradient (0: every worker waits for every update, synchronous DP)."""
    pseudo_grad_penalty: bool = True
    """edit, a_edit: EDiT's pseudo-gradient penalty (a replica whose pseudo-gradient norm is
    anomalous is left out, the others weighted by their norms; meshlab.replicas.edit_penalty.Penalty
    holds its thresholds and an optional clip of the average)."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (the paper's 0.7)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum (the paper's 0.9)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step, gradients reduced over dp once, in the last
    (meshlab.parallel.accumulate): k micro-steps on 1/k of the batch each equal one step on
    it, with the memory of the smaller one."""
    offload_params: bool = False
    """Each rank's parameter shards, their gradients and optimizer states in host memory,
    copied to the device for every gather, the optimizer stepping on the CPU (FSDP2's
    CPUOffloadPolicy; zero2 or zero3)."""
    offload_activations: bool = False
    """What every block saves for backward kept in host memory until backward needs it
    (meshlab.parallel.offload)."""
    loss_scale: float = 2.0**16
    """fp16: the dynamic loss scale to start from (halved on each overflow, doubled after
    2000 steps without one; torch's GradScaler defaults)."""
    qat: str | None = None
    """Quantization-aware training: every Linear fake-quantized in the forward by a torchao
    scheme (8da4w, 8da8w, 4w: meshlab.parallel.precision.QAT_SCHEMES), before the
    strategies; None: no QAT. Needs torchao."""

    def __post_init__(self) -> None:
        # precision: one vocabulary (True is bf16), fp8 refused (meshlab.parallel.precision)
        precision.precision_of(self.mixed_precision)
        if self.qat is not None and self.qat not in precision.QAT_SCHEMES:
            raise ValueError(f"qat={self.qat!r} is not one of "
                             f"{tuple(precision.QAT_SCHEMES)} (or None)")
        precision.check_fp16(self, {})
        if not self.loss_scale > 0:
            raise ValueError(f"loss_scale={self.loss_scale!r} must be a positive number (fp16's "
                             "initial loss scale, e.g. 65536.0)")
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel={self.data_parallel!r} is not one of "
                             f"{DATA_PARALLEL}")
        if self.activation_checkpoint not in MODES:
            raise ValueError(f"activation_checkpoint={self.activation_checkpoint!r} is not one "
                             f"of {MODES}")
        if self.context_parallel not in IMPLEMENTATIONS:
            raise ValueError(f"context_parallel={self.context_parallel!r} is not one of "
                             f"{IMPLEMENTATIONS}")
        if not isinstance(self.cp_chunks, int) or self.cp_chunks < 1:
            raise ValueError(f"cp_chunks={self.cp_chunks!r} must be an integer >= 1 (chunks "
                             "of the sequence through attention), e.g. cp_chunks=4")
        if (self.cp_chunks != 4 or self.cp_offload) and self.context_parallel != "chunked":
            raise ValueError(f"cp_chunks={self.cp_chunks}, cp_offload={self.cp_offload} apply "
                             f"to context_parallel='chunked', not {self.context_parallel!r}: "
                             "pass context_parallel='chunked' (or leave them at 4, False)")
        if self.microbatches < 1:
            raise ValueError(f"microbatches={self.microbatches} must be >= 1")
        if self.virtual < 1:
            raise ValueError(f"virtual={self.virtual} must be >= 1 (stages per rank)")
        if self.replica_sync not in REPLICA_SYNC:
            raise ValueError(f"replica_sync={self.replica_sync!r} is not one of {REPLICA_SYNC}")
        if not isinstance(self.sync_every, int) or self.sync_every < 1:
            raise ValueError(f"sync_every={self.sync_every!r} must be an integer >= 1 "
                             "(optimizer steps between synchronisations)")
        if self.sync_every > 1 and self.replica_sync not in EVERY_H:
            raise ValueError(f"sync_every={self.sync_every} applies to replica_sync="
                             f"{', '.join(map(repr, EVERY_H))}, not {self.replica_sync!r}"
                             + (" (a_edit syncs by time: give sync_seconds)"
                                if self.replica_sync == "a_edit" else ""))
        if (self.sync_seconds is None) == (self.replica_sync == "a_edit"):
            raise ValueError(f"sync_seconds={self.sync_seconds!r} with replica_sync="
                             f"{self.replica_sync!r}: a_edit, and only a_edit, syncs every "
                             "sync_seconds seconds (e.g. sync_seconds=2.0)")
        if self.sync_seconds is not None and not self.sync_seconds > 0:
            raise ValueError(f"sync_seconds={self.sync_seconds!r} must be a positive number "
                             "of seconds between the replicas' synchronisations")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness={self.staleness!r} must be an integer >= 0 "
                             "(versions a worker's parameters may lag the newest)")
        if self.staleness and self.replica_sync != "parameter_server":
            raise ValueError(f"staleness={self.staleness} applies to "
                             f"replica_sync='parameter_server', not {self.replica_sync!r}")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ValueError(f"grad_accum={self.grad_accum!r} must be an integer >= 1 "
                             "(micro-steps per optimizer step)")
        if self.reduce_every_microbatch and self.data_parallel not in ("zero2", "zero3"):
            raise ValueError(f"reduce_every_microbatch=True with data_parallel="
                             f"{self.data_parallel!r}: it is how FSDP2's stages reduce; use "
                             "data_parallel='zero2' or 'zero3'")
        if self.offload_params and self.data_parallel not in ("zero2", "zero3"):
            raise ValueError(f"offload_params=True with data_parallel={self.data_parallel!r}: "
                             "parameters are offloaded by FSDP2 (CPUOffloadPolicy); use "
                             "data_parallel='zero2' or 'zero3'")
        if isinstance(self.pipeline_schedule, Schedule):
            self._check_own_schedule(self.pipeline_schedule)
        else:
            key = self.pipeline_schedule = canonical(self.pipeline_schedule)
            check_virtual(key, self.virtual, said=f"pipeline_schedule={key!r}")
        if self.max_grad_norm is not None and not self.max_grad_norm > 0:
            raise ValueError(f"max_grad_norm={self.max_grad_norm!r} must be a positive number "
                             "(the largest gradient norm), or None for no clipping")

    def _check_own_schedule(self, schedule: Schedule) -> None:
        schedule.validate()
        if self.microbatches != schedule.microbatches:
            raise ScheduleError(f"microbatches={self.microbatches} but the pipeline_schedule "
                                f"runs {schedule.microbatches} micro-batches: pass "
                                f"microbatches={schedule.microbatches}")
        if self.virtual != 1:
            raise ScheduleError(f"virtual={self.virtual} applies to a schedule built by name; "
                                f"a Schedule places its own stages ({schedule.stages} on "
                                f"{schedule.ranks} ranks): leave virtual=1")

    def schedule(self, pp: int) -> Schedule:
        """The pipeline schedule this plan runs on ``pp`` pipeline ranks."""
        if isinstance(self.pipeline_schedule, Schedule):
            return self.pipeline_schedule
        return build(self.pipeline_schedule, ranks=pp, microbatches=self.microbatches,
                     virtual=self.virtual)
