"""Tensor parallel (Megatron-style) on the tp axis, with optional sequence parallelism.

Column-parallel q/k/v and gate/up projections, row-parallel attention output and down
projection, a vocab-parallel embedding and output. With sequence parallelism the norms and
residual stream are split along the sequence (Shard(1)) between the parallel regions, so
activations there cost 1/tp of the memory.
"""

from __future__ import annotations

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


def apply_tp(model: nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = True,
             axis: str = "tp") -> nn.Module:
    """Parallelize the model's linear layers and embeddings over ``mesh[axis]``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp_mesh = mesh[axis]
    check_tp(model.cfg, tp_mesh.size())
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
