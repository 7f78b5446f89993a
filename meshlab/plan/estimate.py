"""Memory, communication and step time of one layout: the what-if model.

Per GPU, for the busiest pipeline stage (``stage.Stage``: the first holds the most
micro-batches in flight, the last the output projection; the model takes the worse of each):

- memory (``memory``): ZeRO's parameter/gradient/optimizer bytes, Korthikanti's activations
  times the micro-batches the schedule keeps in flight (from the schedule simulator), the
  logits, and communication buffers;
- compute (``compute``): PaLM's training FLOPs (recompute included) at the hardware's
  achievable matmul rate, plus memory-bound work (norms, activations, residuals) at memory
  bandwidth;
- communication (``communication``): every collective each axis issues per step, its bytes,
  the link it runs on (inside a node or across nodes, from the axis order and GPUs per node)
  and its alpha-beta time; TP, CP and EP collectives sit on the critical path, FSDP/ZeRO and
  data-parallel ones overlap with compute up to the compute they can hide behind, pipeline
  sends overlap with other micro-batches;
- step time (here, with ``pipeline``): the pipeline schedule simulated with those stage
  times (no pipeline: the micro-batches one after another), then the gradient
  synchronisation left exposed, then the optimizer step.

What it leaves out (so reported runs are slower): kernel launch gaps, stragglers and
network congestion, load imbalance between experts, the embedding and loss as separate
stages, checkpointing and evaluation pauses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from meshlab.plan.communication import Collective, Communication
from meshlab.plan.compute import (
    ADAMW_BYTES,
    flops_per_token,
    microbatch_parts,
    optimizer_seconds,
    with_host,
)
from meshlab.plan.hardware import GIB, Hardware
from meshlab.plan.layout import Layout
from meshlab.plan.layout_check import check
from meshlab.plan.memory import DDP_BUCKET_BYTES, memory_per_gpu
from meshlab.plan.pipeline import SIMULATED_ACTIONS, pipeline_time
from meshlab.plan.shapes import ModelShape
from meshlab.plan.stage import Stage

__all__ = ["ADAMW_BYTES", "DDP_BUCKET_BYTES", "SIMULATED_ACTIONS", "Collective", "Estimate",
           "estimate"]

_pipeline = pipeline_time  # the name the pipeline model's tests import


@dataclass(frozen=True)
class Estimate:
    """What ``estimate`` predicts for one model, layout and hardware."""

    model: ModelShape
    layout: Layout
    hardware: Hardware
    memory: dict[str, float]
    """Bytes per GPU: params, grads, optimizer, activations, buffers, their total on the
    device, and host (what offloading keeps in host memory)."""
    collectives: list[Collective]
    compute_s: float
    """Compute of one step on one GPU, pipeline idle time excluded."""
    pipeline_s: float
    """The forward and backward of every micro-batch, pipeline bubble included."""
    bubble_fraction: float
    exposed_comm_s: float
    """Gradient synchronisation that compute could not hide (after the pipeline)."""
    optimizer_s: float
    step_s: float
    model_flops: float
    """Per step, all GPUs (6N + attention; what MFU divides by)."""
    hardware_flops: float
    """Per step, all GPUs, recompute included."""
    notes: list[str] = field(default_factory=list)
    exposed_by_axis: dict[str, float] = field(default_factory=dict)
    """Seconds per step each axis keeps on the critical path (the planner's axis names):
    TP/CP/EP collectives, the FSDP traffic compute could not hide, the gradient
    synchronisation left exposed; "host" for offloading's copies. With ``compute_s``,
    ``bubble_s`` and ``optimizer_s`` they add up to ``step_s``."""
    bubble_s: float = 0.0
    """Pipeline time beyond every micro-batch's forward, backward and exposed communication:
    the bubble, hop waits included (0 without a pipeline)."""
    compute_parts: dict[str, float] = field(default_factory=dict)
    """``compute_s`` by kind of work (``compute.COMPUTE_PARTS``), and "host": the host's
    fixed cost per layer where it outlasts the device's work (launch gaps)."""

    def terms(self) -> dict[str, float]:
        """The step time by what it is made of, adding up to ``step_s``: compute (GEMMs,
        attention, memory-bound work, host gaps), the communication each family of axes
        keeps exposed (tp, cp, ep; dp: every data-parallel axis; pp: blocking sends;
        offload: host copies), the pipeline bubble (hop waits included) and the optimizer
        step."""
        out = {k: self.compute_parts.get(k, 0.0)
               for k in ("gemm", "attention", "memory", "host")}
        for axis, seconds in self.exposed_by_axis.items():
            # dp_shard, dp_replicate, dp_shard+cp, dp_shard_mod_ep...: every data axis is dp
            term = "offload" if axis == "host" else "dp" if axis.startswith("dp") else axis
            out[term] = out.get(term, 0.0) + seconds
        return {**out, "bubble": self.bubble_s, "optimizer": self.optimizer_s}

    @property
    def fits(self) -> bool:
        """In the device's usable memory, and what is offloaded in the host's."""
        return (self.memory["total"] <= self.hardware.usable_bytes
                and self.memory["host"] <= self.hardware.host_memory_gib * GIB)

    @property
    def tokens_per_step(self) -> int:
        return self.layout.global_batch * self.model.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s each GPU achieves (recompute not counted, as papers report)."""
        return self.model_flops / self.step_s / self.layout.gpus / 1e12

    @property
    def hw_tflops_per_gpu(self) -> float:
        """Hardware TFLOP/s each GPU achieves: recomputed FLOPs counted too (what Megatron's
        papers report)."""
        return self.hardware_flops / self.step_s / self.layout.gpus / 1e12

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation against the dense peak of the compute dtype."""
        peak = self.hardware.tflops[self.layout.dtypes.compute]
        return self.tflops_per_gpu / peak

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation: recompute counted, against the same peak."""
        return self.hw_tflops_per_gpu / self.hardware.tflops[self.layout.dtypes.compute]

    def comm_by_axis(self) -> dict[str, float]:
        """Seconds per step of each axis's collectives (overlapped or not)."""
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c.axis] = out.get(c.axis, 0.0) + c.seconds
        return out

    def train_days(self, tokens: float) -> float:
        """Days to train on ``tokens`` tokens at this step time."""
        return tokens / self.tokens_per_s / 86400

    def gpu_hours(self, tokens: float) -> float:
        return self.train_days(tokens) * 24 * self.layout.gpus

    def summary(self) -> dict[str, Any]:
        """One row for a table of layouts."""
        m = self.memory
        return {"layout": self.layout.describe(), "gpus": self.layout.gpus,
                "fits": self.fits, "memory_gib": m["total"] / GIB,
                "params_gib": m["params"] / GIB, "grads_gib": m["grads"] / GIB,
                "optimizer_gib": m["optimizer"] / GIB,
                "activations_gib": m["activations"] / GIB, "buffers_gib": m["buffers"] / GIB,
                "host_gib": m["host"] / GIB,
                "step_s": self.step_s, "bubble": self.bubble_fraction,
                "exposed_comm_s": self.exposed_comm_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "hw_tflops_per_gpu": self.hw_tflops_per_gpu, "hfu": self.hfu,
                "global_batch": self.layout.global_batch}



