"""Which plans a mesh can run: every refusal of a pair of options, before any rank builds.

``check(plan, sizes)`` raises ValueError naming both options of the pair (``grad_accum=2 with
pp=2``) and the fix, for every combination meshlab cannot show equal to one process; it reads
only the plan and the mesh's degrees (``sizes(name)``: ``partial(axis_size, mesh)`` on a rank,
``MeshSpec.size_of`` anywhere), so the model matrix asks it which pairs exist at all, and
parallelize asks it first on every rank alike. What depends on the model (a pipeline split of
a layout meshlab cannot split, experts in a dense model) is checked by the verbs themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshlab.parallel import precision

if TYPE_CHECKING:
    from meshlab.parallel.compose import ParallelPlan

Sizes = Callable[[str], int]
"""A mesh's degree by axis or view name (1 where it has none): pp, dp, dp_shard, cp, ..."""


def data_parallel_ranks(sizes: Sizes, plan: ParallelPlan) -> int:
    """Ranks the data-parallel wrapper reduces gradients over: dp and cp, or with local SGD
    or DiLoCo only those inside a replica."""
    within = "dp_shard_cp" if sizes("cp") > 1 else "dp_shard"
    return sizes(within if plan.replica_sync != "every_step" else "dp_cp")


def _weights_apart(plan: ParallelPlan, pp: int) -> bool:
    """Whether the plan's schedule runs a backward in two passes, the weights' apart (a W)."""
    return any(a is not None and a.kind == "W"
               for row in plan.schedule(pp).actions.values() for a in row)


def check(plan: ParallelPlan, sizes: Sizes) -> None:
    """Raise ValueError for a combination of ``plan``'s options and the mesh's axes that
    meshlab does not run, naming the pair and the fix."""
    tp, dp, pp = sizes("tp"), sizes("dp"), sizes("pp")
    cp, ep = sizes("cp"), sizes("ep")
    dp_kind = plan.data_parallel
    # DDP reduces over the cp ranks too: a mesh without dp still wraps the model with cp
    ddp = dp_kind in ("ddp", "zero1") and data_parallel_ranks(sizes, plan) > 1
    if tp > 1 and ddp:
        raise ValueError(f"data_parallel={dp_kind!r} with tp={tp}: DDP does not take tensor-"
                         "parallel (DTensor) parameters; use data_parallel='zero2' or 'zero3' "
                         "(FSDP2)")
    if pp > 1 and ddp:
        raise ValueError(f"data_parallel={dp_kind!r} with pp={pp}: DDP's per-micro-batch "
                         "gradient all-reduce deadlocks against the pipeline's sends; use "
                         "data_parallel='zero2' or 'zero3' (FSDP2), as torchtitan does")
    if plan.replica_sync != "every_step" and sizes("dp_replicate") < 2:
        raise ValueError(f"replica_sync={plan.replica_sync!r} synchronises the replicas of a "
                         "dp_replicate axis, and this mesh has none: build one, e.g. "
                         "%mesh init dp_replicate=2 dp=2")
    for axis, n in (("pp", pp), ("ep", ep)):
        if plan.replica_sync != "every_step" and n > 1:
            raise ValueError(f"replica_sync={plan.replica_sync!r} with {axis}={n} is not "
                             "verified yet: build the mesh without it (dp_replicate x dp_shard "
                             "x tp x cp)")
    if pp > 1 and plan.grad_accum > 1:
        raise ValueError(f"grad_accum={plan.grad_accum} with pp={pp}: the pipeline already "
                         "accumulates over its micro-batches; raise microbatches instead "
                         f"(microbatches={plan.microbatches * plan.grad_accum}, grad_accum=1)")
    # local SGD and DiLoCo sync the replicas themselves; the ranks inside one must not drift
    summed = sizes("dp" if plan.replica_sync == "every_step" else "dp_shard")
    if summed > 1 and ep == 1 and dp_kind == "none":
        raise ValueError(f"data_parallel='none' with dp={dp}: each dp rank trains on its own "
                         "rows and nothing sums their gradients, so the replicas drift apart: "
                         "use data_parallel='ddp', 'zero2' or 'zero3', or build the mesh "
                         "without dp")
    if cp > 1 and ep == 1 and dp_kind == "none":
        raise ValueError(f"data_parallel='none' with cp={cp}: each cp rank computes gradients "
                         "from its slice of the sequence, and they must be summed: use "
                         "data_parallel='ddp', 'zero2' or 'zero3'")
    if ep > 1 and dp_kind != "none":
        raise ValueError(f"data_parallel={dp_kind!r} with ep={ep}: expert parallelism averages "
                         "gradients over the data ranks itself: use data_parallel='none'")
    if plan.offload_params and data_parallel_ranks(sizes, plan) < 2:
        raise ValueError("offload_params=True offloads FSDP2's shards, and this mesh has no "
                         "data-parallel ranks to shard over: give it dp_shard >= 2, e.g. "
                         "%mesh init dp=2 tp=2")
    if plan.reduce_every_microbatch and pp == 1:
        raise ValueError("reduce_every_microbatch=True without a pp axis: it sets how a "
                         "pipeline stage reduces; FSDP2 without one reduces every backward "
                         "already (grad_accum reduces once): leave it out, or add a pp axis")
    if pp > 1 and plan.reduce_every_microbatch and _weights_apart(plan, pp):
        raise ValueError(f"reduce_every_microbatch=True with {plan.schedule(pp).name}, whose "
                         "backwards are split in halves (I, W): FSDP2 would reduce before the "
                         "weights have gradients; use a schedule of whole backwards (1f1b, "
                         "interleaved_1f1b, gpipe, looped_bfs) or reduce_every_microbatch=False")
    if pp > 1 and plan.activation_checkpoint == "selective":
        schedule = plan.schedule(pp)
        if _weights_apart(plan, pp):
            raise ValueError(f"activation_checkpoint='selective' with pipeline_schedule="
                             f"{schedule.name!r}: that schedule runs each micro-batch's "
                             "backward in two passes (input, then weights), and torch's "
                             "selective checkpointing allows one backward per region: use "
                             "activation_checkpoint='full', or a schedule without a W pass "
                             "(1f1b, interleaved_1f1b, gpipe)")
    if pp > 1 and plan.offload_activations and plan.activation_checkpoint != "none":
        raise ValueError(f"offload_activations=True with activation_checkpoint="
                         f"{plan.activation_checkpoint!r} on a pipeline (pp={pp}) is not "
                         "verified equal to one process (GPT-2 trained 1.7e-1 of its LayerNorm "
                         "biases away from it in 3 steps; either alone matches): drop one of "
                         "them (a checkpointed block saves little for offloading to move)")
    axes = {a: sizes(a) for a in ("tp", "cp", "ep")}
    precision.check_fp16(plan, axes)
    if plan.qat is not None:
        precision.check_qat_axes(plan, axes)
