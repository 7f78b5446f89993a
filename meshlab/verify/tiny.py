"""Prove a plan on a tiny copy of the user's own model before the real one trains.

``parallelize(model, mesh, plan, check="tiny")`` builds the same class with a shrunk config
(layers, width, heads, vocabulary and experts shrunk; sliding windows, attention chunks and
temperature floors scaled to the probe sequence so they still act), runs the same plan on the
same mesh for two steps beside one process (meshlab.verify.compare, in float64, or float32
under mixed precision, with SGD), and either says it was proved equal or raises, naming
what differs, before anything of the real model is split. A model written by hand has no
config to shrink: pass ``check=factory``, a function of a ``TinySize`` returning the same
kind of model at that size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from meshlab.parallel.compose import ParallelPlan
    from meshlab.verify.comparison import Comparison

SEQ = 16  # the probe sequence: windows, chunks and floors are scaled to act within it


@dataclass(frozen=True, slots=True)
class TinySize:
    """The size of a tiny copy: what a hand-written model's factory is given."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    experts: int


def size_for(mesh: DeviceMesh, plan: ParallelPlan, layers: int | None = None) -> TinySize:
    """The smallest size every axis of the mesh still divides (heads over tp x cp, experts
    over ep, layers over the pipeline's stages)."""
    from meshlab.mesh import axis_size

    tp, cp = axis_size(mesh, "tp"), axis_size(mesh, "cp")
    ep, pp = axis_size(mesh, "ep"), axis_size(mesh, "pp")
    split = max(8, 2 * tp * cp)
    stages = pp * plan.virtual if pp > 1 else 1
    return TinySize(layers=max(layers or 0, 2 * stages, 2), hidden=4 * split, heads=split,
                    kv_heads=max(split // 2, tp * cp), vocab=16 * tp * 4, experts=4 * ep)


# config field -> its tiny value (a TinySize attribute, or a constant); only fields the
# config has are set, so one table serves every family
FIELDS: dict[str, str | int] = {
    "num_hidden_layers": "layers", "n_layer": "layers", "num_layers": "layers",
    "hidden_size": "hidden", "n_embd": "hidden", "d_model": "hidden",
    "num_attention_heads": "heads", "n_head": "heads",
    "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads",
    "vocab_size": "vocab", "num_experts": "experts", "num_local_experts": "experts",
    "n_routed_experts": "experts",
    "intermediate_size": 64, "n_inner": 64, "intermediate_size_mlp": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 64, "n_positions": 64,
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
    "v_head_dim": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    # sequence features scaled into the probe sequence, so they still act there
    "sliding_window": SEQ // 4, "attention_chunk_size": SEQ // 4, "floor_scale": SEQ // 4,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
PER_LAYER = ("layer_types", "no_rope_layers", "moe_layers", "mlp_only_layers")
"""Lists with an entry per layer: recomputed by the config class from the rest."""


def tiny_copy(model: nn.Module, size: TinySize) -> Callable[[], nn.Module]:
    """A factory of ``model``'s class at ``size``, from its shrunk config (a transformers
    model); ValueError naming the fix for a model without one."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"check='tiny' shrinks a model's config, and {type(model).__name__} "
                         "has none: pass check=factory, a function of a "
                         "meshlab.verify.tiny.TinySize returning your model at that size")
    values = config.to_dict()
    for name in PER_LAYER:
        values.pop(name, None)
    for name, value in FIELDS.items():
        if name in values and values[name] is not None:
            values[name] = getattr(size, value) if isinstance(value, str) else value
    if "head_dim" in values and values["head_dim"] is not None:
        values["head_dim"] = size.hidden // size.heads
    if values.get("num_experts_per_tok"):
        values["num_experts_per_tok"] = min(2, size.experts)
    shrunk = type(config)(**values)
    shrunk._attn_implementation = getattr(config, "_attn_implementation", None)
    if getattr(config, "_experts_implementation", None):
        shrunk._experts_implementation = "eager"  # float64 runs take no grouped GEMM
    kind = type(model)
    return lambda: kind(copy.deepcopy(shrunk))


def prove(model: nn.Module, mesh: DeviceMesh, plan: ParallelPlan,
          factory: Callable[[TinySize], nn.Module] | None = None) -> Comparison:
    """Two steps of ``plan`` on a tiny copy beside one process; ValueError naming what
    differs, else the comparison (whose notes say it was proved on a tiny copy)."""
    from meshlab.verify.compare import compare_with_single_process

    # the blocks the split points name must exist in the copy too
    layers = max((int(p.rpartition(".")[2]) for p in plan.split_points or ()), default=-1) + 2
    size = size_for(mesh, plan, layers)
    make: Callable[[], nn.Module] = (
        (lambda: factory(size)) if factory is not None else tiny_copy(model, size))
    dtype = torch.float32 if plan.mixed_precision else torch.float64
    said = (f"a tiny copy of {type(model).__name__} ({size.layers} layers, width "
            f"{size.hidden}, {size.heads} heads, vocabulary {size.vocab}) under this plan, "
            "beside one process")
    try:
        result = compare_with_single_process(make, mesh, plan, steps=2, batch=8, seq=SEQ,
                                             vocab=size.vocab, dtype=dtype, optimizer="sgd")
    except ValueError:
        raise  # a refusal: it names the fix already
    except Exception as e:  # the plan broke the model's own forward: refused, not crashed
        raise ValueError(f"{said}: training it failed ({type(e).__name__}: {e}): fix the "
                         "plan before the real model trains (a TP plan that splits a layer "
                         "the model's code sizes from its config, say)") from e
    if not result.ok:
        raise ValueError(f"{said}: {result}\nfix the plan (or the model) before the real one "
                         "trains: the same would happen at full size")
    result.notes.insert(0, f"proved equal on {said}")
    return result