def estimate(model: ModelShape, layout: Layout, hardware: Hardware) -> Estimate:
    """Predict memory per GPU, communication and step time (ValueError if invalid)."""
    check(model, layout)
    if layout.cp > 1 and layout.context_parallel == "torch" and not hardware.asynchronous:
        raise ValueError(f"context_parallel=torch (ring attention) runs on CUDA ranks only, and "
                         f"{hardware.name} is not a GPU: use context_parallel=meshlab or ulysses")
    stage, lay = Stage(model, layout, hardware), layout
    comm = Communication(stage)
    parts, host_f, host_b = microbatch_parts(stage)
    t_f = with_host(stage, sum(f for f, _ in parts.values()), host_f)
    t_b = with_host(stage, sum(b for _, b in parts.values()), host_b)
    compute_mb = t_f + t_b
    work = {k: lay.microbatches * (f + b) for k, (f, b) in parts.items()}
    work["host"] = max(0.0, lay.microbatches * compute_mb - sum(work.values()))
    t_f_crit, t_b_crit = comm.critical_path()  # TP, CP, EP per micro-batch
    # ring hops hide behind attention: what they leave, not their time, is exposed
    by_axis = _exposed(comm.collectives, (t_f_crit + t_b_crit) * lay.microbatches)
    fsdp_axis = "dp_shard+cp" if lay.cp > 1 else "dp_shard"
    hidden_f, hidden_b = comm.fsdp_per_microbatch()  # overlaps its own compute
    not_hidden = stage.not_hidden_units(hidden_f, t_f), stage.not_hidden_units(hidden_b, t_b)
    if not lay.overlap_grad_reduce:  # ZeRO-2/3's traffic waits for the compute around it
        not_hidden = hidden_f, hidden_b
    t_f += t_f_crit + not_hidden[0]
    t_b += t_b_crit + not_hidden[1]
    hop = comm.pipeline_hop()
    if not lay.overlap_p2p:  # each chunk's send and receive block its stage
        blocked = lay.stages_per_rank * hop
        t_f, t_b = t_f + blocked, t_b + blocked
        by_axis = _add(by_axis, {"pp": 2 * blocked * lay.microbatches})
    pipeline_s, bubble, inflight = pipeline_time(lay.schedule, lay.pp, lay.microbatches,
                                                 lay.stages_per_rank, t_f, t_b, hop)
    before = len(comm.collectives)
    synced = comm.gradient_sync(last_backward_s=t_b, forward_s=t_f,
                                step_compute_s=lay.microbatches * compute_mb)
    edges = comm.fsdp_edges()
    exposed = synced + edges
    by_axis = _add(by_axis, _exposed(comm.collectives[before:], synced),
                   {fsdp_axis: lay.microbatches * sum(not_hidden) + edges})
    compute_s = lay.microbatches * compute_mb
    copies = comm.host_copies()  # copy engines: beside the math, not slowing it
    copies_exposed = max(0.0, copies - compute_s) if hardware.asynchronous else copies
    exposed += copies_exposed
    by_axis = _add(by_axis, {"host": copies_exposed})
    optimizer_s = optimizer_seconds(stage)
    memory = memory_per_gpu(stage, inflight)
    notes: list[str] = [*precision_notes(lay)]
    if memory["total"] > hardware.usable_bytes:
        notes.append(f"needs {memory['total'] / GIB:.1f} GiB of "
                     f"{hardware.usable_bytes / GIB:.1f} GiB usable")
    if memory["host"] > hardware.host_memory_gib * GIB:
        notes.append(f"offloading needs {memory['host'] / GIB:.1f} GiB of host memory per GPU, "
                     f"{hardware.host_memory_gib:.0f} GiB there")
    if copies > compute_s:
        notes.append(f"offloading's PCIe copies take {copies:.3g} s a step, more than its "
                     f"{compute_s:.3g} s of compute: the PCIe link is the bottleneck")
    step = pipeline_s + exposed + optimizer_s
    tokens = lay.global_batch * model.seq_len
    model_per_token, hardware_per_token = flops_per_token(model, lay.recompute, model.layers)
    return Estimate(model=model, layout=lay, hardware=hardware, memory=memory,
                    collectives=comm.collectives, compute_s=compute_s,
                    pipeline_s=pipeline_s, bubble_fraction=bubble, exposed_comm_s=exposed,
                    optimizer_s=optimizer_s, step_s=step,
                    model_flops=model_per_token * tokens,
                    hardware_flops=hardware_per_token * tokens, notes=notes,
                    exposed_by_axis=by_axis,
                    bubble_s=max(0.0, pipeline_s - lay.microbatches * (t_f + t_b)),
                    compute_parts=work)


