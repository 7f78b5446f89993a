"""Tensor parallel (Megatron-style) on the tp axis, with optional sequence parallelism.

On meshlab's Transformer: column-parallel q/k/v and gate/up projections, row-parallel
attention output and down projection, a vocab-parallel embedding and output. With sequence
parallelism the norms and residual stream are split along the sequence (Shard(1)) between
the parallel regions, so activations there cost 1/tp of the memory. On any other model: the
plan the model ships (transformers' ``_tp_plan``) or one given as torch-style
``{module pattern: ColwiseParallel() | RowwiseParallel() | SequenceParallel()}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle

from meshlab.parallel.blocks import holds

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
             plan: Mapping[str, Any] | None = None, axis: str = "tp") -> nn.Module:
    """Parallelize ``model`` over ``mesh[axis]`` with ``plan`` (torch-style: module pattern ->
    ColwiseParallel() | RowwiseParallel() | ..., or transformers' names "colwise", ...), or
    the model's own: meshlab's Megatron plan, or transformers' ``_tp_plan``.

    ``sequence_parallel``: None uses it where the plan has it (meshlab's does); True with a
    plan that has no SequenceParallel entry is refused, naming the fix."""
    tp_mesh = mesh[axis]
    if plan is None and _is_meshlab(model):
        return _apply_meshlab_tp(model, tp_mesh, sequence_parallel is not False)
    plan = plan if plan is not None else model_plan(model)
    if sequence_parallel and all(isinstance(style, str) for style in plan.values()):
        styles = sequence_parallel_plan(model, plan)
    else:
        styles = {pattern: _style(pattern, style) for pattern, style in plan.items()}
    if sequence_parallel and not any(type(s).__name__ == "SequenceParallel"
                                     for s in styles.values()):
        raise ValueError("sequence_parallel=True, but the TP plan has no SequenceParallel "
                         "entry: pass sequence_parallel=False, or a tp_plan with "
                         "SequenceParallel() on the norms and the layouts around them")
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, styles)
    return model


def model_plan(model: nn.Module) -> dict[str, Any]:
    """The TP plan a model ships: transformers' ``_tp_plan`` (or its config's
    ``base_model_tp_plan``); ValueError naming the fix when it has none."""
    plan = getattr(model, "_tp_plan", None) or getattr(getattr(model, "config", None),
                                                      "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} ships no tensor-parallel plan: pass "
                         "ParallelPlan(tp_plan={'layers.*.attn.q': ColwiseParallel(), ...}), "
                         "a dict of module pattern to torch ParallelStyle")
    return dict(plan)


def sequence_parallel_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, Any]:
    """Sequence parallelism added to a plan in transformers' style names: the residual
    stream stays split along the sequence (Shard(1)) between the parallel regions, the
    blocks' norms and the final norm run on their part of it (SequenceParallel), and the
    sequence is gathered once on the way into each module holding column-parallel
    projections (the attention, the MLP). The stream is kept as DTensors so code between
    (a causal mask, rotary positions) reads the whole sequence's length."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    seq = Shard(1)
    sp: dict[str, Any] = {}
    for pattern, style in plan.items():
        if style == "embedding_rowwise":
            sp[pattern] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                          use_local_output=False)
        elif style == "rowwise":
            sp[pattern] = RowwiseParallel(output_layouts=seq, use_local_output=False)
        elif style == "colwise_gather_output":
            sp[pattern] = ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        elif style == "colwise":
            sp[pattern] = ColwiseParallel()
            sp[pattern.rpartition(".")[0]] = GatherSequence()
        else:
            raise ValueError(f"TP plan entry {pattern!r}: {style!r} has no sequence-parallel "
                             "form meshlab knows: pass sequence_parallel=False, or a torch-"
                             "style tp_plan with SequenceParallel() where you want it")
    if not any(style == "embedding_rowwise" for style in plan.values()):
        raise ValueError("sequence_parallel=True needs the embedding in the TP plan (an "
                         "'embedding_rowwise' entry) to split the sequence: pass "
                         "sequence_parallel=False, or a torch-style tp_plan with "
                         "SequenceParallel()")
    for blocks in {p.partition(".*.")[0] for p in plan if ".*." in p}:
        first = model.get_submodule(f"{blocks}.0") if holds(model, f"{blocks}.0") else None
        outer = blocks.rpartition(".")[0]
        for name, child in (first.named_children() if first is not None else ()):
            if _is_norm(child):
                sp[f"{blocks}.*.{name}"] = SequenceParallel()
        for name, child in model.get_submodule(outer).named_children():
            if _is_norm(child):
                sp[f"{outer}.{name}" if outer else name] = SequenceParallel()
    return sp


class GatherSequence(ParallelStyle):
    """Before a module: every input split along the sequence is gathered whole (one
    all-gather; its backward reduces each rank's gradient back to its part)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(_gather_sequence, with_kwargs=True)
        return module


def _gather_sequence(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    def gather(x: Any) -> Any:
        if isinstance(x, DTensor) and Shard(1) in x.placements:
            return x.redistribute(placements=[Replicate()]).to_local()
        return x

    return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("Norm", "RMSNorm", "LayerNorm"))


# transformers' style names, as torch ParallelStyles (integrations/tensor_parallel.py)
def _style(pattern: str, style: Any) -> Any:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        ParallelStyle,
        RowwiseParallel,
        SequenceParallel,
    )

    if isinstance(style, ParallelStyle):
        return style
    named: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": ColwiseParallel, "rowwise": RowwiseParallel,
        "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
        "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
        "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate()),
        "sequence_parallel": SequenceParallel,
    }
    if style not in named:
        raise ValueError(f"TP plan entry {pattern!r}: {style!r} is not a torch ParallelStyle "
                         f"nor one of {', '.join(named)}: give ColwiseParallel(), "
                         "RowwiseParallel() or SequenceParallel()")
    return named[style]()


def _is_meshlab(model: nn.Module) -> bool:
    from meshlab.models.llama import Transformer

    return isinstance(model, Transformer)


def _apply_meshlab_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool
                      ) -> nn.Module:
    """Megatron's plan on meshlab's Transformer (a pipeline stage may lack some parts)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    check_tp(cast(Any, model).cfg, tp_mesh.size())
    seq = Shard(1) if sequence_parallel else Replicate()
    root = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
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
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                desired_input_layouts=(Replicate(), None)),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                   desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, plan)
    return model
