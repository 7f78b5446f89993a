"""Communication per axis: every collective each axis issues in a step, its bytes, the link
it runs on (inside a node or across nodes, from the mesh's axis order and the GPUs per node)
and its alpha-beta time. TP, CP and EP collectives sit on the critical path; FSDP/ZeRO and
data-parallel ones overlap with compute up to the compute they can hide behind; pipeline
sends overlap with other micro-batches. Local SGD and DiLoCo replicas synchronise once every
H steps (a step pays 1/H of it); offloading copies over PCIe beside the compute."""

from __future__ import annotations

from dataclasses import dataclass

from meshlab.plan.compute import attention_backward, attention_seconds, layer_parts
from meshlab.plan.context_formulas import context_parallel_collectives
from meshlab.plan.formulas import collective_seconds
from meshlab.plan.memory import DDP_BUCKET_BYTES, cp_memory, layer_bytes, sharded_params
from meshlab.plan.stage import Stage


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
    calls: float
    """Calls per step on one GPU (1/H for a synchronisation every H steps)."""
    inter_node: bool
    seconds: float
    """All calls of the step together."""
    overlapped: bool
    """Can run behind compute (else it is on the critical path)."""
    algorithm: str = "ring"
    """How it is costed: ring, or for an all-reduce below a crossover the hardware profile
    measured, that algorithm (``meshlab.measure.allreduce``)."""