def term_differences(a: Estimate, b: Estimate, *, least: float = 0.02
                     ) -> list[tuple[str, float]]:
    """Why ``a``'s step differs from ``b``'s: each term (``Estimate.terms``) whose seconds
    differ by ``least`` of ``b``'s step or more, as (term, a's seconds less b's), the
    largest first."""
    ta, tb = a.terms(), b.terms()
    diffs = [(t, ta.get(t, 0.0) - tb.get(t, 0.0)) for t in {*ta, *tb}]
    return sorted([d for d in diffs if abs(d[1]) >= least * b.step_s], key=lambda d: -abs(d[1]))


def precision_notes(lay: Layout) -> list[str]:
    """What the planner assumes for the precision, optimizer and QAT of ``lay``."""
    out = []
    if lay.precision == "fp8":
        out.append("fp8: the blocks' Linear matmuls at the GPU's fp8 rate (torchao float8), "
                   "attention and the output projection in bf16, states as bf16's; "
                   "GPU only: meshlab.parallel does not run it, so this is planned, not "
                   "verified")
    if lay.precision == "fp16":
        out.append("fp16: counted as bf16 (2-byte parameters and gradients, fp32 master "
                   "weights, bf16's matmul peak); the loss scaler's state is negligible")
    if lay.qat != "none":
        out.append(f"qat={lay.qat}: the same memory; fake quantization's passes over weights"
                   + ("" if lay.qat == "4w" else " and activations")
                   + " added at memory bandwidth (assumed ~5 a value; not measured)")
    if lay.optimizer != "adamw":
        out.append(f"optimizer={lay.optimizer}: its states per parameter as "
                   "formulas.optimizer_bytes_per_param; its step time counted as AdamW's")
    return out


def _exposed(added: list[Collective], seconds: float) -> dict[str, float]:
    """``seconds`` of exposed communication shared among the axes of the collectives that
    left it: those on the critical path whole, the rest in proportion to their time."""
    critical = _add({}, *({c.axis: c.seconds} for c in added if not c.overlapped))
    rest = max(0.0, seconds - sum(critical.values()))
    overlapped = sum(c.seconds for c in added if c.overlapped)
    return _add(critical, *({c.axis: rest * c.seconds / overlapped} for c in added
                            if c.overlapped and overlapped > 0))


def _add(*parts: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for axis, seconds in part.items():
            if seconds > 0:
                out[axis] = out.get(axis, 0.0) + seconds
    return out
