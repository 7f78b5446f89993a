"""Pipeline parallel: this rank's stages of a schedule over the pp axis, run slot by slot.

A schedule (meshlab.schedules: any builder's, or a user's own) places S stages on the pp
ranks: one per rank (gpipe, 1f1b, zb_h1), looped (interleaved_1f1b, looped_bfs: stage s on
rank s % pp) or in a V (zbv, dualpipev). Stage s of S keeps layers [s*L/S, (s+1)*L/S); the
first stage also holds the embedding, the last the final norm and output. The model is cut
down to this rank's stages first; each stage is then parallelized on its own (TP,
activation checkpointing, FSDP), as torchtitan does, and meshlab's one executor
(meshlab.schedules.execute) runs the schedule on them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from meshlab.parallel.agree import agree
from meshlab.parallel.clip import COPY
from meshlab.parallel.pipeline_stage import tied_weight
from meshlab.schedules.actions import Schedule, ScheduleError
from meshlab.schedules.execute import Executor, stage_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_pp(model: nn.Module, mesh: DeviceMesh, *, schedule: Schedule,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
             split_points: Sequence[str] | None = None, blocks: str | None = None,
             axis: str = "pp", reduce_every_microbatch: bool = False) -> nn.Module:
    """Cut ``model`` (meshlab's Transformer, or any model of repeated blocks: transformers'
    models, one written in a cell) down to this rank's stages of ``schedule``, in place, and
    parallelize each stage with ``parallelize_stage``; then
    ``model.pipeline.step(inputs, targets)`` runs one forward+backward and returns the loss.

    ``split_points``: the blocks that open stages 1, 2, ... as torchtitan names them
    (``["layers.3"]``; ``["model.layers.3"]`` on a transformers model); None splits the
    blocks as evenly as the counts allow. ``blocks``: where the blocks are, when they
    cannot be found (meshlab.parallel.blocks). ``reduce_every_microbatch``: FSDP2 stages
    reduce-scatter each micro-batch's gradients (meshlab.schedules.reducing_stage). Any
    model but meshlab's is split as
    meshlab.parallel.pipeline_stage says, and the split is proved on a probe batch first.

    The model keeps the full model's parameter names; ``model.pipeline`` is the executor
    (``.stages`` its torch PipelineStages, ``.advance(n)`` steps it slot by slot).
    """
    from meshlab.models.llama import loss_fn as next_token_loss

    schedule.validate()
    pp = mesh[axis]
    if pp.size() != schedule.ranks:
        raise ScheduleError(f"the schedule has {schedule.ranks} ranks but the {axis} axis has "
                            f"{pp.size()}: build it with ranks={pp.size()}")
    mine = schedule.stages_of(pp.get_local_rank())
    from meshlab.models import Transformer

    if not isinstance(model, Transformer):
        return _apply_pp_any(model, mesh, schedule, mine, loss_fn or next_token_loss,
                             parallelize_stage, split_points, blocks, axis,
                             reduce_every_microbatch)
    starts = (None if split_points is None else
              stage_starts(split_points, "layers", len(cast(nn.ModuleDict, model.layers)),
                           schedule.stages))
    stages = stage_modules(model, mine, schedule.stages, starts)
    if parallelize_stage is not None:
        stages = _parallelized(stages, parallelize_stage)
    # The model keeps only its stages' parts (with any wrapper a stage put on a block).
    layers = cast(nn.ModuleDict, model.layers)
    kept = {name: block for stage in stages.values()
            for name, block in cast(nn.ModuleDict, stage.layers).items()}
    for name in list(layers):
        if name in kept:
            layers[name] = kept[name]
        else:
            del layers[name]  # keys stay the original indices, so names match the full model
    transformer: Any = model  # a meshlab Transformer
    if 0 not in mine:
        transformer.tok_embeddings = None
    if schedule.stages - 1 not in mine:
        transformer.norm = None
        transformer.output = None
    transformer.pipeline = Executor(schedule, stages, mesh, loss_fn=loss_fn or next_token_loss,
                                    axis=axis, reduce_every_microbatch=reduce_every_microbatch)
    hold_reductions(transformer.pipeline, stages)
    return model


def hold_reductions(pipeline: Executor, stages: dict[int, nn.Module]) -> None:
    """A strategy's own gradient reductions (expert parallel's) run once a step, after the
    last micro-batch's backward: each stage runs a backward per micro-batch, and reducing
    the accumulated gradient in every one would count the earlier ones again."""
    from meshlab.parallel.accumulate import GRADIENT_SYNC

    for stage in stages.values():
        sync = getattr(stage, GRADIENT_SYNC, None)
        if sync is not None:
            sync.now = False
            pipeline.after_backward.append(sync.flush)


def stage_starts(split_points: Sequence[str], blocks: str, n_blocks: int, stages: int
                 ) -> list[int]:
    """The first block of stages 1, 2, ... from torchtitan-style split points
    (``"layers.3"``); ValueError naming the fix for a point that is no boundary."""
    if len(split_points) != stages - 1:
        raise ValueError(f"split_points={list(split_points)} gives {len(split_points) + 1} "
                         f"stages but the schedule has {stages}: name {stages - 1} blocks, "
                         f"each opening a stage (e.g. {blocks}.{n_blocks // stages})")
    starts = []
    for point in split_points:
        path, _, index = point.rpartition(".")
        if path != blocks or not index.isdigit() or not 0 < int(index) < n_blocks:
            raise ValueError(f"split point {point!r} is not a block of this model: name one of "
                             f"{blocks}.1 ... {blocks}.{n_blocks - 1}, the block that opens a "
                             "stage")
        starts.append(int(index))
    if starts != sorted(set(starts)):
        raise ValueError(f"split_points={list(split_points)} must name blocks in increasing "
                         "order, each once: every stage holds at least one block")
    return starts


class TiedCopies:
    """The tied embedding and head of a pipelined model, on the stages holding them: after
    each step their gradients are summed (Megatron's embedding group), so both copies take
    the same optimizer step and stay equal, as the one tied weight would."""

    def __init__(self, stages: dict[int, nn.Module], total: int, mesh: DeviceMesh, axis: str,
                 stage_to_rank: Sequence[int], weights: tuple[str, str]) -> None:
        holders = {0: weights[0], total - 1: weights[1]}
        self.copies = [stages[s].get_parameter(name) for s, name in holders.items()
                       if s in stages]
        if total - 1 in stages:  # the gradient norm counts the weight once
            setattr(self.copies[-1], COPY, True)
        first, last = stage_to_rank[0], stage_to_rank[-1]
        self.group = None if first == last else _pair_group(mesh, axis, first, last)

    def sum_gradients(self) -> None:
        from torch.distributed.tensor import DTensor

        copies: list[Any] = [p for p in self.copies if p.grad is not None]
        for p in copies:  # a gradient may come laid out unlike its weight (an embedding's)
            if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
                p.grad = p.grad.redistribute(placements=p.placements)
        local = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in copies]
        if not local:
            return
        total = torch.stack(local).sum(dim=0)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for g in local:
            g.copy_(total)


_pair_groups: dict[tuple[Any, ...], Any] = {}


def _pair_group(mesh: DeviceMesh, axis: str, first: int, last: int) -> Any:
    """This rank's group of the two pp ranks holding the first and the last stage (one per
    pipeline; every rank creates all of them, in the same order); made once per layout."""
    names = list(mesh.mesh_dim_names or ())
    grid = mesh.mesh.movedim(names.index(axis), -1)
    pairs = [[row[first], row[last]] for row in grid.reshape(-1, grid.shape[-1]).tolist()]
    key = (dist.group.WORLD, tuple(map(tuple, pairs)))
    if key not in _pair_groups:
        _pair_groups[key] = dist.new_subgroups_by_enumeration(pairs)[0]
    return _pair_groups[key]


def _parallelized(stages: dict[int, nn.Module],
                  parallelize_stage: Callable[[nn.Module], nn.Module]) -> dict[int, nn.Module]:
    """This rank's stages, each given the rest of the plan; a refusal that depends on what a
    stage holds reaches the other stages' ranks too (meshlab.parallel.agree)."""
    problem, built = None, stages
    try:
        built = {s: parallelize_stage(stage) for s, stage in stages.items()}
    except ValueError as e:
        problem = str(e)
    agree(problem, "a rank of another pipeline stage refused its part of the plan (its error "
                   "says why)")
    return built


