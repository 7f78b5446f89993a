"""One pipeline stage of any model built of repeated blocks, running the model's own forward.

A stage is the model with the parts other stages hold stood in for, as transformers' pipeline
split does: blocks another stage runs are pass-throughs (each block keeps its index, so what
the forward reads by index stays right); a later stage enters through ``inputs_embeds`` where
the model takes it, else its input embedding hands on the stage's input; the parts after the
blocks (final norm, head) are pass-throughs except on the last stage, which runs the whole
forward, so whatever follows them (soft-capping, a tuple return) runs as the model wrote it.
Parts that run before the blocks (positions, dropout, rotary angles) run on every stage as
the model wrote them; on a later stage their output is superseded by the stage's input
(``enter_at``), and their weights are plain buffers there (the first stage trains them).

Which parts come before the blocks and which after is read off one forward of the model
(``layout_of``), and the split is proved before it trains (``check_split``): every stage,
chained in this process on a probe batch, must give the model's own output.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from meshlab.parallel.blocks import PassThrough, find_blocks, holds, shallow_copy


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a model keeps the parts a pipeline split moves, in the order its forward runs."""

    base: str  # the module holding the blocks ("model", "gpt_neox", "transformer"; "": the model)
    embedding: str  # the base's input embedding ("embed_tokens", "wte")
    before: tuple[str, ...]  # the base's other parts run before the blocks ("wpe", "rotary_emb")
    blocks: str  # the base's blocks ("layers", "h")
    after: tuple[str, ...]  # the base's parts after the blocks ("norm", "ln_f", a head)
    heads: tuple[str, ...]  # the model's parts after the base ("lm_head", "embed_out")
    inputs_embeds: bool  # the base's forward takes inputs_embeds (a later stage enters there)
    width: int  # the length of the tuple a block returns (hidden states first), 0: a tensor

    def base_of(self, model: nn.Module) -> nn.Module:
        return model.get_submodule(self.base) if self.base else model

    def path(self, name: str) -> str:
        """A base part's path in the whole model."""
        return f"{self.base}.{name}" if self.base else name


def layout_of(model: nn.Module, blocks: str | None = None) -> Layout:
    """Read the model's layout off one forward on a probe batch (on the meta device for a
    model built there); ValueError naming what to pass where it cannot be read."""
    path, container = find_blocks(model, blocks)
    base_path, _, blocks_name = path.rpartition(".")
    base = model.get_submodule(base_path) if base_path else model
    order: list[tuple[str, str]] = []  # (level, name) in the order of first calls
    hooks = []
    for level, owner in (("base", base), ("top", model)):
        for name, child in owner.named_children():
            if level == "top" and child is base:
                continue

            def seen(*_: Any, key: tuple[str, str] = (level, name)) -> None:
                if key not in order:
                    order.append(key)

            hooks.append(child.register_forward_pre_hook(seen))
    first = next(iter(container.children()))
    hooks.append(first.register_forward_pre_hook(lambda *_: order.append(("blocks", ""))))
    returned: list[Any] = []
    hooks.append(first.register_forward_hook(lambda _, __, out: returned.append(out)))
    try:
        with torch.no_grad():
            run(model, probe(model, 4))
    except Exception as e:
        on_meta = any(p.is_meta for p in model.parameters())
        planned = _from_pp_plan(model, base_path, blocks_name) if on_meta else None
        if planned is not None:  # transformers' own pipeline layout, where meta cannot run
            return planned
        raise ValueError(f"a pipeline split reads which parts of {type(model).__name__} run "
                         f"before and after its blocks ({path}) off one forward on a probe "
                         f"batch, which failed ({type(e).__name__}: {e}): name the blocks with "
                         "ParallelPlan(blocks=...)"
                         + (", or build the model on a device (on meta it has no "
                            "base_model_pp_plan to read instead)" if on_meta else "")
                         + ", or build the mesh without pp") from None
    finally:
        for hook in hooks:
            hook.remove()
    at = order.index(("blocks", "")) if ("blocks", "") in order else len(order)
    before = [n for level, n in order[:at] if level == "base" and n != blocks_name]
    after = [n for level, n in order[at:] if level == "base" and n != blocks_name]
    heads = [n for level, n in order[at:] if level == "top"]
    embedding = next((n for n in before if isinstance(getattr(base, n), nn.Embedding)), None)
    if embedding is None:
        raise ValueError(f"a pipeline split of {type(model).__name__} enters each stage after "
                         f"the first through its input embedding, and found no nn.Embedding "
                         f"run before its blocks ({path}): build the mesh without pp")
    takes = "inputs_embeds" in inspect.signature(base.forward).parameters and bool(base_path)
    return Layout(base_path, embedding, tuple(n for n in before if n != embedding),
                  blocks_name, tuple(after), tuple(heads), takes,
                  len(returned[0]) if returned and isinstance(returned[0], tuple) else 0)


