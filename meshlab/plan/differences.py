"""What torch (and meshlab) do that the planner counts otherwise, each with its bytes: the
known differences meshlab.plan.reconcile applies to the planner's figures before holding
them to a dry run's. Each is a fact of an implementation (FSDP2's root unit, torch DDP's
bucket copy, ZeroRedundancyOptimizer's whole-parameter partition, meshlab's TP gathering
the logits, ...), computed from the model's shape and the layout; none is fitted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshlab.mesh import AXES
from meshlab.plan import axis_differences as axis_terms
from meshlab.plan import fsdp_padding as padding
from meshlab.plan.activation_differences import activation_terms
from meshlab.plan.buffer_differences import buffer_terms
from meshlab.plan.context_formulas import HEAD_SPLIT_CP
from meshlab.plan.estimate import Estimate
from meshlab.plan.layout import Layout
from meshlab.plan.memory import factored_state_bytes, optimizer_k
from meshlab.plan.stage import Stage

if TYPE_CHECKING:
    from meshlab.dry_run.report import DryRun, RankRun


NOT_COMPARED = ("run with kernels='eager', the model's own ops keep more than Korthikanti's "
                "count of fused kernels (norms' fp32 copies, GQA's repeated keys and values, "
                "SwiGLU's separate activation): compared with kernels='fused' (the default)")


class Differences:
    """What torch does, as the dry run ran it, that the planner counts otherwise, with the
    bytes each accounts for, for one rank of one dry run. Each is a fact of torch's (or
    meshlab's) implementation; none is fitted."""

    def __init__(self, dry: DryRun, est: Estimate, run: RankRun) -> None:
        self.dry, self.est, self.run = dry, est, run
        lay, m = est.layout, est.model
        self.layout, self.model, self.dt = lay, m, lay.dtypes
        self.stage = Stage(m, lay, est.hardware)
        self.first, self.last = 0 in run.stages, dry.stages - 1 in run.stages
        held = [i for s in run.stages
                for i in range(s * m.layers // dry.stages, (s + 1) * m.layers // dry.stages)]
        self.layers = len(held)
        # an MoE model's first layers with a plain feed-forward (DeepSeek's) on this rank
        self.dense_layers = sum(i < m.dense_layers for i in held) if m.experts else 0
        self.tokens = lay.micro_batch * (m.seq_len // lay.cp)
        self.act = float(self.tokens * m.hidden * self.dt.activations)
        root = m.vocab * m.hidden * self.first + m.hidden * self.last
        if self.last and not (m.tied_embeddings and self.first):
            root += m.vocab * m.hidden
        self.root = root / lay.tp
        experts = m.experts * m.expert_params
        moe_layers = self.layers - self.dense_layers
        expert = experts * moe_layers / lay.tp / lay.ep if m.experts else 0
        self.experts = float(expert)  # this rank's routed experts' elements
        # meshlab's own MoE is not split by tp: each tp rank holds its ep share whole
        self.whole_experts = expert * (lay.tp - 1) if dry.family == "meshlab" else 0.0
        dense_layer = m.layer_params - (experts if m.experts else 0)  # beside its experts
        self.params = ((self.layers * dense_layer
                        + self.dense_layers * (experts - m.dense_layer_saving)) / lay.tp
                       + self.root + expert)
        # a TP plan that leaves the attention whole (transformers' DeepSeek-V3): the query
        # heads this tp rank runs, and the weights it holds beyond its split
        unsplit = "attention" in dry.tp_whole
        self.heads = m.heads / (1 if unsplit else lay.tp)
        self.whole_attention = (m.attention_params * self.layers * (1 - 1 / lay.tp)
                                if unsplit else 0.0)
        self.fsdp = lay.zero >= 2 and lay.shard_group > 1 and lay.ep == 1
        self.ddp = lay.zero <= 1 and lay.dp * lay.cp > 1 and lay.ep == 1
        self.mixed = lay.precision != "fp32"  # meshlab: fp32 weights, gradients reduced in fp32
        # what reducing in fp32 adds to the planner's reductions (none where it counts them)
        self.widen = 4 / self.stage.reduce_bytes - 1 if self.mixed else 0.0
        # FSDP2's padding (meshlab.plan.fsdp_padding): this rank's shards over the even split;
        # a gathered unit (a block), the root unit and the whole stage over their weights
        self.pad_shard = self.pad_layer = self.pad_root = self.pad_stage = 1.0
        if self.fsdp:
            n, layer = lay.shard_group, padding.layer_tensors(m, lay.tp)
            ends = padding.root_tensors(m, lay.tp, first=self.first, last=self.last)
            whole = padding.elements(layer) * self.layers + padding.elements(ends)
            self.pad_shard = (padding.sharded(layer, n) * self.layers
                              + padding.sharded(ends, n)) / (whole / n)
            self.pad_layer = padding.gathered(layer, n) / padding.elements(layer)
            self.pad_root = (padding.gathered(ends, n) / padding.elements(ends) if ends
                             else 1.0)
            self.pad_stage = self.pad_shard  # n padded shards gathered: the stage, padded

    # -- bytes per axis -------------------------------------------------------------------

    def bytes_terms(self, axis: str, planner: float) -> list[tuple[str, float]]:
        lay, m, dt, mb = self.layout, self.model, self.dt, self.layout.microbatches
        out: list[tuple[str, float]] = []
        share = self.params / sum(self.stage.params)
        if axis == axis_name("dp_shard+cp" if lay.cp > 1 else "dp_shard", lay) and self.fsdp:
            if abs(share - 1) > 1e-9:
                out.append(("this rank's stage holds its own share of the parameters, the "
                            "planner's busiest stage more", planner * (share - 1)))
            g = self.params * dt.grads
            if lay.zero == 3 and lay.pp == 1 and lay.shard_unit == "layer":
                out.append(("FSDP2 keeps its root unit (embedding, output) gathered from the "
                            "forward to the backward: gathered once, not twice",
                            -self.root * dt.params * mb))
            if lay.zero == 2 and lay.pp == 1 and mb > 1:
                out.append(("FSDP2 reshards after every backward: ZeRO-2 gathers the "
                            "parameters again in each micro-step's forward",
                            (mb - 1) * self.params * dt.params))
            if self.widen:
                out.append(("gradients reduce-scattered in fp32 (reduce_dtype)",
                            g * self.widen * (1 if self.stage.fsdp_reduces_once else mb)))
            if self.pad_stage > 1 + 1e-9:
                moved = planner + sum(b for _, b in out)
                out.append((f"FSDP2 gathers and reduce-scatters padded shards "
                            f"({self.pad_stage:.4g}x the weights)",
                            moved * (self.padded_traffic() - 1)))
        elif axis == "dp_replicate" and self.fsdp and self.widen:
            out.append(("gradients all-reduced in fp32", planner * self.widen))
        elif axis == axis_name("dp+cp" if lay.cp > 1 else "dp", lay) and self.ddp and self.mixed:
            # the planner's gather is of its 16-bit weights, its all-reduce as it reduces
            gathered = sum(c.nbytes * c.calls for c in self.est.collectives
                           if c.collective == "all_gather" and axis_name(c.axis, lay) == axis)
            if self.widen or dt.params != 4:
                out.append(("autocast keeps fp32 weights and gradients: all-reduced and "
                            "gathered in fp32", (planner - gathered) * self.widen
                            + gathered * (4 / dt.params - 1)))
        elif axis == "tp":
            out += axis_terms.tp_terms(self, planner)
        elif axis == "ep":
            out += axis_terms.ep_terms(self, planner)
        elif lay.ep > 1 and axis not in ("cp", "pp"):
            # the experts' gradients are reduced over the ep groups' replicas, the rest over
            # every data-parallel rank
            experts = "dp_shard_mod_ep" in axis
            dense, routed = self.stage.params
            mine = self.experts if experts else self.params - self.experts
            planned = routed if experts else dense
            if abs(mine - planned) > 0.5:
                out.append(("this rank's stage holds its own share of the parameters, the "
                            "planner's busiest stage more", planner * (mine / planned - 1)))
                planner *= mine / planned
            if self.whole_attention and not experts:
                out.append((f"{self.dry.model}'s TP plan leaves the attention whole: its "
                            "gradients are all-reduced whole",
                            planner * self.whole_attention / mine))
                planner *= 1 + self.whole_attention / mine
            if experts and self.whole_experts:
                out.append(("meshlab's MoE is not split by tp: its experts' gradients are "
                            "all-reduced whole", planner * (lay.tp - 1)))
                planner *= lay.tp
            if self.widen:
                out.append(("autocast keeps fp32 weights and gradients: all-reduced in fp32",
                            planner * self.widen))
            if self.first and self.whole_vocab_gradient and "dp_shard_mod_ep" not in axis:
                out.append(("transformers' tp-split embedding gets its gradient at the whole "
                            "vocabulary, all-reduced so",
                            (m.vocab - m.vocab / lay.tp) * m.hidden
                            * (4.0 if self.mixed else dt.grads)))
        elif axis == "cp" and self.dry.family == "meshlab" \
                and lay.context_parallel not in HEAD_SPLIT_CP:  # these move K/V unrepeated
            out.append(("meshlab's Transformer gathers keys and values after GQA repeats them "
                        f"(x {m.heads // m.n_kv_heads}), and all-reduces their gradients whole",
                        planner * (m.heads / m.n_kv_heads - 1)))
        elif axis == "pp":
            hop = self.act / (lay.tp if lay.tp > 1 and lay.sequence_parallel
                              and self.dry.family == "meshlab" else 1)
            if self.mixed and not self.fsdp:  # autocast: the stream between stages is fp32
                hop *= 4 / dt.activations
            one_way = sum((s != self.dry.stages - 1) + (s != 0) for s in self.run.stages)
            out.append(("the first stage sends no gradients back, the last no activations on; "
                        "the loss is broadcast", hop * mb * one_way + 8 - planner))
        return [(t, b) for t, b in out if abs(b) > 0.5]

    def padded_traffic(self) -> float:
        """What FSDP2's padding makes of its traffic: blocks and the root unit each padded
        their own way, weighted by what moves of each (ZeRO-3 gathers a block twice a
        micro-batch, the root unit it keeps once; elsewhere each once)."""
        lay, dt = self.layout, self.dt
        twice = lay.zero == 3 and not self.stage.fsdp_units_kept
        reduced = 4.0 if self.mixed else dt.grads
        blocks = (self.params - self.root) * ((2 if twice else 1) * dt.params + reduced)
        root = self.root * (dt.params + reduced)
        return (blocks * self.pad_layer + root * self.pad_root) / (blocks + root)

    # -- memory ---------------------------------------------------------------------------

    def memory_terms(self, name: str, planner: float) -> list[tuple[str, float]]:
        lay, dt = self.layout, self.dt
        out: list[tuple[str, float]] = []
        if lay.offload_params and name in ("params", "grads", "optimizer"):
            return out
        share = self.params / sum(self.stage.params)
        # FSDP2 keeping a stage gathered (a pipeline): its buffers go with the parameters
        held = name == "buffers" and self.fsdp and lay.zero == 3 and self.stage.fsdp_units_kept
        if (name in ("params", "grads", "optimizer", "host") or held) and abs(share - 1) > 1e-9:
            out.append(("this rank's stage holds its own share of the parameters, the "
                        "planner's busiest stage more", planner * (share - 1)))
            planner *= share
        if self.whole_experts and (name in ("params", "grads", "optimizer")
                                   or (name == "buffers" and self.fsdp)):
            whole = (self.params + self.whole_experts) / self.params
            out.append(("meshlab's MoE is not split by tp: each tp rank holds its share of the "
                        "experts whole" + (", and FSDP2 gathers and reduce-scatters them whole"
                                           if name == "buffers" else ""),
                        planner * (whole - 1)))
            planner *= whole
        if self.whole_attention and name in ("params", "grads", "optimizer"):
            whole = (self.params + self.whole_attention) / self.params
            out.append((f"{self.dry.model}'s TP plan leaves the attention whole on every tp "
                        "rank", planner * (whole - 1)))
            planner *= whole
        if name in ("params", "grads", "optimizer") and self.pad_shard > 1 + 1e-9:
            extra = planner * (self.pad_shard - 1)
            if name == "params" and lay.zero == 2:  # the gathered copy, and the shard beside
                gathered = self.params * (self.pad_stage - 1) * dt.params
                extra = gathered + self.params / lay.shard_group * (self.pad_shard - 1) * (
                    4.0 if self.mixed else dt.params)
            out.append((f"FSDP2 pads each weight's rows to a multiple of the {lay.shard_group} "
                        f"shards: this rank holds {self.pad_shard:.4g}x an even split",
                        extra))
            planner += extra
        factored = factored_state_bytes(self.stage) * share  # Adafactor's, beside K's
        if name == "optimizer" and lay.zero == 1 and self.ddp and lay.shard_group > 1:
            # meshlab's ZeRO-1 shards over the dp axis (dp_replicate x dp_shard)
            c = self.run.coordinates
            index = c.get("dp_replicate", 0) * lay.dp_shard + c.get("dp_shard", 0)
            mine = zero1_share(self.weights(), lay.dp, index)
            out.append(("torch's ZeroRedundancyOptimizer gives each rank whole parameters, "
                        "largest first to the least loaded (not an even split of elements)",
                        mine * optimizer_k(self.stage) - planner))
            planner, factored = mine * optimizer_k(self.stage), 0.0
        if self.mixed and name == "optimizer" and lay.optimizer != "adamw":
            # the planner's K holds 4 B of fp32 master weights: meshlab's are the parameters
            master = (planner - factored) * 4 / optimizer_k(self.stage)
            out.append((f"meshlab's bf16 keeps fp32 weights: {lay.optimizer} holds no master "
                        "copy beside its own states", -master))
        elif self.mixed and name in ("params", "grads", "optimizer"):
            # meshlab's bf16 keeps fp32 weights and gradients (FSDP2's MixedPrecisionPolicy
            # or autocast) and Adam's two fp32 moments: 4 + 4 + 8 bytes where the planner
            # counts ZeRO's 2 + 2 + 12 (the same 16 bytes when all three are sharded)
            kept = {"params": 4.0, "grads": 4.0, "optimizer": 8.0}[name]
            counted = float({"params": dt.params, "grads": dt.grads,
                             "optimizer": dt.optimizer}[name])
            if name == "params" and lay.zero == 2 and self.fsdp:  # the gathered copy agrees
                out.append(("FSDP2 keeps its fp32 shard beside the gathered copy: the "
                            "planner's master weights, counted in its optimizer",
                            self.params / lay.shard_group * 4))
            else:
                out.append(("meshlab's bf16 keeps fp32 weights and gradients and Adam's two "
                            "moments (4 + 4 + 8 bytes); the planner ZeRO's 2 + 2 + 12",
                            planner * (kept / counted - 1)))
        if name == "grads" and not self.fsdp:
            out += self.plain_grad_terms()
        if name == "buffers":
            out += buffer_terms(self, planner)
        if name == "activations" and self.dry.kernels == "fused":
            out += activation_terms(self, planner)
        return out

    @property
    def whole_vocab_gradient(self) -> bool:
        """transformers' own embedding style (its TP plan without sequence parallelism)
        gives a tp-split embedding a Replicate gradient at the whole vocabulary; meshlab's
        VocabParallelEmbedding (its Transformer's, and under sequence parallelism) its rows."""
        return (self.layout.tp > 1 and self.dry.family == "transformers"
                and not self.layout.sequence_parallel)

    def plain_grad_terms(self) -> list[tuple[str, float]]:
        """Gradients autograd keeps in ``.grad`` itself (no FSDP): what it holds beyond one
        gradient per parameter."""
        lay, m = self.layout, self.model
        size = 4.0 if self.mixed else self.dt.grads  # a gradient is its parameter's dtype
        out: list[tuple[str, float]] = []
        vocab = m.vocab if self.whole_vocab_gradient else m.vocab / lay.tp
        if self.first and self.whole_vocab_gradient:
            out.append(("transformers' tp-split embedding gets its gradient at the whole "
                        "vocabulary", (m.vocab - m.vocab / lay.tp) * m.hidden * size))
        if lay.microbatches > 1:
            # AccumulateGrad adds a micro-batch's gradient in once it exists whole
            ffn = m.ffn * (m.experts // lay.ep * (1 if self.whole_experts else 1 / lay.tp)
                           if m.experts else 1 / lay.tp)
            largest = max([vocab * m.hidden] * self.first + [m.vocab * m.hidden / lay.tp]
                          * self.last
                          + [m.hidden * ffn, m.hidden * m.heads * m.head_width / lay.tp])
            out.append(("each micro-batch's gradient of a weight exists whole before it is "
                        "added in: the largest's beside the accumulated ones",
                        largest * size))
        return out

    def weights(self) -> list[int]:
        """The elements of each parameter tensor this rank's model holds (tp-split)."""
        m, t = self.model, self.layout.tp
        layer = padding.layer_tensors(m, t)
        ends = padding.root_tensors(m, t, first=self.first, last=self.last)
        return [rows * row for rows, row in ends + layer * self.layers]


def zero1_share(sizes: list[int], ranks: int, index: int) -> float:
    """The elements whose optimizer states rank ``index`` of torch's ZeroRedundancyOptimizer
    over ``ranks`` holds: parameters sorted largest first, each to the rank holding the
    fewest elements so far (the lowest such rank on a tie)."""
    loads = [0] * ranks
    for size in sorted(sizes, reverse=True):
        loads[loads.index(min(loads))] += size
    return float(loads[index])


def signed(b: float) -> str:
    sign = "+" if b >= 0 else "-"
    b = abs(b)
    unit = next((u for u, n in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if b >= n),
                "B")
    scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[unit]
    return f"{sign}{b / scale:.3g} {unit}"


def axis_name(axis: str, layout: Layout) -> str:
    """The planner's axis label as the mesh axes it spans, those of size one left out
    (``dp`` -> ``dp_replicate+dp_shard``, or ``dp_shard`` without replicas)."""
    if axis == "ep":
        return axis
    parts: list[str] = []
    for part in axis.split("+"):
        parts += ["dp_replicate", "dp_shard"] if part == "dp" else [part]
    kept = [a for a in AXES if a in parts and getattr(layout, a) > 1]
    kept += [p for p in parts if p not in AXES]  # dp_shard_mod_ep and the like
    return "+".join(kept) or axis
