"""Tensor parallel (Megatron-style) on the tp axis, with optional sequence parallelism.

On meshlab's Transformer: column-parallel q/k/v and gate/up projections, row-parallel
attention output and down projection, a vocab-parallel embedding and output. With sequence
parallelism the norms and residual stream are split along the sequence (Shard(1)) between
the parallel regions, so activations there cost 1/tp of the memory. On any other model: the
plan the model ships (transformers' ``_tp_plan``) or one given as torch-style
``{module pattern: ColwiseParallel() | RowwiseParallel() | SequenceParallel()}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from meshlab.parallel.blocks import holds, owner_of
from meshlab.parallel.sp_regather import Regather
from meshlab.parallel.tensor_styles import OWN_STYLES, apply_named, name_matches
from meshlab.parallel.ties import retie, untie
from meshlab.parallel.vocab_embedding import VocabParallelEmbedding

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def check_tp(cfg: Any, tp: int) -> None:
    """Raise unless every sharded size divides by the tp degree."""
    sizes = {"n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
             "ffn_hidden": cfg.ffn_hidden, "vocab_size": cfg.vocab_size}
    bad = {k: v for k, v in sizes.items() if v % tp}
    if bad:
        listed = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(f"tp={tp} must divide {listed}: tensor parallelism splits these "
                         "across ranks; pick a tp that divides them")


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool | None = None,
             plan: Mapping[str, Any] | None = None, axis: str = "tp",
             sp_regather: bool = True) -> nn.Module:
    """Parallelize ``model`` over ``mesh[axis]`` with ``plan`` (torch-style: module pattern ->
    ColwiseParallel() | RowwiseParallel() | ..., or transformers' names "colwise", ...), or
    the model's own: meshlab's Megatron plan, or transformers' ``_tp_plan``.

    ``sequence_parallel``: None uses it where the plan has it (meshlab's does); True with a
    plan that has no SequenceParallel entry is refused, naming the fix. A Linear packing q, k,
    v (or gate, up) takes meshlab.parallel.fused's FusedColwise; the module that splits its
    output is proved on a probe batch before training (meshlab.parallel.fused_proof).
    ``sp_regather``: with sequence parallelism, the attention's and the MLP's gathered
    inputs are kept as this rank's part and gathered again in the backward (Megatron's
    memory; meshlab.parallel.sp_regather), not kept whole (torch's)."""
    tp_mesh = mesh[axis]
    if plan is None and _is_meshlab(model):
        return _apply_meshlab_tp(model, tp_mesh, sequence_parallel is not False,
                                 sp_regather)
    from meshlab.parallel import fused_proof

    given = plan is not None
    plan = plan if plan is not None else model_plan(model)
    fused_proof.capture(model, plan, user=given)  # before sharding: the module whole
    tied = untie(model)
    named = {p: s for p, s in plan.items() if isinstance(s, str)}
    if sequence_parallel and len(named) == len(plan):
        styles = sequence_parallel_plan(model, named, regather=sp_regather)
        named = {p: s for p, s in named.items() if s in OWN_STYLES}
    else:
        styles = {p: s for p, s in plan.items() if not isinstance(s, str)}
    if sequence_parallel and not any(type(s).__name__ == "SequenceParallel"
                                     for s in styles.values()):
        raise ValueError("sequence_parallel=True, but the TP plan has no SequenceParallel "
                         "entry: pass sequence_parallel=False, or a tp_plan with "
                         "SequenceParallel() on the norms and the layouts around them")
    from torch.distributed.tensor.parallel import parallelize_module

    _refuse_linear_styles_on_conv1d(model, styles)
    parallelize_module(model, tp_mesh, styles)
    if named:
        apply_named(model, tp_mesh, named)
    retie(model, tied)
    for module in model.modules():
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            module.register_forward_hook(_writable_output)
    fused_proof.check(model, tp_mesh)
    return model


class _Writable(torch.autograd.Function):
    """The same values as a tensor autograd lets the caller change in place; backward passes
    the gradient through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()  # a new tensor on the same memory, not a view of ``x``

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _writable_output(_: nn.Module, __: Any, output: Any) -> Any:
    """A TP style hands its output back as a view (DTensor.to_local), which a model's own code
    may not change in place (Llama4's MoE adds its experts into its shared expert's row-
    parallel output: "a view ... is being modified inplace"): the same memory, writable."""
    if isinstance(output, torch.Tensor) and not isinstance(output, DTensor) and (
            type(output.grad_fn).__name__ == "_ToTorchTensorBackward"):
        return _Writable.apply(output)
    return output


def _refuse_linear_styles_on_conv1d(model: nn.Module, styles: Mapping[str, Any]) -> None:
    from meshlab.parallel.conv1d import is_conv1d

    for pattern, style in styles.items():
        name = type(style).__name__
        if name in ("ColwiseParallel", "RowwiseParallel") and any(
                is_conv1d(m) for n, m in model.named_modules() if name_matches(pattern, n)):
            raise ValueError(f"TP plan entry {pattern!r}: {name}() takes nn.Linear, and "
                             "this is transformers' Conv1D (an (in, out) weight, GPT-2's): "
                             "give 'colwise' / 'rowwise', or meshlab.parallel.conv1d's "
                             "Conv1DColwise() / Conv1DRowwise()")


def unmatched(model: nn.Module, plan: Mapping[str, Any]) -> list[str]:
    """The plan's patterns that name no module or parameter of ``model`` (``*`` stands for
    one part of a name, as both torch and transformers read it)."""
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    return [p for p in plan if not any(name_matches(p, n) for n in names)]


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The TP plan a model ships: transformers' ``_tp_plan`` (or its config's
    ``base_model_tp_plan``); ValueError naming the fix when it has none."""
    plan = getattr(model, "_tp_plan", None) or getattr(getattr(model, "config", None),
                                                      "base_model_tp_plan", None)
    if not plan and type(owner_of(model)).__name__ == "GPT2LMHeadModel":
        from meshlab.parallel.conv1d import gpt2_plan

        return gpt2_plan()
    if not plan:
        raise ValueError(_no_plan(model))
    return dict(plan)


def _no_plan(model: nn.Module) -> str:
    """The refusal of a model without a TP plan, with one built from its own Linears."""
    from meshlab.parallel.tensor_suggest import render, suggested_plan

    said = f"{type(model).__name__} ships no tensor-parallel plan: pass ParallelPlan(tp_plan="
    styles = ("module patterns to transformers' style names or torch ParallelStyles "
              "(* stands for one part of a name), to parallelize or to a dry run "
              "(dryrun(..., plan=), %mesh dryrun ... --plan NAME)")
    found = suggested_plan(model)
    if found is None:
        return said + "{'blocks.*.attn.q': 'colwise', 'blocks.*.attn.o': 'rowwise', ...}), " \
            + styles
    first, plan = found
    fused = ("; FusedColwise, LocalSizes: from meshlab.parallel.fused import FusedColwise, "
             "LocalSizes" if any("Fused" in s for s in plan.values()) else "")
    return (f"{said}{render(plan)}), read off the Linear layers of {first}: check it "
            "('colwise' into the heads or the hidden layer, 'rowwise' back to the residual "
            f"stream{fused}), and add the embedding and head if you split them; {styles}")


def sequence_parallel_plan(model: nn.Module, plan: Mapping[str, str], *,
                           regather: bool = True) -> dict[str, Any]:
    """Sequence parallelism added to a plan in transformers' style names: the residual
    stream is split along the sequence (Shard(1)) where it enters the first block, and stays
    split between the parallel regions; the blocks' norms and the final norm run on their
    part of it (SequenceParallel), and the sequence is gathered once on the way into each
    module holding column-parallel projections (the attention, the MLP). Whatever the model
    does before its first block (adding positions, scaling) runs on the whole sequence, as
    it wrote it; the stream is kept as DTensors so code between blocks (a causal mask,
    rotary positions) reads the whole sequence's length. ``regather``: GatherSequence's."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1)
    sp: dict[str, Any] = {}
    for pattern, style in plan.items():
        if style == "embedding_rowwise":
            sp[pattern] = VocabParallelEmbedding(input_layouts=Replicate(),
                                                 output_layouts=Replicate())
        elif style == "rowwise":
            sp[pattern] = RowwiseParallel(output_layouts=seq, use_local_output=False)
        elif style == "rowwise_split_input":  # its input whole (after colwise_gather_output)
            sp[pattern] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                          use_local_output=False)
        elif style == "colwise_gather_output":
            sp[pattern] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        elif style == "colwise":
            owner = pattern.rpartition(".")[0]
            if owner.endswith(".*"):  # a projection right in the block: gather it alone
                sp[pattern] = ColwiseParallel(input_layouts=seq)
            else:  # the attention or the MLP: gather once on the way in
                sp[pattern] = ColwiseParallel()
                sp[owner] = GatherSequence(regather=regather)
        elif style in OWN_STYLES:
            continue  # applied with the named styles: it needs no layout
        else:
            raise ValueError(f"TP plan entry {pattern!r}: {style!r} has no sequence-parallel "
                             "form meshlab knows: pass sequence_parallel=False, or a torch-"
                             "style tp_plan with SequenceParallel() where you want it")
    for blocks in {p.partition(".*.")[0] for p in plan if ".*." in p}:
        first = model.get_submodule(f"{blocks}.0") if holds(model, f"{blocks}.0") else None
        if first is not None:
            sp[f"{blocks}.0"] = SplitSequence()
        outer = blocks.rpartition(".")[0]
        for name, child in (first.named_children() if first is not None else ()):
            if _is_norm(child):
                sp[f"{blocks}.*.{name}"] = SequenceParallel()
        for name, child in model.get_submodule(outer).named_children():
            if _is_norm(child):
                sp[f"{outer}.{name}" if outer else name] = SequenceParallel()
    return sp


class SplitSequence(ParallelStyle):
    """Before the first block: the whole sequence it gets becomes this rank's part of it, a
    DTensor split along the sequence (a slice; backward gathers the gradient whole)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def split(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                  ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            def part(x: Any) -> Any:
                if isinstance(x, DTensor) or not isinstance(x, torch.Tensor):
                    return x
                whole = DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                return whole.redistribute(placements=[Shard(1)])

            if args:
                return (part(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": part(kwargs["hidden_states"])}

        module.register_forward_pre_hook(split, with_kwargs=True)
        return module


class GatherSequence(ParallelStyle):
    """Before a module: every input split along the sequence is gathered whole (one
    all-gather; its backward reduces each rank's gradient back to its part), as plain
    tensors (``local``) or DTensors. ``regather``: what the module saves of it for backward
    is kept as this rank's part and gathered again there (meshlab.parallel.sp_regather)."""

    def __init__(self, *, local: bool = True, regather: bool = True) -> None:
        super().__init__()
        self.local, self.regather = local, regather

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        hooks = Regather() if self.regather else None

        def gather(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            def whole(x: Any) -> Any:
                if not (isinstance(x, DTensor) and Shard(1) in x.placements):
                    return x
                gathered: torch.Tensor = x.redistribute(placements=[Replicate()])
                if self.local:
                    gathered = cast(DTensor, gathered).to_local()
                if hooks is not None and torch.is_grad_enabled():
                    hooks.gathered_from(x, gathered)
                return gathered

            gathered = tuple(whole(a) for a in args), {k: whole(v) for k, v in kwargs.items()}
            if hooks is not None and hooks.gathered:
                hooks.enter()
            return gathered

        module.register_forward_pre_hook(gather, with_kwargs=True)
        if hooks is not None:  # always_call: a forward that raises must not leave them
            module.register_forward_hook(lambda *_: hooks.exit(), always_call=True)
        return module


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("Norm", "RMSNorm", "LayerNorm"))


def _is_meshlab(model: nn.Module) -> bool:
    from meshlab.models.llama import Transformer

    return isinstance(model, Transformer)


def _apply_meshlab_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool,
                      regather: bool = True) -> nn.Module:
    """Megatron's plan on meshlab's Transformer (a pipeline stage may lack some parts)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tp(cast(Any, model).cfg, tp_mesh.size())
    seq = Shard(1) if sequence_parallel else Replicate()
    root = {
        "tok_embeddings": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=seq),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
    }
    # a pipeline stage lacks the embedding, or the norm and output
    parallelize_module(model, tp_mesh, {k: v for k, v in root.items()
                                        if getattr(model, k, None) is not None})
    for block in cast(nn.ModuleDict, model.layers).values():
        plan: dict[str, Any] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
        }
        if hasattr(block.feed_forward, "w1") and not hasattr(block.feed_forward, "router"):
            plan |= {"feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                     "feed_forward.w2": RowwiseParallel(output_layouts=seq)}
        if sequence_parallel:
            plan |= {
                "attention_norm": SequenceParallel(),
                "ffn_norm": SequenceParallel(),
                # gather the sequence before the column-parallel projections
                "attention": GatherSequence(local=False, regather=regather),
                "feed_forward": GatherSequence(local=False, regather=regather),
            }
            if hasattr(block.feed_forward, "router"):
                # an MoE is not split by tp: it routes the whole sequence as plain tensors
                # on every tp rank (the same tokens, the same gradients) and hands back this
                # rank's part of it
                plan["feed_forward"] = PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                    use_local_input=True, output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),), use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
    return model