def _from_pp_plan(model: nn.Module, base_path: str, blocks: str) -> Layout | None:
    """The layout transformers' ``base_model_pp_plan`` states (its parts in forward order), or
    else the order the base model's parts were built in (embedding, blocks, norm, in every
    transformers model), parts without parameters counted before the blocks: for a model on
    the meta device whose forward cannot run there (an MoE router's nonzero, a Mamba scan),
    with no numbers to check it by, as ``check="tiny"`` has."""
    plan = list(getattr(getattr(model, "config", None), "base_model_pp_plan", None) or ())
    if not base_path:
        return None
    base = model.get_submodule(base_path)
    if not plan:  # no stated plan: the order transformers builds a base model's parts in
        plan = [n for n, _ in base.named_children()]
    if blocks not in plan:
        return None
    at = plan.index(blocks)
    embedding = next((n for n in plan[:at] if isinstance(getattr(base, n, None), nn.Embedding)),
                     None)
    # a part without parameters computes from positions (a rotary embedding, which
    # transformers builds last and leaves out of its pp plans): it runs before the blocks,
    # on every stage as written
    derived = [n for n, part in base.named_children()
               if n not in plan[:at] and not any(True for _ in part.parameters())]
    plan = [*plan[:at], *derived, blocks, *(n for n in plan[at + 1:] if n not in derived)]
    at = plan.index(blocks)
    head = getattr(model, "get_output_embeddings", lambda: None)()
    heads = tuple(n for n, m in model.named_children() if m is head)
    if embedding is None or not heads:
        return None
    takes = "inputs_embeds" in inspect.signature(base.forward).parameters
    # blocks with a pp plan return their hidden states alone (transformers' pipeline contract)
    return Layout(base_path, embedding, tuple(n for n in plan[:at] if n != embedding), blocks,
                  tuple(plan[at + 1:]), heads, takes, 0)


def probe(model: nn.Module, length: int) -> torch.Tensor:
    """A (1, ``length``) batch of token ids the model's embedding takes, on its device."""
    embedding = next(m for m in model.modules() if isinstance(m, nn.Embedding))
    device = embedding.weight.device
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, embedding.num_embeddings, (1, length), generator=generator)
    return tokens.to(device)


