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

import copy
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from meshlab.parallel.blocks import holds
from meshlab.schedules.actions import Schedule, ScheduleError
from meshlab.schedules.execute import Executor, stage_modules

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_pp(model: nn.Module, mesh: DeviceMesh, *, schedule: Schedule,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             parallelize_stage: Callable[[nn.Module], nn.Module] | None = None,
             split_points: Sequence[str] | None = None, axis: str = "pp") -> nn.Module:
    """Cut ``model`` (a meshlab Transformer) down to this rank's stages of ``schedule``, in
    place, and parallelize each stage with ``parallelize_stage``; then
    ``model.pipeline.step(inputs, targets)`` runs one forward+backward and returns the loss.

    ``split_points``: the blocks that open stages 1, 2, ... as torchtitan names them
    (``["layers.3"]``; ``["model.layers.3"]`` on a transformers model); None splits the
    blocks as evenly as the counts allow.

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
    causal_lm = is_causal_lm(model)
    blocks = "model.layers" if causal_lm else "layers"
    starts = (None if split_points is None else
              stage_starts(split_points, blocks, len(cast(nn.ModuleList, model.get_submodule(
                  blocks))), schedule.stages))
    if causal_lm:
        return _apply_pp_causal_lm(model, mesh, schedule, mine, loss_fn or next_token_loss,
                                   parallelize_stage, starts, axis)
    stages = stage_modules(model, mine, schedule.stages, starts)
    if parallelize_stage is not None:
        stages = {s: parallelize_stage(stage) for s, stage in stages.items()}
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
                                    axis=axis)
    return model


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


# -- a transformers causal LM (embed_tokens, layers, norm under .model; lm_head) --------------


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM laid out as its ``_pp_plan`` says: model.embed_tokens,
    model.layers, model.norm, then lm_head."""
    plan = getattr(model, "_pp_plan", None) or {}
    return {"model.embed_tokens", "model.layers", "model.norm", "lm_head"} <= set(plan)


class CausalLMStage(nn.Module):
    """One pipeline stage of a transformers causal LM: its decoder layers, with the embedding
    on the first stage and the final norm and head on the last (shared with the model)."""

    def __init__(self, model: Any, layers: list[nn.Module], *, first: bool, last: bool) -> None:
        super().__init__()
        base = copy.copy(model.model)  # the decoder, with its own child tables
        for key, value in vars(model.model).items():
            if key.startswith("_") and isinstance(value, dict | set):
                base.__dict__[key] = copy.copy(value)
        base.layers = nn.ModuleList(layers)
        if not first:
            base.embed_tokens = None  # a later stage starts from hidden states
        if not last:
            base.norm = nn.Identity()
        self.model = base
        self.lm_head = model.lm_head if last else None
        self.first = first
        # the model's TP plan, less the parts another stage holds (paths are the same here)
        plan = getattr(model, "_tp_plan", None) or {}
        self._tp_plan = {path: style for path, style in plan.items()
                         if holds(self, path.split(".*")[0])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the first stage takes token ids (B, T); the others hidden states (B, T, H)
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.model(**given, use_cache=False).last_hidden_state
        return self.lm_head(hidden) if self.lm_head is not None else hidden


def _apply_pp_causal_lm(model: Any, mesh: DeviceMesh, schedule: Schedule, mine: list[int],
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        parallelize_stage: Callable[[nn.Module], nn.Module] | None,
                        starts: list[int] | None, axis: str) -> nn.Module:
    from meshlab.schedules.execute import stage_layers

    layers = list(model.model.layers)
    owned = {s: list(stage_layers(len(layers), s, schedule.stages, starts)) for s in mine}
    stages: dict[int, nn.Module] = {
        s: CausalLMStage(model, [layers[i] for i in owned[s]], first=s == 0,
                         last=s == schedule.stages - 1) for s in mine}
    if parallelize_stage is not None:
        stages = {s: parallelize_stage(stage) for s, stage in stages.items()}
    # the model keeps its stages' parts under their full-model names (layer i stays "i")
    kept = {str(i): block for s, stage in stages.items()
            for i, block in zip(owned[s], cast(Any, stage).model.layers, strict=True)}
    model.model.layers = nn.ModuleDict(kept)
    if 0 not in mine:
        model.model.embed_tokens = None
    if schedule.stages - 1 not in mine:
        model.model.norm = None
        model.lm_head = None
    model.pipeline = Executor(schedule, stages, mesh, loss_fn=loss_fn, axis=axis)
    return cast(nn.Module, model)
