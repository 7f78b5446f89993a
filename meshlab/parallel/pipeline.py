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

from meshlab.parallel.blocks import PassThrough, holds, shallow_copy
from meshlab.parallel.clip import COPY
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


# -- a transformers causal LM (embed_tokens, layers, norm under .model; lm_head) --------------


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM laid out as transformers' own pipeline split takes it:
    model.embed_tokens, model.layers, model.norm, then lm_head."""
    inner = getattr(model, "model", None)
    parts = [getattr(inner, name, None) for name in ("embed_tokens", "layers", "norm")]
    return (isinstance(getattr(model, "lm_head", None), nn.Module)
            and all(isinstance(part, nn.Module) for part in parts)
            and isinstance(parts[1], nn.ModuleList))


class CausalLMStage(nn.Module):
    """One pipeline stage of a transformers causal LM, running the model's own forward as
    transformers' pipeline split does: blocks of other stages are pass-throughs (so each block
    keeps its index, and whatever the forward reads by index, like Gemma's layer types, stays
    right); a later stage enters through ``inputs_embeds``; the last stage runs the causal
    LM's forward, so its final norm, head and whatever follows (logit softcapping) run as the
    model wrote them. A head tied to the embedding is the stage's own copy here, kept equal
    to the first stage's by the pipeline (see TiedCopies)."""

    def __init__(self, model: Any, owned: range, *, first: bool, last: bool) -> None:
        super().__init__()
        base = shallow_copy(model.model)
        base.layers = nn.ModuleList(block if i in owned else PassThrough()
                                    for i, block in enumerate(model.model.layers))
        if not first:
            base.embed_tokens = None  # a later stage enters through inputs_embeds
        if not last:
            base.norm = PassThrough()
        self.model = base
        self.lm_head = None
        if last:
            head: Any = model.lm_head
            if not first and _tied(model):  # its own copy: the first stage holds the other
                head = shallow_copy(head)
                head.weight = nn.Parameter(head.weight.detach().clone())
            self.lm_head = head
        self.first, self.last = first, last
        # the causal LM's forward over this stage's parts (not a child: they are ours)
        causal_lm = shallow_copy(model)
        causal_lm._modules.update(model=base, lm_head=self.lm_head)
        self.__dict__["causal_lm"] = causal_lm
        if not first:
            _enter_at(cast(nn.Module, base.layers[owned[0]]), self)
        self._entering: torch.Tensor | None = None
        # the model's TP plan, less the parts another stage holds (paths are the same here)
        plan = getattr(model, "_tp_plan", None) or {}
        self._tp_plan = {path: style for path, style in plan.items()
                         if holds(self, path.split(".*")[0])}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the first stage takes token ids (B, T); the others hidden states (B, T, H)
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        self._entering = None if self.first else x
        try:
            if self.last:
                return cast(torch.Tensor,
                            cast(Any, self.causal_lm)(**given, use_cache=False).logits)
            return cast(torch.Tensor,
                        cast(Any, self.model)(**given, use_cache=False).last_hidden_state)
        finally:
            self._entering = None


def _enter_at(block: nn.Module, stage: CausalLMStage) -> None:
    """The stage's input enters at its first block. A model may change ``inputs_embeds``
    before its blocks (Granite scales it; GPT-2 adds positions): that is the first stage's
    business, so the block gets the stage's input instead, also when activation
    checkpointing recomputes it (the block's saved argument maps to the input it stood for)."""
    from torch.utils.weak import WeakTensorKeyDictionary

    stood_for = WeakTensorKeyDictionary()

    def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden = args[0] if args else kwargs["hidden_states"]
        entering = stood_for.get(hidden, stage._entering)
        if entering is None or entering is hidden:  # the model handed the input on as is
            return args, kwargs
        stood_for[hidden] = entering  # for a recompute, after this forward is over
        if args:
            return (entering, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": entering}

    block.register_forward_pre_hook(enter, with_kwargs=True)


def _tied(model: Any) -> bool:
    """The causal LM's head is its embedding's weight (tie_word_embeddings)."""
    head = getattr(model, "lm_head", None)
    embed = getattr(model.model, "embed_tokens", None)
    return head is not None and embed is not None and head.weight is embed.weight


class TiedCopies:
    """The tied embedding and head of a pipelined model, on the stages holding them: after
    each step their gradients are summed (Megatron's embedding group), so both copies take
    the same optimizer step and stay equal, as the one tied weight would."""

    def __init__(self, stages: dict[int, nn.Module], total: int, mesh: DeviceMesh, axis: str,
                 stage_to_rank: Sequence[int]) -> None:
        holders = {0: "model.embed_tokens.weight", total - 1: "lm_head.weight"}
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


def _apply_pp_causal_lm(model: Any, mesh: DeviceMesh, schedule: Schedule, mine: list[int],
                        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                        parallelize_stage: Callable[[nn.Module], nn.Module] | None,
                        starts: list[int] | None, axis: str) -> nn.Module:
    from meshlab.schedules.execute import stage_layers

    n = len(model.model.layers)
    owned = {s: stage_layers(n, s, schedule.stages, starts) for s in mine}
    last = schedule.stages - 1
    tied = _tied(model)
    stages: dict[int, nn.Module] = {
        s: CausalLMStage(model, owned[s], first=s == 0, last=s == last) for s in mine}
    if parallelize_stage is not None:
        stages = {s: parallelize_stage(stage) for s, stage in stages.items()}
    # the model keeps its stages' parts under their full-model names (layer i stays "i")
    kept = {str(i): cast(Any, stage).model.layers[i] for s, stage in stages.items()
            for i in owned[s]}
    model.model.layers = nn.ModuleDict(kept)
    if 0 not in mine:
        model.model.embed_tokens = None
    if last in mine:
        model.lm_head = cast(Any, stages[last]).lm_head  # a tied head: the stage's copy
    else:
        model.model.norm = None
        model.lm_head = None
    model.pipeline = Executor(schedule, stages, mesh, loss_fn=loss_fn, axis=axis)
    hold_reductions(model.pipeline, stages)
    if tied:
        copies = TiedCopies(stages, schedule.stages, mesh, axis, schedule.stage_to_rank)
        model.pipeline.after_backward.append(copies.sum_gradients)
    return cast(nn.Module, model)