def run(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's output tensor for ``tokens`` (its logits, whatever it returns them in)."""
    return output_of(model(tokens))


def output_of(out: Any) -> torch.Tensor:
    """The tensor a forward returned: itself, the first of a tuple, or a ModelOutput's logits
    (else its last hidden state)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple | list):
        return output_of(out[0])
    for field in ("logits", "last_hidden_state"):
        value = getattr(out, field, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"a pipeline stage got {type(out).__name__} from the model's forward; "
                    "expected a tensor, a tuple starting with one, or a ModelOutput")


class Entering(nn.Module):
    """A later stage's input embedding: hands on the stage's input, whatever it is given."""

    def __init__(self, stage: Stage) -> None:
        super().__init__()
        self.__dict__["stage"] = stage  # not a child: the stage holds this

    def forward(self, *_: Any, **__: Any) -> torch.Tensor:
        entering = cast(Stage, self.__dict__["stage"]).entering
        assert entering is not None
        return entering


class Stage(nn.Module):
    """One pipeline stage (see the module): ``owned`` blocks of ``model``; the first stage
    takes token ids (B, T), the others hidden states (B, T, H). Its parts sit under the whole
    model's names (a TP plan's patterns, a checkpoint's keys still find them)."""

    def __init__(self, model: nn.Module, layout: Layout, owned: range, *, first: bool,
                 last: bool) -> None:
        super().__init__()
        base = layout.base_of(model)
        mine = shallow_copy(base)
        blocks = getattr(base, layout.blocks)
        pairs = list(blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks))
        kept = [(str(k), b if i in owned else PassThrough(layout.width))
                for i, (k, b) in enumerate(pairs)]
        mine._modules[layout.blocks] = (nn.ModuleDict(dict(kept))
                                        if isinstance(blocks, nn.ModuleDict)
                                        else nn.ModuleList(b for _, b in kept))
        if not first:
            # a later stage enters through inputs_embeds, or its embedding hands the input on
            mine._modules[layout.embedding] = None if layout.inputs_embeds else Entering(self)
            for name in layout.before:  # run, superseded: their weights are the first stage's
                mine._modules[name] = frozen(getattr(base, name))
        for name in layout.after:
            mine._modules[name] = (head_of(model, layout.path(name), first) if last
                                   else PassThrough())
        whole = shallow_copy(model) if layout.base else mine
        if layout.base:
            whole._modules[layout.base] = mine
        for name in layout.heads:
            whole._modules[name] = head_of(model, name, first) if last else PassThrough()
        self._modules.update(whole._modules)  # the whole model's names, this stage's parts
        self.__dict__["causal_lm"] = whole  # the model's forward over them (not a child)
        self.__dict__["base_part"] = mine
        self.layout, self.first, self.last = layout, first, last
        self.entering: torch.Tensor | None = None
        # the model's TP plan, less the parts another stage holds (paths are the same here)
        plan = getattr(model, "_tp_plan", None) or {}
        self._tp_plan = {path: style for path, style in plan.items()
                         if holds(self, path.split(".*")[0])}
        if not first:
            enter_at(cast(nn.Module, mine._modules[layout.blocks][owned[0]]), self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.entering = None if self.first else x
        module = self.__dict__["causal_lm"] if self.last else self.__dict__["base_part"]
        args: tuple[Any, ...] = (x,)
        given: dict[str, Any] = {}
        if not self.first and self.layout.inputs_embeds:
            args, given = (), {"inputs_embeds": x}
        if "use_cache" in inspect.signature(module.forward).parameters:
            given["use_cache"] = False
        try:
            return output_of(module(*args, **given))
        finally:
            self.entering = None


def head_of(model: nn.Module, path: str, first: bool) -> nn.Module:
    """The last stage's part at ``path``; where its weight is tied to another part (the
    embedding) and the first stage is another, its own copy, kept equal to the embedding by
    the pipeline (TiedCopies)."""
    part = model.get_submodule(path)
    weight = getattr(part, "weight", None)
    shared = isinstance(weight, nn.Parameter) and any(
        p is weight for n, p in model.named_parameters(remove_duplicate=False)
        if not n.startswith(f"{path}."))
    if first or not shared:
        return part
    part = shallow_copy(part)
    part.weight = nn.Parameter(cast(nn.Parameter, weight).detach().clone())
    return part


def tied_weight(model: nn.Module, layout: Layout) -> tuple[str, str] | None:
    """(the embedding's weight, the head weight tied to it) as paths in the whole model, or
    None where the head has a weight of its own."""
    embedding = layout.base_of(model).get_submodule(layout.embedding)
    weight = getattr(embedding, "weight", None)
    for name in (*layout.heads, *(layout.path(a) for a in layout.after)):
        if getattr(model.get_submodule(name), "weight", None) is weight is not None:
            return f"{layout.path(layout.embedding)}.weight", f"{name}.weight"
    return None


def frozen(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters are plain buffers (the same memory): it runs as
    it did, and no optimizer or checkpoint counts its weights twice."""
    copy = shallow_copy(module)
    for name, child in module.named_children():
        copy._modules[name] = frozen(child)
    for name, p in module._parameters.items():
        del copy._parameters[name]
        if p is not None:
            copy.register_buffer(name, p.detach(), persistent=False)
    return copy


def enter_at(block: nn.Module, stage: Stage) -> None:
    """The stage's input enters at its first block. A model may change what it embeds before
    its blocks (Granite scales it; GPT-2 adds positions): that is the first stage's business,
    so the block gets the stage's input instead, also when activation checkpointing
    recomputes it (the block's saved argument maps to the input it stood for)."""
    from torch.utils.weak import WeakTensorKeyDictionary

    stood_for = WeakTensorKeyDictionary()

    def enter(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden = args[0] if args else kwargs["hidden_states"]
        entering = stood_for.get(hidden, stage.entering)
        if entering is None or entering is hidden:  # the model handed the input on as is
            return args, kwargs
        stood_for[hidden] = entering  # for a recompute, after this forward is over
        if args:
            return (entering, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": entering}

    block.register_forward_pre_hook(enter, with_kwargs=True)


def check_split(model: nn.Module, layout: Layout, owned: list[range]) -> None:
    """Chain every stage in this process on a probe batch: their output must be the model's
    own (to its dtype's rounding), else ValueError naming where they part. A model on the
    meta device has no numbers to compare: check="tiny" proves its split on a copy."""
    from torch._subclasses.fake_tensor import is_fake

    if any(p.is_meta or is_fake(p) for p in model.parameters()):
        # nothing to compute (a meta model, or a dry run's fake one): check="tiny" proves
        # the split on a copy with weights
        return
    stages = [Stage(model, layout, r, first=s == 0, last=s == len(owned) - 1)
              for s, r in enumerate(owned)]
    tokens = probe(model, 8)
    with torch.no_grad():
        expected = run(model, tokens)
        x = tokens
        for s, stage in enumerate(stages):
            x = stage(x)
            if s == len(stages) - 1:
                scale = expected.abs().max().clamp_min(1e-30)
                error = float((x - expected).abs().max() / scale)
                if x.shape != expected.shape or error > 100 * torch.finfo(x.dtype).eps:
                    raise ValueError(
                        f"a pipeline split of {type(model).__name__} ({len(owned)} stages at "
                        f"blocks {[r[0] for r in owned[1:]]}) does not reproduce its own "
                        f"forward on a probe batch: the last stage's output differs by "
                        f"{error:.1e} of its size; the model passes something between its "
                        "parts that a stage does not get (an input computed before the "
                        "blocks besides the hidden states): name other split_points, or "
                        "build the mesh without pp")
