"""The buffers row of the reconciliation: what torch holds for its collectives (FSDP2's
gathered units and the gradients it accumulates and reduce-scatters, DDP's buckets) beside
what the planner counts (meshlab.plan.memory), each difference with its bytes."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from meshlab.plan.memory import (
    DDP_BUCKET_BYTES,
    accumulated_params,
    accumulating_share,
    accumulation_transient,
)

if TYPE_CHECKING:
    from meshlab.plan.differences import Differences

DDP_BUCKETS = 2.0 * DDP_BUCKET_BYTES


def _pipeline_transient(known: Differences, reduced: float) -> list[tuple[str, float]]:
    """ZeRO-2 under a pipeline, where the planner counts the accumulated gradients
    (memory.pipeline_gradients) for an end stage: what this rank's stage holds instead."""
    out = []
    root = known.model.vocab * known.model.hidden / known.layout.tp
    peak = partial(accumulation_transient, unit=known.stage.shard_unit_params,
                   grads=known.dt.grads, reduced=reduced, mixed=known.mixed)
    planned = peak(root=root, embedding=root)
    mine = peak(root=known.root, embedding=root * known.first)
    if abs(mine - planned) > 0.5:
        out.append(("the peak's transient, of a unit's 16-bit gradients before they are "
                    "added in, the root unit's flat copy reduce-scattered first while the "
                    "others are held, the embedding's 16-bit gradient: this stage's "
                    "largest, the planner's an end stage's", mine - planned))
    return out


def _accumulating(known: Differences, share: float) -> float:
    """Parameters of ``known``'s stages accumulating gradients at its peak: all of them, or
    (``share`` < 1: the schedule runs a stage's backwards before the next one's) as many as
    accumulate at once, the one holding the embedding or the output first, then the largest
    (an uneven split gives some stages a layer fewer)."""
    stages, layers = known.dry.stages, known.model.layers
    sizes = {s: (s + 1) * layers // stages - s * layers // stages for s in known.run.stages}
    at_once = round(share * len(sizes))
    if at_once >= len(sizes):
        return known.params
    order = sorted(sizes, key=lambda s: (s not in (0, stages - 1), -sizes[s]))
    per_layer = (known.params - known.root) / sum(sizes.values())
    return per_layer * sum(sizes[s] for s in order[:at_once]) + known.root


def buffer_terms(known: Differences, planner: float) -> list[tuple[str, float]]:
    """The buffers row's differences for ``known``'s rank: FSDP2's padded, flat and
    accumulated gradients, the pipeline's, DDP's buckets and the model's own buffers."""
    lay, dt = known.layout, known.dt
    out: list[tuple[str, float]] = []
    # a block; meshlab's MoE holds its experts whole on every tp rank
    unit = known.stage.shard_unit_params + known.whole_experts / max(known.layers, 1)
    if known.fsdp and lay.zero == 3 and known.stage.fsdp_units_kept:
        padded = known.params * dt.params * (known.pad_stage - 1)
        what = f"the stage's gathered parameters are {known.pad_stage:.3g}x its weights"
    elif known.fsdp and lay.zero == 3:
        padded = 2 * unit * dt.params * (known.pad_layer - 1)
        what = (f"a block gathered (and the next, prefetched) is {known.pad_layer:.3g}x "
                "its weights")
    else:  # FSDP2 holds a reduce-scatter's input until it issues the next one
        padded = planner * (known.pad_layer - 1) if known.fsdp else 0.0
        what = "the last block's reduce-scatter input, held until the next, too"
    if padded > 0.5:
        out.append((f"FSDP2 gathers and reduce-scatters padded shards: {what}", padded))
    unit *= known.pad_layer  # the flat copy a unit's gradients are reduce-scattered from
    root = known.root
    layer_units = lay.shard_unit == "layer"
    reduced = 4.0 if known.mixed else dt.grads  # meshlab reduces in fp32 (reduce_dtype)
    # gradients unsharded all step (a pipeline that reduces every micro-batch: a unit's)
    kept = known.fsdp and lay.reduce_once and ((lay.zero == 3 and known.stage.fsdp_units_kept)
                                               or (lay.zero == 2 and lay.pp > 1))
    counts = kept and lay.pipeline_grads_unsharded  # the planner counts what follows
    if counts and lay.zero == 2:  # each's stages, those accumulating at once
        planned = accumulated_params(known.stage)
        mine = _accumulating(known, accumulating_share(lay, known.run.coordinates.get("pp", 0)))
        if abs(mine - planned) > 0.5:
            out.append(("this rank's stages accumulate their own parameters' gradients, "
                        "the planner's busiest stage more", (mine - planned) * reduced))
    if (accumulated := kept and known.mixed) and not counts:
        held = known.params + known.whole_experts
        if lay.zero == 3:  # the planner counts the gradients, 16-bit
            beside = (unit - held) * dt.grads
            what = "a unit's bf16 ones beside until they are added in"
        else:
            beside = accumulation_transient(
                unit=unit, root=known.root, embedding=known.model.vocab / lay.tp
                * known.model.hidden * known.first, grads=dt.grads, reduced=4.0,
                mixed=True) - unit * dt.grads
            what = ("a unit's bf16 ones beside until they are added in, or the flat copy "
                    "of the first units it reduce-scatters (the root unit's, then a "
                    "block's) while the others are held")
        out.append(("FSDP2 accumulates the stage's unsharded gradients in fp32 (its "
                    f"reduce dtype) across the micro-batches, {what}",
                    held * 4 + beside))
    if counts and not (lay.zero == 3 and lay.tp > 1 and not known.first):
        out += _pipeline_transient(known, reduced)
    if known.fsdp and lay.zero == 3 and not known.stage.fsdp_units_kept and layer_units:
        out.append(("FSDP2 holds the flat copy of a unit's gradients it reduce-scatters",
                    unit * reduced))
        out.append(("and its root unit (embedding, output) gathered from the forward to "
                    "the backward", root * dt.params))
    elif known.fsdp and lay.zero == 3 and layer_units and not kept:  # reducing each mb
        out.append(("FSDP2 holds the flat copy of a unit's gradients it reduce-scatters",
                    unit * reduced))
    elif known.fsdp and lay.zero == 2 and layer_units and kept and not known.mixed:
        if not counts:  # else _pipeline_transient's
            out.append(("torch's pipeline keeps the stage's gradients unsharded until the "
                        "last micro-batch, then copies the root unit's out first to "
                        "reduce-scatter them", (known.params + root - unit) * dt.grads))
    elif known.fsdp and lay.zero == 2 and layer_units and not accumulated:
        out.append(("FSDP2 holds the flat copy of a unit's gradients it reduce-scatters",
                    unit * reduced))
    elif known.ddp:
        out.append(("torch DDP's buckets are a copy of the gradients "
                    "(gradient_as_bucket_view=False), not two 25 MiB buckets in flight",
                    known.params * (4 if known.mixed else dt.grads) - DDP_BUCKETS))
    elif lay.ep > 1 and lay.zero <= 1:
        out.append(("meshlab's expert parallel all-reduces each gradient in its own hook: "
                    "no buckets", -DDP_BUCKETS))
    held = known.run.raw.get("Buffer", 0)
    if held:
        out.append(("the model's own buffers (RoPE table, routing counts)", float(held)))
    return out
