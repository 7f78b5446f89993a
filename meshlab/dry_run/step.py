"""One representative rank's fake training step, for meshlab.dry_run.run.

The rank joins torch's fake process group at its rank and world size, builds the mesh and
the model (on the meta device), parallelizes it with meshlab's ``parallelize`` outside any
fake mode, materializes it as fake tensors, and runs one step: forward, backward (the
pipeline's schedule where ``parallelize`` split stages) and the optimizer, under torch's
memory tracker and meshlab's CommTracer. The optimizer's states exist before the step, as in
every step after the first; the pipeline's metadata handshake runs before it too. A pipeline
rank runs a probe step of a few micro-batches and composes the schedule's from it, for
itself and for the ranks whose stages run the same programs (meshlab.dry_run.compose).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab import mesh as meshes
from meshlab.dry_run.compose import Composed, Recorder, compose
from meshlab.dry_run.fake_peers import ddp_without_peers, without_peers
from meshlab.dry_run.fake_routing import balanced_routing, values_known
from meshlab.dry_run.fake_world import dtensor_inference_untracked, step_tracker
from meshlab.dry_run.fused_attention import causal_without_mask
from meshlab.dry_run.fused_memory import fused_memory
from meshlab.dry_run.report import RankRun, Traffic
from meshlab.measure.comms import CommRecord, CommTracer
from meshlab.mesh import MeshSpec
from meshlab.plan.layout import Layout

if TYPE_CHECKING:
    from meshlab.parallel import ParallelPlan

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def groups(layout: Layout) -> dict[str, dict[str, str]]:
    """torch's tracker categories -> the planner's, for an FSDP model and any other.

    The planner's buffers are what moves through the collectives (FSDP's gathered units,
    their unsharded gradients, DDP's buckets); module buffers (a RoPE table) count there
    too. ZeRO-2 keeps its gathered parameters for the whole step, which the planner counts
    as parameters. Activations are everything the step allocates besides: what the forward
    saves and the backward's temporaries (the planner counts the saved ones and the logits'
    gradient). With offloading, a CPU rank's host memory is its device: the offloaded
    shards are counted as host, where the planner counts them."""
    offload = "host" if layout.offload_params else None
    fsdp = {"Sharded Param": offload or "params",
            "Unsharded Param": "params" if layout.zero == 2 else "buffers",
            "Sharded Grad": offload or "grads", "Unsharded Grad": "buffers",
            "OptState": offload or "optimizer", "All Gather": "buffers",
            "Reduce Scatter": "buffers", "Buffer": "buffers", "Activation": "activations",
            "Temp": "activations", "Inputs": "activations"}
    plain = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer",
             "Buffer": "buffers", "Other": "buffers", "DDP buckets": "buffers",
             "Activation": "activations", "Temp": "activations"}
    return {"fsdp": fsdp, "plain": plain}


def run_rank(build: Callable[[], nn.Module], spec: MeshSpec, rank: int, role: str,
             plan: ParallelPlan, layout: Layout, *, init: Callable[[nn.Module], None] | None,
             rows: int, seq: int, vocab: int | None,
             hidden: int | None, usable: float | None, stages: list[int],
             compose_to: int | None = None, alike: Sequence[dict[str, Any]] = (),
             kernels: str = "fused") -> list[RankRun]:
    """``rank``'s step of a ``spec.size``-rank world (see the module's docstring); with
    ``compose_to``, a pipeline's probe step (``plan``'s few micro-batches) composed into
    the layout's schedule of that many (meshlab.dry_run.compose), and into each of the
    ``alike`` ranks' (rank, role, stages: stages that run the programs this rank's run, in
    their order) too. This rank's RankRun first, then theirs."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshlab.models import Transformer
    from meshlab.parallel import build_optimizer, parallelize
    from meshlab.parallel.compose import data_parallel_ranks

    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=spec.size)
    quiet = warnings.catch_warnings()
    quiet.__enter__()
    known = contextlib.ExitStack()  # from the first forward on: parallelize probes one
    # FSDP warns on every root forward of a model returning a view of its output (meshlab's
    # Transformer returns its logits): once per rank and micro-batch, nothing to act on here
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    try:
        mesh = meshes.build(spec)
        with torch.device("meta"):
            model = build()
        known.enter_context(values_known())  # after build: what the model imported
        known.enter_context(causal_without_mask())
        vocab = vocab or _vocab(model)
        boundary = _boundary(model, plan, layout, rows, seq, hidden)
        own = isinstance(model, Transformer)
        fsdp = plan.data_parallel in ("zero2", "zero3") and data_parallel_ranks(mesh, plan) > 1
        balanced_routing(model)  # parallelize may probe a forward: experts that run on shapes
        model, mode = _parallelize_fake(model, mesh, plan, partial(parallelize, init=init),
                                        fsdp)
        pipeline = getattr(model, "pipeline", None)
        roots = [s.submod for s in pipeline.stages.values()] if pipeline else [model]
        held = _held(model, roots)
        tracer = CommTracer()
        with mode, without_peers(*boundary):
            balanced_routing(model)  # again: expert parallelism installed its exchange
            buckets = ddp_without_peers(model)
            optimizer = build_optimizer(model, mesh, plan, kind=layout.optimizer)
            _warm(optimizer)
            # a probe step takes its rows from the whole step's batch, which the tracker
            # counts as the whole step's
            batch = rows * compose_to // plan.microbatches if compose_to else rows
            x = torch.randint(0, vocab, (batch, seq // layout.cp))[:rows]
            y = torch.randint(0, vocab, (batch, seq // layout.cp))[:rows]
            if pipeline is not None:
                pipeline.begin(x, y)  # the pipeline's handshake: the first step's, not this
            tracker = step_tracker(roots, optimizer, groups(layout), comms=tracer)
            recorder = None
            with tracker, dtensor_inference_untracked():
                if compose_to is not None and pipeline is not None:
                    recorder = Recorder(tracker, tracer, plan.microbatches)
                    pipeline._perform = recorder.wrap(pipeline._perform)
                with fused_memory() if kernels == "fused" else contextlib.nullcontext():
                    _forward_backward(model, pipeline, plan, x, y, own)
                optimizer.step()
                optimizer.zero_grad()
            if recorder is not None:
                recorder.finish()
    except DataDependentOutputException as e:
        raise ValueError(f"the step reads a tensor's value ({e}), which a dry run does not "
                         "have (fake tensors hold shapes only): a router's choices or a "
                         "count read with .item()/.tolist(); meshlab's MoE routes evenly in a "
                         "dry run, a model of its own must not branch on values") from None
    finally:
        known.__exit__(None, None, None)
        quiet.__exit__(None, None, None)
        dist.destroy_process_group()
        meshes.forget_built()
        _forget_meshes()
    seconds = time.perf_counter() - started

    def result(who: int, what: str, held_stages: list[int], step: Composed | None
               ) -> RankRun:
        raw, peaks, records = ((tracker.snapshot(), dict(tracker.group_peaks), tracer.records)
                               if step is None else (step.peak, step.group_peaks, step.records))
        memory = by_category(raw, peaks, layout, buckets)
        # the collectives are named by this rank's groups: an alike rank's axes are the same
        return RankRun(rank=who, coordinates=spec.coordinates_of(who), role=what,
                       stages=held_stages, params=held, memory=memory, peaks=peaks, raw=raw,
                       collectives=traffic(records, spec, rank),
                       fits=None if usable is None else memory["total"] <= usable,
                       seconds=seconds if who == rank else 0.0)

    if recorder is None or pipeline is None:
        return [result(rank, role, stages, None)]
    per_stage = spec.size // layout.pp
    return [result(rank, role, stages, composed_step(recorder, layout, pipeline.rank,
                                                      compose_to))] + [
        result(other["rank"], other["role"], other["stages"],
               composed_step(recorder, layout, other["rank"] // per_stage, compose_to,
                             dict(zip(other["stages"], stages, strict=True))))
        for other in alike]


def by_category(raw: dict[str, int], peaks: dict[str, int], layout: Layout, buckets: int
                ) -> dict[str, int]:
    """The planner's categories at the step's peak from torch's tracker's (``raw``), DDP's
    buckets (built before the step: the tracker never saw them allocated) added to both."""
    if buckets:
        raw["DDP buckets"] = buckets
        raw["Total"] = raw.get("Total", 0) + buckets
        peaks["buffers"] = peaks.get("buffers", 0) + buckets
    memory = {c: 0 for c in CATEGORIES}
    grouping = groups(layout)["fsdp" if "Sharded Param" in raw else "plain"]
    for name, value in raw.items():
        if name in grouping:
            memory[grouping[name]] = memory.get(grouping[name], 0) + value
    # on a CPU rank the offloaded shards share the device's memory; the device's total is
    # what is left when they go to the host
    memory["total"] = raw.get("Total", 0) - memory.get("host", 0)
    return memory


def composed_step(recorder: Recorder, layout: Layout, pp_rank: int, microbatches: Any,
                  stages: dict[int, int] | None = None) -> Composed:
    """The probe's windows composed into pp rank ``pp_rank``'s actions of the layout's
    schedule with ``microbatches``; ``stages`` maps its stages to the probe's."""
    from meshlab.schedules import build
    from meshlab.schedules.validate import lower

    schedule = build(layout.schedule, ranks=layout.pp, microbatches=microbatches,
                     virtual=layout.virtual)
    actions = lower(schedule)[pp_rank]
    if stages:
        actions = [a._replace(stage=stages[a.stage]) for a in actions]
    return compose(recorder.kinds, recorder.before, recorder.after, actions, microbatches)


def _forget_meshes() -> None:
    """DTensor caches sharding decisions by mesh, and a mesh equals any other of its shape
    and names: the next rank's world must not be handed this one's process groups."""
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in (propagator.propagate_op_sharding, propagator._propagate_tensor_meta_cached,
                   getattr(_redistribute, "clear_redistribute_planner_cache", None),
                   getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)):
        clear = getattr(cached, "cache_clear", cached)
        if callable(clear):
            clear()


def _parallelize_fake(model: nn.Module, mesh: Any, plan: ParallelPlan, parallelize: Any,
                      fsdp: bool) -> tuple[nn.Module, Any]:
    """parallelize outside any fake mode, the model ending up in fake tensors. With FSDP,
    ``parallelize`` materializes the meta model itself, in ``fake_tensors()``'s mode, after
    sharding it (a rank never holds the whole model); without (DDP, ZeRO-1, TP or EP alone,
    where a rank holds whole weights anyway), the model is given fake memory first and
    parallelized as a model in memory is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        from meshlab.parallel.materialize import fake_tensors, on_meta
        hooked = True
    except ImportError:  # a parallelize that leaves a meta model on meta
        hooked = False
    if fsdp and hooked:
        with fake_tensors() as mode:
            model = parallelize(model, mesh, plan)
        if not on_meta(model):
            return model, mode
        with mode:
            model.to_empty(device="cpu")
        return model, mode
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device="cpu")
    return parallelize(model, mesh, plan), mode


def _forward_backward(model: nn.Module, pipeline: Any, plan: ParallelPlan, x: torch.Tensor,
                      y: torch.Tensor, own: bool) -> None:
    """The step's forward and backward: the pipeline's schedule, or the micro-steps of
    gradient accumulation (one without it)."""
    from meshlab.models.llama import loss_fn
    from meshlab.parallel.accumulate import micro_batches
    from meshlab.verify.training import logits_of

    if pipeline is not None:
        pipeline.step(x, y)
        return
    forward = getattr(model, "module", model).forward  # DDP: the model's own signature
    # transformers models build a KV cache unless told not to; a training loop turns it off
    kwargs = ({"use_cache": False} if not own and "use_cache" in
              inspect.signature(forward).parameters else {})
    for inputs, targets in micro_batches(model, (x, y), plan.grad_accum):
        (loss_fn(logits_of(model(inputs, **kwargs)), targets) / plan.grad_accum).backward()


def _warm(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's states, as every step after the first finds them: one step on zero
    gradients (its own collectives, before any tracer)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _boundary(model: nn.Module, plan: ParallelPlan, layout: Layout, rows: int, seq: int,
              hidden: int | None) -> tuple[torch.Size, torch.dtype]:
    """What one pipeline stage hands the next: a micro-batch's hidden states, split along the
    sequence by cp, and by tp where sequence parallelism keeps the stream split (meshlab's
    Transformer; transformers' stages pass it whole), bf16 where FSDP casts to it."""
    from meshlab.models import Transformer

    hidden = hidden or int(getattr(getattr(model, "config", None), "hidden_size", 0))
    split = layout.cp
    if isinstance(model, Transformer) and layout.tp > 1 and plan.sequence_parallel is not False:
        split *= layout.tp
    fsdp = plan.data_parallel in ("zero2", "zero3") and layout.dp * layout.cp > 1
    param = next(model.parameters())
    dtype = torch.bfloat16 if plan.mixed_precision and fsdp else param.dtype
    return torch.Size((rows // max(1, plan.microbatches), seq // split, hidden)), dtype


def _vocab(model: nn.Module) -> int:
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(vocab, int):
        raise ValueError(f"cannot tell the vocabulary of {type(model).__name__} (no "
                         "cfg.vocab_size or config.vocab_size): give the model a config")
    return vocab


def _held(model: nn.Module, stages: list[nn.Module]) -> int:
    """Parameter elements this rank holds: each parameter's local shard, once."""
    from meshlab.measure.memory import local_shard

    seen: dict[int, int] = {}
    for module in (model, *stages):
        for p in module.parameters():
            seen[id(p)] = local_shard(p).numel()
    return sum(seen.values())


# -- collectives by mesh axis ------------------------------------------------------------------


def traffic(records: list[CommRecord], spec: MeshSpec, rank: int) -> list[Traffic]:
    """The step's collectives summed per (axis, op), each attributed to the mesh axis (or
    flattened view) whose group for ``rank`` has exactly its ranks."""
    names = axis_names(spec, rank)
    # where ep's group is also a data-parallel axis's (ep = dp_shard), the tokens' all-to-all
    # is ep's and the gradients' reductions the data axis's
    data = axis_names(spec, rank, ep=False)
    summed: dict[tuple[str, str], list[int]] = {}
    for r in records:
        group = frozenset(r.group)
        named = names if r.op == "all_to_all" else data
        axis = named.get(group) or ("world" if len(group) == spec.size else "other")
        entry = summed.setdefault((axis, r.op), [0, 0, 0])
        entry[0] += 1
        entry[1] += r.bytes
        entry[2] += r.wire_bytes
    return [Traffic(axis=a, op=op, calls=c, bytes=b, wire_bytes=w)
            for (a, op), (c, b, w) in sorted(summed.items())]


def axis_names(spec: MeshSpec, rank: int, *, ep: bool = True) -> dict[frozenset[int], str]:
    """This rank's group on every mesh dimension and view -> its name: the axes it spans
    joined by "+" (dp_shard+cp), "dp_shard" for both halves of ep's split, "ep" for ep
    (``ep=False``: ep's group by the data axes it borrows)."""
    dims = spec.mesh_axes()
    spans: dict[str, tuple[str, ...]] = {d: (d,) for d in dims} | spec.views()
    if spec.ep > 1:  # the experts' data ranks (meshlab.parallel.expert's replica group)
        spans["ep_replicas"] = tuple(d for d in ("dp_replicate", "dp_shard_mod_ep")
                                     if d in dims)
    names: dict[frozenset[int], str] = {}
    for span in sorted(spans.values(), key=len):
        group = frozenset(spec.group_of(rank, span))
        if len(group) > 1:
            names.setdefault(group, canonical(span, spec, ep=ep))
    return names


def canonical(span: tuple[str, ...], spec: MeshSpec, *, ep: bool = True) -> str:
    """A group's name from the mesh dimensions it spans (those of size one left out)."""
    dims = spec.mesh_axes()
    kept = [d for d in dims if d in span and dims[d] > 1]
    borrowed = {d for d in ("dp_shard_in_ep", "cp") if dims.get(d, 1) > 1}
    if ep and spec.ep > 1 and set(kept) == borrowed:
        return "ep"
    if "dp_shard_in_ep" in kept and ("dp_shard_mod_ep" in kept or not ep):
        # both halves of ep's split (or, by the data axes, ep's own half) are dp_shard
        kept = [("dp_shard" if d == "dp_shard_in_ep" else d) for d in kept
                if d != "dp_shard_mod_ep"]
    return "+".join(kept)