def _apply_pp_any(model: Any, mesh: DeviceMesh, schedule: Schedule, mine: list[int],
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                  parallelize_stage: Callable[[nn.Module], nn.Module] | None,
                  split_points: Sequence[str] | None, blocks: str | None, axis: str,
                  reduce_every_microbatch: bool = False) -> nn.Module:
    """Any model of repeated blocks, split as meshlab.parallel.pipeline_stage says: stages
    proved on a probe batch, this rank's built, the model cut down to what they hold."""
    from meshlab.parallel.pipeline_stage import Stage, check_split, frozen, layout_of
    from meshlab.schedules.execute import stage_layers

    layout = layout_of(model, blocks)
    base = layout.base_of(model)
    n = len(getattr(base, layout.blocks))
    starts = (None if split_points is None else
              stage_starts(split_points, layout.path(layout.blocks), n, schedule.stages))
    owned = [stage_layers(n, s, schedule.stages, starts) for s in range(schedule.stages)]
    check_split(model, layout, owned)
    last = schedule.stages - 1
    tied = tied_weight(model, layout)
    stages: dict[int, nn.Module] = {
        s: Stage(model, layout, owned[s], first=s == 0, last=s == last) for s in mine}
    if parallelize_stage is not None:
        stages = _parallelized(stages, parallelize_stage)
    # the model keeps its stages' parts under their full-model names (block i stays "i")
    blocks_path = layout.path(layout.blocks)
    kept = {str(i): cast(Any, stage.get_submodule(blocks_path))[i]
            for s, stage in stages.items() for i in owned[s]}
    base._modules[layout.blocks] = nn.ModuleDict(kept)
    if 0 not in mine:
        base._modules[layout.embedding] = None
        for name in layout.before:  # what they hold is the first stage's to train
            base._modules[name] = frozen(getattr(base, name))
    if last not in mine:
        for name in layout.after:
            base._modules[name] = None
        for name in layout.heads:
            model._modules[name] = None
    else:  # a tied head: the last stage's copy
        for name in layout.heads:
            model._modules[name] = stages[last].get_submodule(name)
        for name in layout.after:
            base._modules[name] = stages[last].get_submodule(layout.path(name))
    model.pipeline = Executor(schedule, stages, mesh, loss_fn=loss_fn, axis=axis,
                              reduce_every_microbatch=reduce_every_microbatch)
    hold_reductions(model.pipeline, stages)
    if tied is not None:
        copies = TiedCopies(stages, schedule.stages, mesh, axis, schedule.stage_to_rank, tied)
        model.pipeline.after_backward.append(copies.sum_gradients)
    return cast(nn.Module, model)
