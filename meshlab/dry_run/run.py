"""A dry run: one training step of the user's own code, as chosen ranks of any world size run
it, in this process, with no cluster.

For each representative rank, torch's fake process group stands in for the world (every
collective returns at once) and fake tensors for memory (shapes, no storage): the model is
built on the meta device, parallelized by meshlab's own ``parallelize`` exactly as on a
cluster, materialized as fake tensors, and runs one step (forward, backward, optimizer)
under torch's memory tracker and meshlab's CommTracer, what it saves for the backward held
as fused GPU kernels would hold it (meshlab.dry_run.fused_memory; ``kernels="eager"``: op by op).
What the report holds is what that rank would allocate and send; meshlab.plan.reconcile
sets the planner's prediction beside it.

    >>> run = dryrun("llama3-70b", "pp=4 dp_shard=32 tp=8 schedule=interleaved_1f1b v=2 m=8")
    >>> run.ranks[0].memory["total"] / 2**30

What a fake step cannot know is stood in for (meshlab.dry_run.fake_peers): the pipeline's
handshakes with its neighbours, and (meshlab.dry_run.fake_routing) a router's choices (every
expert gets an equal share).
Plain torch, rank side: no IPython, ipyparallel, pandas or altair.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from meshlab.dry_run.compose import probe_schedule
from meshlab.dry_run.plan import (
    describe,
    model_factory,
    plan_for,
    ran,
    shape_of,
    with_model_options,
)
from meshlab.dry_run.report import DryRun, RankRun, Traffic
from meshlab.mesh import MeshSpec
from meshlab.plan.hardware import Hardware
from meshlab.plan.hardware import hardware as find_hardware
from meshlab.plan.layout import Layout
from meshlab.plan.layout_check import check
from meshlab.plan.reconcile import planner_beside
from meshlab.plan.shapes import ModelShape

if TYPE_CHECKING:
    from torch import nn

    from meshlab.parallel import ParallelPlan

RANK_SIDE = ("meshlab.dry_run.step", "meshlab.models", "meshlab.parallel",
             "meshlab.schedules.execute", "torch.testing._internal.distributed.fake_pg")
"""What a rank's step imports: the workers' server imports it before it forks them."""

KERNELS = ("fused", "eager")
"""Whose activation memory a dry run holds (``dryrun(kernels=)``)."""

__all__ = ["DryRun", "RankRun", "Traffic", "dryrun", "plan_for", "planner_beside",
           "representative_ranks", "shape_of"]


def dryrun(model: Callable[[], nn.Module] | ModelShape | str, layout: str, *,
           plan: ParallelPlan | None = None, init: Callable[[nn.Module], None] | None = None,
           batch: int | None = None, seq: int | None = None,
           hardware: Hardware | str | None = None, ranks: Sequence[int] | None = None,
           world_size: int | None = None, workers: int | None = None,
           compose: bool = True, kernels: str = "fused") -> DryRun:
    """One training step of ``model`` (a factory called under ``torch.device("meta")``, a
    ``ModelShape`` or a planner preset name, built as meshlab's Transformer) on ``layout``
    (``"pp=4 dp_shard=32 tp=8 m=8"``: mesh degrees and planner keys), on each of ``ranks``
    (default: ``representative_ranks``), in this process. The layout decides how the model
    is split (``plan_for(layout)``); ``plan`` gives the model's own options as parallelize
    takes them (tp_plan, blocks, split_points), ``init`` as parallelize's (a dry run fills
    nothing: a module without reset_parameters() needs none); ``batch`` is sequences per
    data-parallel rank (default mbs x m);
    ``world_size``, when given, must be the layout's product. ``workers``: the CPUs that
    run the ranks side by side, in as many processes as finish them soonest
    (``processes_for``; default: every CPU when a factory can be sent to them; 1 runs them
    here, one after another). ``compose``: a pipeline rank runs a probe step
    of a few micro-batches and composes the layout's schedule from it (the same figures,
    meshlab.dry_run.compose); False runs every micro-batch. ``kernels``: "fused" holds the
    activations fused kernels keep on a GPU (FlashAttention with grouped keys, fused norms
    and SwiGLU, torch.compile's blocks: meshlab.dry_run.fused_memory), "eager" what the code keeps
    run op by op."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )

    if dist.is_available() and dist.is_initialized():
        raise ValueError("a process group already exists in this process "
                         f"({dist.get_backend()}, {dist.get_world_size()} ranks): a dry run "
                         "starts its own fake one per rank; run it in a fresh process (a "
                         "notebook kernel or script without %mesh init), or call "
                         "torch.distributed.destroy_process_group() first")
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}: give one of {', '.join(KERNELS)} (fused: what "
                         "fused GPU kernels keep for the backward; eager: the code op by op)")
    started = time.perf_counter()
    lay = Layout.parse(layout)
    spec = lay.mesh_spec
    guessed = []
    if lay.pp > 1 and batch is None and "microbatches" not in Layout.stated(layout):
        # a pipeline needs micro-batches to fill it: the fewest 1F1B runs on, as a start
        lay = dataclasses.replace(lay, microbatches=lay.pp)
        guessed.append(f"m not given: m={lay.pp}, one micro-batch per pipeline rank (the "
                       "fewest 1F1B takes; a real run uses more to shrink the bubble: add m=)")
    if world_size is not None:
        spec.check(world_size)  # the mesh's own error, naming the product and the fix
    build, shape, name, family, facts = model_factory(model, seq, plan.tp_plan if plan else None)
    workers = _workers(build, workers)
    if workers > 1:  # its server imports the rank side while this process plans the ranks
        from multiprocessing import forkserver

        _pool_context()
        forkserver.ensure_running()
    seq = seq or (shape.seq_len if shape else None)
    if seq is None:
        raise ValueError(f"seq=None: give the sequence length for {name}, e.g. seq=4096")
    rows = batch or lay.micro_batch * lay.microbatches
    if rows % lay.microbatches:
        raise ValueError(f"batch={rows} does not split into m={lay.microbatches} micro-batches: "
                         f"give a multiple of {lay.microbatches}")
    lay = dataclasses.replace(lay, micro_batch=rows // lay.microbatches)
    if shape is not None:
        shape = dataclasses.replace(shape, seq_len=seq)
        check(shape, lay)
    if family != "meshlab" and "sequence_parallel" not in Layout.stated(layout):
        # the planner's default is Megatron's sequence parallelism; a model's own TP plan
        # (transformers') has none unless asked for
        lay = dataclasses.replace(lay, sequence_parallel=False)
    made, notes = plan_for(lay, seq=seq)
    notes = guessed + notes
    plan = with_model_options(made, plan)
    if init is not None and not callable(init):
        raise ValueError(f"init={init!r} is not a function: give init(module) filling a "
                         "module's own tensors, as parallelize takes it")
    lay = ran(lay)
    hw = find_hardware(hardware) if isinstance(hardware, str) else hardware
    chosen = ({r: _role(spec, lay, r) for r in ranks} if ranks is not None
              else representative_ranks(lay, shape))
    for r in chosen:
        if not 0 <= r < spec.size:
            raise ValueError(f"rank {r} is not in the {spec.size} ranks of {spec}: choose "
                             f"ranks in 0..{spec.size - 1}")
    schedule = _schedule(lay)
    probe = (probe_schedule(lay.schedule, lay.microbatches, schedule.stages == lay.pp,
                            partial(_builds, lay))
             if schedule is not None and compose else None)
    if probe is not None:  # each rank runs a probe step and composes the schedule from it
        plan = dataclasses.replace(plan, pipeline_schedule=probe[0], microbatches=probe[1])
        rows = lay.micro_batch * probe[1]

    def stages(rank: int) -> list[int]:
        return schedule.stages_of(rank // (spec.size // lay.pp)) if schedule else [0]

    # ranks whose stages run the same programs share one probe (meshlab's Transformer,
    # split evenly: a stage's program is its layer count and which ends it holds)
    alike = (_alike(chosen, stages, spec, schedule.stages, shape) if probe is not None and shape
             and family == "meshlab" and not plan.split_points else {r: [] for r in chosen})
    jobs = [dict(build=build, spec=spec, rank=r, role=chosen[r], plan=plan, init=init,
                 layout=lay, rows=rows, compose_to=lay.microbatches if probe else None,
                 seq=seq, vocab=shape.vocab if shape else None,
                 hidden=shape.hidden if shape else None, usable=hw.usable_bytes if hw else None,
                 stages=stages(r), kernels=kernels,
                 alike=[dict(rank=o, role=chosen[o] + f" (composed from rank {r}'s probe)",
                             stages=stages(o)) for o in others])
            for r, others in alike.items()]
    try:
        runs = sorted(_run_all(jobs, workers), key=lambda run: run.rank)
    except (DynamicOutputShapeException, DataDependentOutputException) as e:
        raise ValueError(f"{name}'s step takes a shape from its tensors' values ({e}: e.g. a "
                         "router picking experts per token), and a dry run's fake tensors have "
                         "no values: meshlab's MoE (ModelConfig(n_experts=...)) and "
                         "transformers' MoE models (their experts as grouped_mm) are dry-run "
                         "with every expert given an even share; for this model, %mesh plan "
                         "estimates the layout") from None
    if hw is not None:
        notes += [f"rank {r.rank} ({r.role}) does not fit: its step's peak is "
                  f"{r.memory['total'] / 2**30:.2f} GiB of the {hw.usable_bytes / 2**30:.2f} GiB "
                  f"usable on a {hw.name}" for r in runs if r.fits is False]
    return DryRun(layout=layout, planned=describe(lay), world_size=spec.size, model=name,
                  family=family, shape=dataclasses.asdict(shape) if shape else None,
                  batch=rows, seq=seq, stages=schedule.stages if schedule else 1,
                  hardware=hw.name if hw else None, ranks=runs,
                  tp_whole=["attention"] if "whole" in facts and lay.tp > 1 else [],
                  qk_norm="qk_norm" in facts, seconds=time.perf_counter() - started,
                  notes=notes, kernels=kernels)


def _run_all(jobs: list[dict[str, Any]], workers: int) -> list[RankRun]:
    """Each job's rank, here one after another, or side by side in as many processes as
    ``workers`` CPUs finish them soonest (each rank is a world of its own: nothing passes
    between them)."""
    from meshlab.dry_run.step import run_rank

    workers = processes_for(len(jobs), workers)
    if workers == 1:
        return [run for job in jobs for run in run_rank(**job)]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=_pool_context()) as pool:
        return [run for runs in pool.map(_run_job, jobs) for run in runs]


def _workers(build: Any, workers: int | None) -> int:
    """The CPUs ``dryrun(workers=)`` means: by default every CPU when ``build`` can be sent
    to a worker, else 1 (here)."""
    import os

    if workers is None:
        return (os.cpu_count() or 1) if _can_send(build) else 1
    return workers


def _pool_context() -> Any:
    """Workers forked from a server that imported the rank side once (and stays for the next
    dry run): a spawned one imports torch and meshlab again, seconds of a CPU each."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(RANK_SIDE))
    return context


def processes_for(jobs: int, cpus: int) -> int:
    """Processes to run ``jobs`` ranks on ``cpus`` CPUs: the fewest that run them in the
    least time, up to two per CPU. Three alike jobs on two CPUs take two rounds in two
    processes; in three, time-sharing the two, one and a half."""
    cpus = max(1, min(cpus, jobs))
    return min(range(cpus, min(jobs, 2 * cpus) + 1), key=lambda n: -(-jobs // n) * n)


def _can_send(build: Any) -> bool:
    """Whether worker processes can run ``build`` by default: it pickles by a module they can
    import (a function defined in a notebook or a script's ``__main__`` does not), and this
    process is not a script (a worker runs a script's top level again: a script
    that wants workers passes ``workers=`` under ``if __name__ == "__main__":``)."""
    import pickle
    import sys

    if hasattr(sys.modules.get("__main__"), "__file__"):
        return False
    try:
        # what pickles by reference to __main__ names it in the bytes
        return b"__main__" not in pickle.dumps(build)
    except (pickle.PicklingError, AttributeError, TypeError):
        return False  # a lambda or closure: it runs here


def _run_job(job: dict[str, Any]) -> list[RankRun]:
    from meshlab.dry_run.step import run_rank

    return run_rank(**job)


def representative_ranks(layout: Layout, shape: ModelShape | None = None) -> dict[int, str]:
    """rank -> role: the first rank of each pipeline stage, and where tensor parallelism
    splits a size unevenly (the last rank's part is smaller), or may (a model whose shape is
    not read), also each stage's last rank."""
    spec = layout.mesh_spec
    per_stage = spec.size // layout.pp
    chosen = {p * per_stage: _role(spec, layout, p * per_stage) for p in range(layout.pp)}
    if layout.tp > 1 and (shape is None or _uneven(shape, layout)):
        why = ("last shard of an uneven split" if shape is not None else
               "its tp share may differ: the model's shape is not read")
        for p in range(layout.pp):
            first, last = p * per_stage, (p + 1) * per_stage - 1
            # "every rank alike" no longer: the last of each tp group runs beside them
            chosen[first] = chosen[first].replace("every rank alike",
                                                  "every rank but the last of each tp group")
            chosen[last] = _role(spec, layout, last).replace(
                "every rank alike", "the last rank of each tp group") + f", {why}"
    return dict(sorted(chosen.items()))


def _uneven(shape: ModelShape, layout: Layout) -> bool:
    """Whether TP leaves its last rank a smaller part of some weight (FSDP2 pads its shards
    to one size: every rank holds as much)."""
    rows = [shape.vocab, shape.hidden, shape.ffn, shape.heads * shape.head_width,
            shape.n_kv_heads * shape.head_width]
    return any(r % layout.tp for r in rows)


def _schedule(layout: Layout) -> Any:
    """The pipeline schedule of ``layout`` (None without a pipeline)."""
    from meshlab.schedules import build

    if layout.pp == 1:
        return None
    return build(layout.schedule, ranks=layout.pp, microbatches=layout.microbatches,
                 virtual=layout.virtual)


def _alike(chosen: dict[int, str], stages: Callable[[int], list[int]], spec: MeshSpec,
           total: int, shape: ModelShape) -> dict[int, list[int]]:
    """The chosen ranks grouped by the programs they run: the first of each group -> the
    others. Alike: the same coordinates off the pp axis, and stages of the same layer counts
    holding the same ends, in order."""
    from meshlab.schedules.execute import stage_layers

    def program(rank: int) -> tuple[Any, ...]:
        where = {a: c for a, c in spec.coordinates_of(rank).items() if a != "pp"}
        held = tuple((len(stage_layers(shape.layers, s, total)), s == 0, s == total - 1)
                     for s in stages(rank))
        return held, tuple(sorted(where.items()))

    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank in chosen:
        groups.setdefault(program(rank), []).append(rank)
    return {ranks[0]: ranks[1:] for ranks in groups.values()}


def _builds(layout: Layout, schedule: str, microbatches: int) -> bool:
    """Whether ``schedule`` takes that many micro-batches on ``layout``'s pp ranks."""
    from meshlab.schedules import ScheduleError

    try:
        _schedule(dataclasses.replace(layout, schedule=schedule, microbatches=microbatches,
                                      virtual=layout.virtual if schedule == layout.schedule
                                      else 1))
    except (ScheduleError, ValueError):
        return False
    return True


def _role(spec: MeshSpec, layout: Layout, rank: int) -> str:
    schedule = _schedule(layout)
    if schedule is None:
        return "every rank alike" if spec.size > 1 else "the only rank"
    stage_rank = rank // (spec.size // layout.pp)
    mine = schedule.stages_of(stage_rank)
    ends = (["embedding"] if 0 in mine else []) + (["output"] if schedule.stages - 1 in mine
                                                   else [])
    return (f"pp rank {stage_rank}: stage{'s' if len(mine) > 1 else ''} "
            f"{', '.join(map(str, mine))} of {schedule.stages}"
            + (f" ({' and '.join(ends)})" if ends else ""))