class Communication:
    """The collectives of one step on one GPU of ``stage``, recorded as each is timed."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.collectives: list[Collective] = []

    def add(self, axis: str, what: str, collective: str, ranks: int, stride: int,
            nbytes: float, calls: float, *, overlapped: bool) -> float:
        """Record ``calls`` calls among ``ranks`` ranks ``stride`` apart; their seconds."""
        if (ranks <= 1 and collective != "send_recv") or calls == 0:
            return 0.0
        hw = self.stage.hardware
        # ranks are numbered node by node; a group of `ranks` ranks `stride` apart spans
        # ranks x stride consecutive ranks
        inter = ranks > 1 and ranks * stride > hw.gpus_per_node
        link = hw.link(collective, inter_node=inter)
        # below a measured crossover an all-reduce runs another algorithm than ring; the
        # group's ranks on one node: all of them, or a node's worth `stride` apart
        per_node = max(1, min(ranks, hw.gpus_per_node // stride)) if inter else ranks
        chosen = hw.allreduce_choice(ranks, per_node, nbytes) if collective == "all_reduce" \
            else None
        algorithm, one = chosen or ("ring", collective_seconds(
            collective, ranks, nbytes, latency_s=link.latency_us * 1e-6,
            bandwidth_bytes_s=link.bandwidth_gbs * 1e9))
        self.collectives.append(Collective(axis, what, collective, ranks, nbytes, calls,
                                           inter, one * calls, overlapped, algorithm))
        return one * calls

    def critical_path(self) -> tuple[float, float]:
        """Forward and backward seconds of one micro-batch's TP, CP and EP collectives."""
        s = self.stage
        lay, m, dt = s.layout, s.model, s.dtypes
        act = float(s.tokens * m.hidden * dt.activations)  # one activation tensor
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
            if lay.sequence_parallel and lay.sp_regather:  # for the weights' gradients
                calls.append(("tp", "TP all_gather of activations again (kept as shards)",
                              "all_gather", lay.tp, 1, act, 2, True))
        if lay.ep > 1:
            # dispatch and combine: each token's hidden state to top_k experts and back
            routed = s.tokens * m.top_k * m.hidden * dt.activations / lay.tp
            calls += [("ep", "EP all-to-all dispatch and combine", "all_to_all", lay.ep,
                       lay.tp, routed, 2, False),
                      ("ep", "EP all-to-all of their gradients", "all_to_all", lay.ep, lay.tp,
                       routed, 2, True)]
        f = b = 0.0
        tp_f = tp_b = 0.0  # async TP: hidden behind the GEMMs below
        n = s.layers * lay.microbatches
        for axis, what, kind, ranks, stride, nbytes, per_layer, backward in calls:
            # torch's micro-pipeline TP fuses a reduce-scatter only with the one matmul that
            # feeds it: the backward's, of a sum of matmuls' input gradients, stays exposed
            behind = axis == "tp" and lay.async_tp and not (
                backward and kind == "reduce_scatter" and lay.async_tp_impl == "torch")
            seconds = self.add(axis, what, kind, ranks, stride, nbytes, per_layer * n,
                               overlapped=behind) / lay.microbatches
            again = 0.0
            if not backward and lay.recompute == "full":  # the recomputed forward: again
                again = self.add(axis, what + " (recomputed forward)", kind, ranks, stride,
                                 nbytes, per_layer * n, overlapped=behind) / lay.microbatches
            if behind:
                tp_f, tp_b = (tp_f, tp_b + seconds + again) if backward else (
                    tp_f + seconds, tp_b + again)
            elif backward:
                b += seconds
            else:
                f, b = f + seconds, b + again
        if tp_f or tp_b:
            gemm_f, gemm_b = layer_parts(s)["gemm"]
            f += s.not_hidden(tp_f, gemm_f * s.layers)
            b += s.not_hidden(tp_b, gemm_b * s.layers)
        cp_f, cp_b = self.context_parallel()
        return f + cp_f, b + cp_b

    def context_parallel(self) -> tuple[float, float]:
        """Forward and backward seconds one micro-batch's CP collectives keep on the critical
        path (context_formulas.context_parallel_collectives): the all-gathers, all-reduces and
        all-to-alls whole, ring hops what the attention they run behind leaves exposed."""
        s = self.stage
        lay, m = s.layout, s.model
        if lay.cp == 1:
            return 0.0, 0.0
        impl, n = lay.context_parallel, s.layers * lay.microbatches
        found = context_parallel_collectives(
            impl, batch=lay.micro_batch, seq_len=m.seq_len, heads=m.heads // lay.tp,
            kv_heads=m.n_kv_heads // lay.tp, head_dim=m.head_width, cp=lay.cp,
            dtype_bytes=s.dtypes.activations, chunks=lay.cp_chunks)
        # (forward, backward): (critical, overlappable) seconds of a micro-batch
        sums = {False: [0.0, 0.0], True: [0.0, 0.0]}
        repeats = [(False, "")] + ([(True, " (recomputed forward)")]
                                   if lay.recompute == "full" else [])
        for c in found:
            for again, tail in repeats if not c.backward else [(False, "")]:
                seconds = self.add("cp", f"CP {impl}: {c.name}{tail}", c.collective, lay.cp,
                                   lay.stride("cp"), c.buffer, c.calls * n,
                                   overlapped=c.overlappable) / lay.microbatches
                sums[c.backward or again][c.overlappable] += seconds
        attention = attention_seconds(s) * s.layers  # forward's
        f = sums[False][0] + s.not_hidden(sums[False][1], attention)
        b = sums[True][0] + s.not_hidden(sums[True][1], attention_backward(lay) * attention)
        return f, b

    def fsdp_per_microbatch(self) -> tuple[float, float]:
        """FSDP (ZeRO-2/3) gathers and reduce-scatters of one micro-batch: (fwd, bwd)."""
        s = self.stage
        lay, dt = s.layout, s.dtypes
        if lay.zero < 2 or lay.shard_group == 1:
            return 0.0, 0.0
        dense, expert = s.params
        group, stride, mb = lay.shard_group, lay.tp, lay.microbatches
        axis = "dp_shard+cp" if lay.cp > 1 else "dp_shard"
        # (parameters, ranks they are sharded over): experts only over the data ranks
        # outside their ep group (torchtitan's dp_shard_mod_ep)
        parts = [(dense, group), (expert, group // lay.ep)]
        # one unit per layer (FSDP2) or per weight matrix (DeepSpeed ZeRO-3: 4 or 5 a layer)
        units = s.layers * (1 if lay.shard_unit == "layer" else 5 if s.model.gated_ffn else 4)
        kept = s.fsdp_units_kept  # under a pipeline: once a step (Stage.fsdp_units_kept)
        fwd = bwd = 0.0
        for params, ranks in parts:
            if not params or ranks == 1:
                continue
            gather, calls = params * dt.params / units, units * (1 if kept else mb)
            # ZeRO-2 keeps the gathered parameters for the whole step (its memory counts
            # them unsharded): one gather per step; ZeRO-3 gathers for every micro-batch
            fwd += self.add(axis, "FSDP all-gather of parameters (forward)", "all_gather",
                            ranks, stride, gather, calls if lay.zero == 3 else units,
                            overlapped=True)
            if lay.zero == 3 and not kept:
                bwd += self.add(axis, "FSDP all-gather of parameters (backward)",
                                "all_gather", ranks, stride, gather, calls, overlapped=True)
            reduced = units * (1 if s.fsdp_reduces_once else mb)  # kept units too
            bwd += self.add(axis, "FSDP reduce-scatter of gradients", "reduce_scatter",
                            ranks, stride, params * s.reduce_bytes / units, reduced,
                            overlapped=True)
        return fwd / mb, bwd / mb

    def fsdp_edges(self) -> float:
        """The FSDP traffic nothing can hide: the step's first unit gathered before any
        compute can start, its last unit's gradients reduced after the last backward."""
        s = self.stage
        lay, dt = s.layout, s.dtypes
        if lay.zero < 2 or lay.shard_group == 1:
            return 0.0
        hw, ranks, unit = s.hardware, lay.shard_group, s.shard_unit_params
        inter = lay.shard_group * lay.tp > hw.gpus_per_node
        out = 0.0
        for kind, nbytes in (("all_gather", unit * dt.params), ("reduce_scatter",
                                                                 unit * s.reduce_bytes)):
            link = hw.link(kind, inter_node=inter)
            out += collective_seconds(kind, ranks, nbytes, latency_s=link.latency_us * 1e-6,
                                      bandwidth_bytes_s=link.bandwidth_gbs * 1e9)
        return out

    def pipeline_hop(self) -> float:
        """One micro-batch's activations (or their gradients) to the next stage."""
        s = self.stage
        lay = s.layout
        if lay.pp == 1:
            return 0.0
        act = float(s.tokens * s.model.hidden * s.dtypes.activations)
        if lay.tp > 1 and lay.sequence_parallel:
            act /= lay.tp  # each tp rank sends its sequence shard
        calls = 2 * lay.microbatches * lay.stages_per_rank
        # ranks = the whole pipeline: once its stages span two nodes, some hop crosses them
        total = self.add("pp", "PP send/recv of activations and gradients", "send_recv",
                         lay.pp, lay.stride("pp"), act, calls, overlapped=True)
        return total / calls

    def gradient_sync(self, *, last_backward_s: float, forward_s: float = 0.0,
                      step_compute_s: float = 0.0) -> float:
        """Seconds of once-per-step gradient (and ZeRO-1 parameter) sync left exposed;
        ``forward_s`` (a micro-batch's) and ``step_compute_s`` are what EDiT's and the
        parameter servers' traffic can hide behind."""
        s = self.stage
        lay, dt = s.layout, s.dtypes
        dense, expert = s.params
        params = dense + expert
        exposed = 0.0
        alone = lay.replica_sync != "every_step"  # replicas reduce nothing between syncs
        # every rank holding a copy of these weights (inside its replica, with local SGD)
        dp_all = (lay.dp_shard if alone else lay.dp) * lay.cp
        if lay.zero <= 1 and dp_all > 1:
            axis = ("dp_shard" if alone else "dp") + ("+cp" if lay.cp > 1 else "")
            # an expert's gradient already holds its ep group's tokens: it is summed over
            # its replicas in the other ep groups only (torchtitan's dp_shard_mod_ep)
            summed = dense if lay.ep > 1 else params
            ar = self.add(axis, "gradient all-reduce", "all_reduce", dp_all, lay.tp,
                          summed * s.reduce_bytes, 1, overlapped=True)
            if lay.ep > 1 and dp_all > lay.ep:
                replicas = ("dp_replicate+" if lay.dp_replicate > 1 else "") + "dp_shard_mod_ep"
                ar += self.add(replicas, "gradient all-reduce of the experts", "all_reduce",
                               dp_all // lay.ep, lay.tp * lay.ep, expert * s.reduce_bytes, 1,
                               overlapped=True)
            # overlaps the last micro-batch's backward, bucket by bucket; the last bucket
            # always waits (without overlap: all of it waits)
            bucket = ar * min(1.0, DDP_BUCKET_BYTES / max(1.0, params * s.reduce_bytes))
            exposed += (max(s.not_hidden(ar, last_backward_s), bucket)
                        if lay.overlap_grad_reduce else ar)
            if lay.zero == 1 and lay.shard_group > 1:
                # as torch's ZeroRedundancyOptimizer (meshlab's zero1): all-reduce, then each
                # rank's updated shard to the others; the ZeRO paper's reduce-scatter +
                # all-gather would move the all-reduce's bytes only
                shard_axis = "dp_shard+cp" if lay.cp > 1 else "dp_shard"
                exposed += self.add(shard_axis, "ZeRO-1 all-gather of updated parameters",
                                    "all_gather", lay.shard_group, lay.tp,
                                    params * dt.params, 1, overlapped=False)
        elif lay.dp_replicate > 1 and not alone:  # HSDP: the shards' gradients across replicas
            shard = params * s.reduce_bytes / lay.shard_group
            ar = self.add("dp_replicate", "HSDP all-reduce of gradient shards", "all_reduce",
                          lay.dp_replicate, lay.stride("dp_replicate"), shard, 1,
                          overlapped=True)
            exposed += s.not_hidden(ar, last_backward_s) if lay.overlap_grad_reduce else ar
        if alone:
            exposed += self.replica_sync(forward_s=forward_s, step_compute_s=step_compute_s)
        return exposed

    def replica_sync(self, *, forward_s: float = 0.0, step_compute_s: float = 0.0) -> float:
        """The replicas' synchronisation of this rank's fp32 parameter shard, its exposed
        share per step: local SGD's average or DiLoCo's pseudo-gradient all-reduce every H
        steps, between steps; EDiT's and A-EDiT's the same bytes, block by block behind the
        next forward (Cheng et al. 2024, EDiT); parameter servers' push of gradient
        pieces and pull of parameter pieces every step, each (R-1)/R of the shard (the
        ring all-reduce's bytes), behind the next step's compute when staleness >= 1."""
        s = self.stage
        lay = s.layout
        shard = sum(s.params) * 4 / (lay.shard_group if lay.zero >= 2 else 1)
        replicas, stride = lay.dp_replicate, lay.stride("dp_replicate")
        if lay.replica_sync == "parameter_server":
            hidden = lay.staleness >= 1
            moved = sum(self.add("dp_replicate", f"parameter servers: {what}", "all_to_all",
                                 replicas, stride, shard, 1, overlapped=hidden)
                        for what in ("gradient pieces pushed", "parameter pieces pulled"))
            return s.not_hidden(moved, step_compute_s) if hidden else moved
        names = {"diloco": "DiLoCo all-reduce of pseudo-gradients",
                 "edit": "EDiT all-reduce of pseudo-gradients, block by block in the forward",
                 "a_edit": "A-EDiT all-reduce of pseudo-gradients, block by block in the "
                           "forward"}
        what = names.get(lay.replica_sync, "local SGD all-reduce of parameters")
        overlapped = lay.replica_sync in ("edit", "a_edit")
        seconds = self.add("dp_replicate", what + f" (every {lay.sync_every} steps)",
                           "all_reduce", replicas, stride, shard, 1 / lay.sync_every,
                           overlapped=overlapped)
        if not overlapped:
            return seconds
        # the first block's share waits; each later one runs behind the block before it
        first = seconds / max(1, s.layers)
        return max(first, s.not_hidden(seconds, forward_s / lay.sync_every))

    def host_copies(self) -> float:
        """Seconds of one step's copies between device and host memory (offloading), the
        busier direction's: copies each way run at once, on their own engines."""
        s = self.stage
        lay, dt = s.layout, s.dtypes
        to_device = to_host = 0.0
        if not s.hardware.asynchronous:  # CPU ranks: host memory is the device's, no copies
            return 0.0
        if lay.offload_params:
            dense, expert = s.params
            grads = (dense / lay.shard_group + expert / (lay.shard_group // lay.ep)) * dt.grads
            units = len(s.shard_units) * s.layers
            # ZeRO-3 copies a shard up for every gather (forward and backward of each
            # micro-batch); ZeRO-2 once a step. Gradient shards go down after each
            # reduce-scatter.
            gathers = 2 * lay.microbatches if lay.zero == 3 else 1
            to_device += self._copy("offload: parameter shards to the device",
                                    sharded_params(s) / units, units * gathers)
            to_host += self._copy("offload: gradient shards to the host", grads / units,
                                  units * lay.microbatches)
        if lay.cp > 1 and lay.cp_offload:  # chunked's K/V chunks, every layer
            cp = cp_memory(s)
            to_host += self._copy("offload: key/value chunks to the host", cp["to_host"],
                                  s.layers * lay.microbatches)
            to_device += self._copy("offload: key/value chunks back for each query chunk",
                                    cp["to_device"], s.layers * lay.microbatches)
        if lay.offload_activations:
            saved = layer_bytes(s, lay.recompute) * s.layers
            to_host += self._copy("offload: saved activations to the host", saved,
                                  lay.microbatches)
            to_device += self._copy("offload: saved activations back for the backward", saved,
                                    lay.microbatches)
        return max(to_device, to_host)

    def _copy(self, what: str, nbytes: float, calls: float) -> float:
        seconds = nbytes * calls / (self.stage.hardware.pcie_gbs * 1e9)
        self.collectives.append(Collective("host", what, "copy", 1, nbytes, calls, False,
                                           seconds, True))
        return seconds
