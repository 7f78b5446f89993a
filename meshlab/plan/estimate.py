"""Memory, communication and step time of one layout: the what-if model.

Per GPU, for the busiest pipeline stage (the first holds the most micro-batches in flight,
the last the output projection; the model takes the worse of each):

- memory: ZeRO's parameter/gradient/optimizer bytes, Korthikanti's activations times the
  micro-batches the schedule keeps in flight (from the schedule simulator), the logits,
  and communication buffers;
- compute: PaLM's training FLOPs (recompute included) at the hardware's achievable matmul
  rate, plus memory-bound work (norms, activations, residuals) at memory bandwidth;
- communication: every collective each axis issues per step, its bytes, the link it runs
  on (inside a node or across nodes, from the axis order and GPUs per node) and its
  alpha-beta time; TP, CP and EP collectives sit on the critical path, FSDP/ZeRO and
  data-parallel ones overlap with compute up to the compute they can hide behind, pipeline
  sends overlap with other micro-batches;
- step time: the pipeline schedule simulated with those stage times (no pipeline: the
  micro-batches one after another), then the gradient synchronisation left exposed, then
  the optimizer step.

What it leaves out (so reported runs are slower): kernel launch gaps, stragglers and
network congestion, load imbalance between experts, the embedding and loss as separate
stages, checkpointing and evaluation pauses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from meshlab.plan.formulas import (
    activation_bytes_per_layer,
    collective_seconds,
    training_flops_per_token,
    zero_bytes,
)
from meshlab.plan.hardware import GIB, Hardware
from meshlab.plan.layout import Layout, check
from meshlab.plan.shapes import ModelShape
from meshlab.schedules.builders import BREADTH_FIRST

DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb
ADAMW_BYTES = 80  # bytes moved per parameter by one AdamW step (see _optimizer_seconds)
SIMULATED_ACTIONS = 512  # forwards per step simulated exactly; longer steps extrapolated


@dataclass(frozen=True)
class Collective:
    """One kind of collective an axis issues in a step."""

    axis: str
    """The mesh axis (or group) it runs on, e.g. tp, dp_shard+cp, pp."""
    what: str
    """Why it happens, e.g. "FSDP all-gather of parameters (forward)"."""
    collective: str
    ranks: int
    nbytes: float
    """Bytes of one call (the convention of formulas.collective_seconds)."""
    calls: int
    """Calls per step on one GPU."""
    inter_node: bool
    seconds: float
    """All calls of the step together."""
    overlapped: bool
    """Can run behind compute (else it is on the critical path)."""


@dataclass(frozen=True)
class Estimate:
    """What ``estimate`` predicts for one model, layout and hardware."""

    model: ModelShape
    layout: Layout
    hardware: Hardware
    memory: dict[str, float]
    """Bytes per GPU: params, grads, optimizer, activations, buffers, total."""
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

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self.hardware.usable_bytes

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
    def mfu(self) -> float:
        """Model FLOPs utilisation against the dense peak of the compute dtype."""
        peak = self.hardware.tflops[self.layout.dtypes.compute]
        return self.tflops_per_gpu / peak

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
                "step_s": self.step_s, "bubble": self.bubble_fraction,
                "exposed_comm_s": self.exposed_comm_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu,
                "global_batch": self.layout.global_batch}


def estimate(model: ModelShape, layout: Layout, hardware: Hardware) -> Estimate:
    """Predict memory per GPU, communication and step time (ValueError if invalid)."""
    check(model, layout)
    return _Estimator(model, layout, hardware).run()


class _Estimator:
    def __init__(self, model: ModelShape, layout: Layout, hw: Hardware) -> None:
        self.m, self.l, self.hw = model, layout, hw
        self.dt = layout.dtypes
        self.layers = math.ceil(model.layers / layout.pp)  # on the busiest stage
        self.seq = model.seq_len // layout.cp  # tokens of one sequence on one rank
        self.tokens = layout.micro_batch * self.seq  # per micro-batch, per rank
        self.collectives: list[Collective] = []
        self.notes: list[str] = []

    # -- where an axis runs -------------------------------------------------------------

    def _spans_nodes(self, size: int, stride: int) -> bool:
        # ranks are numbered node by node; a group of `size` ranks `stride` apart spans
        # size x stride consecutive ranks
        return size > 1 and size * stride > self.hw.gpus_per_node

    def _add(self, axis: str, what: str, collective: str, ranks: int, stride: int,
             nbytes: float, calls: int, *, overlapped: bool) -> float:
        if (ranks <= 1 and collective != "send_recv") or calls == 0:
            return 0.0
        inter = self._spans_nodes(ranks, stride)
        link = self.hw.link(collective, inter_node=inter)
        one = collective_seconds(collective, ranks, nbytes, latency_s=link.latency_us * 1e-6,
                                 bandwidth_bytes_s=link.bandwidth_gbs * 1e9)
        self.collectives.append(Collective(axis, what, collective, ranks, nbytes, calls,
                                           inter, one * calls, overlapped))
        return one * calls

    # -- memory ---------------------------------------------------------------------------

    def _stage_params(self) -> tuple[float, float]:
        """(dense, expert) parameters one GPU holds before ZeRO sharding."""
        m, lay = self.m, self.l
        expert = m.experts * m.expert_params * self.layers / lay.tp / lay.ep if m.experts else 0
        dense_layer = m.layer_params - (m.experts * m.expert_params if m.experts else 0)
        dense = self.layers * dense_layer / lay.tp
        if lay.pp == 1:
            dense += m.embedding_params / lay.tp
        else:  # the first stage holds the embedding, the last the output: about the same
            dense += m.vocab * m.hidden / lay.tp
        return dense, expert

    def _memory(self, inflight: float) -> dict[str, float]:
        lay, dt, m = self.l, self.dt, self.m
        dense, expert = self._stage_params()
        kw = dict(stage=lay.zero, param_bytes=dt.params, grad_bytes=dt.grads,
                  optimizer_bytes=dt.optimizer)
        states = zero_bytes(round(dense), dp=lay.shard_group, **kw)
        if expert:  # experts are sharded over the data ranks outside their ep group
            experts = zero_bytes(round(expert), dp=lay.shard_group // lay.ep, **kw)
            states = {k: states[k] + experts[k] for k in states}
        def layer_bytes(recompute: str) -> float:  # Korthikanti's are for 2-byte activations
            if recompute == "none" and lay.flash_attention:
                recompute = "selective"  # the same bytes: no s x s scores stored
            return activation_bytes_per_layer(
                seq=self.seq, batch=lay.micro_batch, hidden=m.hidden, heads=m.heads, tp=lay.tp,
                sequence_parallel=lay.sequence_parallel, recompute=recompute
            ) * dt.activations / 2

        chunk_layers = self.layers / lay.stages_per_rank
        activations = layer_bytes(lay.recompute) * chunk_layers * inflight
        if lay.recompute == "full":  # one layer's activations exist while it is recomputed
            activations += layer_bytes("none")
        # fp32 logits and their gradient for the loss, on the last stage (vocab-parallel)
        activations += 2 * 4 * self.tokens * m.vocab / lay.tp
        if lay.zero >= 2:  # FSDP: a layer gathered, the next prefetched; its grads unsharded
            layer = (m.layer_params / lay.tp) * (2 * dt.params + dt.grads)
            buffers = float(layer)
        else:  # DDP buckets
            buffers = 2.0 * DDP_BUCKET_BYTES
        out = {"params": states["params"], "grads": states["grads"],
               "optimizer": states["optimizer"], "activations": activations,
               "buffers": buffers}
        out["total"] = sum(out.values())
        return out

    # -- time ------------------------------------------------------------------------------

    def run(self) -> Estimate:
        m, lay, hw, dt = self.m, self.l, self.hw, self.dt
        width = m.heads * m.head_dim
        layer_model, layer_hw = training_flops_per_token(
            matmul_params=self._layer_matmul_params(), layers=1, seq=m.seq_len,
            attn_width=width, recompute=lay.recompute)
        out_flops = 6.0 * m.vocab * m.hidden  # output projection, last stage
        model_per_token = layer_model * m.layers + out_flops
        hardware_per_token = layer_hw * m.layers + out_flops
        # one micro-batch on the busiest stage, one GPU (tp shares each matmul)
        # one micro-batch on the busiest stage, one GPU (tp shares each matmul); the forward
        # is a third of the model FLOPs, the backward the rest plus any recompute
        rate = hw.flops_per_s(dt.compute)
        forward_flops = (layer_model * self.layers + out_flops) / 3 * self.tokens / lay.tp
        flops_mb = (layer_hw * self.layers + out_flops) * self.tokens / lay.tp
        memory_s = self._memory_bound_bytes() / (hw.memory_bandwidth_gbs * 1e9)
        t_f = forward_flops / rate + memory_s / 3
        t_b = flops_mb / rate + memory_s - t_f
        # the host's fixed cost per layer: hidden behind the math on an asynchronous device
        overhead = (hw.layer_overhead_us + hw.fsdp_overhead_us * (lay.zero >= 2)
                    + hw.tp_overhead_us * (lay.tp > 1)) * 1e-6 * self.layers
        if lay.recompute == "full":
            overhead *= 4 / 3  # the forward's operators run twice
        t_f, t_b = self._with_host(t_f, overhead / 3), self._with_host(t_b, overhead * 2 / 3)
        compute_mb = t_f + t_b
        t_f_crit, t_b_crit = self._critical_path_comm()  # TP, CP, EP per micro-batch
        hidden_f, hidden_b = self._fsdp_per_microbatch()  # overlaps its own compute
        t_f += t_f_crit + self._not_hidden(hidden_f, t_f)
        t_b += t_b_crit + self._not_hidden(hidden_b, t_b)
        hop = self._pipeline_hop()
        pipeline_s, bubble, inflight = _pipeline(lay.schedule, lay.pp, lay.microbatches,
                                                 lay.stages_per_rank, t_f, t_b, hop)
        exposed = self._gradient_sync(last_backward_s=t_b)
        optimizer_s = self._optimizer_seconds()
        memory = self._memory(inflight)
        if not self.fits(memory):
            self.notes.append(f"needs {memory['total'] / GIB:.1f} GiB of "
                              f"{hw.usable_bytes / GIB:.1f} GiB usable")
        step = pipeline_s + exposed + optimizer_s
        tokens = lay.global_batch * m.seq_len
        return Estimate(model=m, layout=lay, hardware=hw, memory=memory,
                        collectives=self.collectives,
                        compute_s=lay.microbatches * compute_mb, pipeline_s=pipeline_s,
                        bubble_fraction=bubble, exposed_comm_s=exposed,
                        optimizer_s=optimizer_s, step_s=step,
                        model_flops=model_per_token * tokens,
                        hardware_flops=hardware_per_token * tokens, notes=self.notes)

    def _with_host(self, device_s: float, host_s: float) -> float:
        return max(device_s, host_s) if self.hw.asynchronous else device_s + host_s

    def _not_hidden(self, comm_s: float, compute_s: float) -> float:
        """What of ``comm_s`` does not hide behind ``compute_s`` (on CPU ranks: all of it)."""
        return max(0.0, comm_s - compute_s) if self.hw.asynchronous else comm_s

    def fits(self, memory: dict[str, float]) -> bool:
        return memory["total"] <= self.hw.usable_bytes

    def _layer_matmul_params(self) -> int:
        m = self.m
        ffn = (m.top_k * m.expert_params + m.hidden * m.experts) if m.experts else m.expert_params
        return m.attention_params + ffn

    def _memory_bound_bytes(self) -> float:
        """Bytes the non-matmul work of one micro-batch moves (forward and backward).

        Eager PyTorch runs each elementwise step as its own kernel, reading and writing
        whole tensors: per token and layer, two RMSNorms (~7 passes over the hidden state
        each), RoPE on queries and keys (~3 passes), attention reading q, k, v and writing
        its output, two residual adds (3 passes each) and SwiGLU (~5 passes over the
        feed-forward width, per routed expert); the backward moves about twice as much.
        """
        m, lay = self.m, self.l
        q, kv = m.heads * m.head_dim, m.n_kv_heads * m.head_dim
        ffn = m.ffn * (m.top_k if m.experts else 1)
        per_token = (14 * m.hidden + 3 * (q + kv) + (2 * q + 2 * kv) + 6 * m.hidden
                     + 5 * ffn) / lay.tp
        return 3 * per_token * self.dt.activations * self.tokens * self.layers

    def _critical_path_comm(self) -> tuple[float, float]:
        """Forward and backward seconds of one micro-batch's TP, CP and EP collectives."""
        lay, m, dt = self.l, self.m, self.dt
        act = float(self.tokens * m.hidden * dt.activations)  # one activation tensor
        # (axis, what, collective, ranks, stride, bytes, calls per layer, in the backward?)
        calls: list[tuple[str, str, str, int, int, float, int, bool]] = []
        if lay.tp > 1:
            # Megatron: two all-reduces in the forward (attention, MLP), two in the backward;
            # with sequence parallelism each is an all-gather plus a reduce-scatter
            kinds = (("all_gather", "reduce_scatter") if lay.sequence_parallel
                     else ("all_reduce",))
            for kind in kinds:
                calls += [("tp", f"TP {kind} of activations", kind, lay.tp, 1, act, 2, False),
                          ("tp", f"TP {kind} of activation gradients", kind, lay.tp, 1, act,
                           2, True)]
        if lay.cp > 1:
            # each rank gathers every rank's keys and values; the backward reduce-scatters
            # their gradients (a ring pass moves the same bytes)
            kv = 2 * lay.micro_batch * m.seq_len * m.n_kv_heads * m.head_dim / lay.tp
            kv *= dt.activations
            stride = lay.stride("cp")
            calls += [("cp", "CP all-gather of keys and values", "all_gather", lay.cp, stride,
                       kv, 1, False),
                      ("cp", "CP reduce-scatter of key and value gradients", "reduce_scatter",
                       lay.cp, stride, kv, 1, True)]
        if lay.ep > 1:
            # dispatch and combine: each token's hidden state to top_k experts and back
            routed = self.tokens * m.top_k * m.hidden * dt.activations / lay.tp
            calls += [("ep", "EP all-to-all dispatch and combine", "all_to_all", lay.ep,
                       lay.tp, routed, 2, False),
                      ("ep", "EP all-to-all of their gradients", "all_to_all", lay.ep, lay.tp,
                       routed, 2, True)]
        f = b = 0.0
        n = self.layers * lay.microbatches
        for axis, what, kind, ranks, stride, nbytes, per_layer, backward in calls:
            seconds = self._add(axis, what, kind, ranks, stride, nbytes, per_layer * n,
                                overlapped=False) / lay.microbatches
            if backward:
                b += seconds
            else:
                f += seconds
                if lay.recompute == "full":  # the recomputed forward issues them again
                    b += self._add(axis, what + " (recomputed forward)", kind, ranks, stride,
                                   nbytes, per_layer * n,
                                   overlapped=False) / lay.microbatches
        return f, b

    def _fsdp_per_microbatch(self) -> tuple[float, float]:
        """FSDP (ZeRO-2/3) gathers and reduce-scatters of one micro-batch: (fwd, bwd)."""
        lay, dt = self.l, self.dt
        if lay.zero < 2 or lay.shard_group == 1:
            return 0.0, 0.0
        dense, expert = self._stage_params()
        group, stride, mb = lay.shard_group, lay.tp, lay.microbatches
        axis = "dp_shard+cp" if lay.cp > 1 else "dp_shard"
        # (parameters, ranks they are sharded over): experts only over the data ranks
        # outside their ep group (torchtitan's dp_shard_mod_ep)
        parts = [(dense, group), (expert, group // lay.ep)]
        units = self.layers  # one FSDP unit per layer, as fully_shard is applied
        fwd = bwd = 0.0
        for params, ranks in parts:
            if not params or ranks == 1:
                continue
            gather, calls = params * dt.params / units, units * mb
            # ZeRO-2 keeps the gathered parameters for the whole step (its memory counts
            # them unsharded): one gather per step; ZeRO-3 gathers for every micro-batch
            fwd += self._add(axis, "FSDP all-gather of parameters (forward)", "all_gather",
                             ranks, stride, gather, calls if lay.zero == 3 else units,
                             overlapped=True)
            if lay.zero == 3:
                bwd += self._add(axis, "FSDP all-gather of parameters (backward)",
                                 "all_gather", ranks, stride, gather, calls, overlapped=True)
            bwd += self._add(axis, "FSDP reduce-scatter of gradients", "reduce_scatter",
                             ranks, stride, params * dt.grads / units, calls, overlapped=True)
        return fwd / mb, bwd / mb

    def _gradient_sync(self, *, last_backward_s: float) -> float:
        """Seconds of once-per-step gradient (and ZeRO-1 parameter) sync left exposed."""
        lay, dt = self.l, self.dt
        dense, expert = self._stage_params()
        params = dense + expert
        exposed = 0.0
        dp_all = lay.dp * lay.cp  # every rank holding a copy of these weights
        if lay.zero <= 1 and dp_all > 1:
            axis = "dp" + ("+cp" if lay.cp > 1 else "")
            ar = self._add(axis, "gradient all-reduce", "all_reduce", dp_all, lay.tp,
                           params * dt.grads, 1, overlapped=True)
            # overlaps the last micro-batch's backward, bucket by bucket; the last bucket
            # always waits
            bucket = ar * min(1.0, DDP_BUCKET_BYTES / max(1.0, params * dt.grads))
            exposed += max(self._not_hidden(ar, last_backward_s), bucket)
            if lay.zero == 1 and lay.shard_group > 1:
                # as torch's ZeroRedundancyOptimizer (meshlab's zero1): all-reduce, then each
                # rank's updated shard to the others; the ZeRO paper's reduce-scatter +
                # all-gather would move the all-reduce's bytes only
                shard_axis = "dp_shard+cp" if lay.cp > 1 else "dp_shard"
                exposed += self._add(shard_axis, "ZeRO-1 all-gather of updated parameters",
                                     "all_gather", lay.shard_group, lay.tp,
                                     params * dt.params, 1, overlapped=False)
        elif lay.dp_replicate > 1:  # HSDP: the shards' gradients across replicas
            shard = params * dt.grads / lay.shard_group
            ar = self._add("dp_replicate", "HSDP all-reduce of gradient shards", "all_reduce",
                           lay.dp_replicate, lay.stride("dp_replicate"), shard, 1,
                           overlapped=True)
            exposed += self._not_hidden(ar, last_backward_s)
        return exposed

    def _pipeline_hop(self) -> float:
        """One micro-batch's activations (or their gradients) to the next stage."""
        lay, m = self.l, self.m
        if lay.pp == 1:
            return 0.0
        act = float(self.tokens * m.hidden * self.dt.activations)
        if lay.tp > 1 and lay.sequence_parallel:
            act /= lay.tp  # each tp rank sends its sequence shard
        calls = 2 * lay.microbatches * lay.stages_per_rank
        # ranks = the whole pipeline: once its stages span two nodes, some hop crosses them
        total = self._add("pp", "PP send/recv of activations and gradients", "send_recv",
                          lay.pp, lay.stride("pp"), act, calls, overlapped=True)
        return total / calls

    def _optimizer_seconds(self) -> float:
        """AdamW on the local shard: memory-bound. torch's default (foreach) AdamW passes
        over its four fp32 tensors (parameter, gradient, two moments) about 20 times a step:
        ~80 bytes per parameter (measured: 3.5M parameters in 25 ms at 13 GB/s)."""
        dense, expert = self._stage_params()
        shard = self.l.shard_group if self.l.zero >= 1 else 1
        return (dense + expert) / shard * ADAMW_BYTES / (self.hw.memory_bandwidth_gbs * 1e9)


def _pipeline(schedule: str, pp: int, microbatches: int, virtual: int, t_f: float,
              t_b: float, hop: float) -> tuple[float, float, float]:
    """(seconds, bubble fraction, peak micro-batch chunks in flight) of one step."""
    if pp == 1:
        return microbatches * (t_f + t_b), 0.0, 1.0
    if t_f <= 0:
        return 0.0, 0.0, 1.0
    # Simulate in units of t_F, rounded so that similar layouts share one simulation. Long
    # steps are simulated up to SIMULATED_ACTIONS (at least 2p micro-batches past the
    # warm-up, a multiple of p): from there the makespan repeats its increments every p
    # micro-batches (2p interleaved), hop waits included, so it is extrapolated from two
    # simulations a period apart, the later at the same phase as ``microbatches``.
    backward, comm = round(t_b / t_f, 1), float(f"{hop / t_f:.1g}")
    fit = SIMULATED_ACTIONS // (pp * virtual) // pp * pp
    period = 2 * pp if schedule == "interleaved_1f1b" else pp
    m1 = min(microbatches, max(2 * pp + period, fit))
    if microbatches > m1:
        phase = (microbatches - m1) % period
        # interleaved runs whole rounds of p micro-batches: keep m1 one it can build
        m1 += phase - phase % pp if schedule == "interleaved_1f1b" else phase
    makespan, inflight = _simulate(schedule, pp, m1, virtual, backward, comm)
    if microbatches > m1:
        before = _simulate(schedule, pp, m1 - period, virtual, backward, comm)[0]
        makespan += (microbatches - m1) * (makespan - before) / period
    makespan *= (1 + t_b / t_f) / (1 + backward)  # undo the rounding: keep layouts ordered
    if schedule in BREADTH_FIRST:  # all micro-batches in flight
        inflight *= microbatches / m1
    bubble = 1 - microbatches * (1 + t_b / t_f) / makespan  # the busy time, unrounded
    return makespan * t_f, bubble, inflight


@lru_cache(maxsize=4096)
def _simulate(schedule: str, pp: int, microbatches: int, virtual: int, backward: float,
              comm: float) -> tuple[float, float]:
    """(makespan in units of t_F, peak micro-batch chunks in flight on the first rank)."""
    from meshlab.schedules import Costs, build, stages_per_rank

    virtual = stages_per_rank(schedule, virtual)
    timeline = build(schedule, ranks=pp, microbatches=microbatches,
                     virtual=virtual).simulate(Costs(forward=1.0, backward=backward,
                                                     comm=comm))
    return timeline.makespan, float(timeline.peak_inflight(0))
