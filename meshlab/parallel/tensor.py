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
    styles = {pattern: _style(pattern, style) for pattern, style in plan.items()}
    if sequence_parallel and not any(type(s).__name__ == "SequenceParallel"
                                     for s in styles.values()):
        raise ValueError("sequence_parallel=True, but the TP plan has no SequenceParallel "
                         "entry (transformers' plans keep norms replicated): pass "
                         "sequence_parallel=False, or a tp_plan with SequenceParallel() on the "
                         "norms and the layouts around them")
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


# transformers' style names, as torch ParallelStyles (integrations/tensor_parallel.py)
def _style(pattern: str, style: Any) -> Any:
    from torch.distributed.tensor import Replicate
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
    from torch.distributed.tensor import Replicate, Shard
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
