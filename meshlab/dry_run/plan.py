"""From the planner's words to what meshlab runs, for a dry run (meshlab.dry_run.run): a planner
``Layout`` becomes a ``ParallelPlan`` (and what it cannot map is said), a ``ModelShape``
becomes meshlab's Transformer, and a model's config becomes the planner's shape again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

from meshlab.plan.layout import Layout
from meshlab.plan.shapes import ModelShape, model_shape
from meshlab.schedules.builders import SPLIT_BACKWARD

if TYPE_CHECKING:
    from torch import nn

    from meshlab.parallel import ParallelPlan


def plan_for(layout: Layout, *, seq: int) -> tuple[ParallelPlan, list[str]]:
    """The ParallelPlan that runs a planner ``layout``, and what it cannot map (notes).

    zero 0/1/2/3 -> ddp/zero1/zero2/zero3 (none without data ranks, and with ep, where
    meshlab's expert parallelism reduces gradients itself); schedule, v, m -> the pipeline
    (without one, m is gradient accumulation); recompute -> activation checkpointing;
    bf16/fp8 -> mixed precision (fp16 with loss scaling); the context-parallel
    implementation, QAT, offload and replica sync as they are (the optimizer kind is
    dry_run_step's). Not mapped:
    fp8 matmuls (run as bf16: the same bytes), shard_unit=weight (FSDP2 shards per block),
    flash_attention=0 (the model's own attention runs), cp_balanced (meshlab's slices are
    contiguous: the same bytes), attention_kernel and overlap_grad_reduce (timing only),
    reduce_once=0 without a pipeline (meshlab's accumulation reduces once). reduce_once=0
    under a pipeline is ParallelPlan.reduce_every_microbatch, but with a zero-bubble
    schedule (its backward in halves: reduced once)."""
    from meshlab.parallel import ParallelPlan

    notes = []
    data_ranks = layout.dp * layout.cp
    dp = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[layout.zero]
    if layout.ep > 1:
        if layout.zero:
            notes.append(f"zero={layout.zero} with ep={layout.ep}: meshlab's expert parallel "
                         "all-reduces each gradient itself, nothing sharded (zero=0)")
        dp = "none"
    elif data_ranks == 1:
        dp = "none"
    if layout.precision == "fp8":
        notes.append("fp8: float8 matmuls are not applied; runs bf16 (the same bytes)")
    if layout.shard_unit == "weight" and layout.zero >= 2:
        notes.append("shard_unit=weight: FSDP2 shards one unit per block (shard_unit=layer)")
    if not layout.flash_attention:
        notes.append("flash_attention=0: the model's own attention kernel runs (SDPA keeps "
                     "no score matrix)")
    cp_impl = layout.context_parallel
    if layout.cp > 1 and layout.cp_balanced:
        notes.append("cp_balanced: meshlab holds contiguous sequence slices; the same bytes "
                     "move, the last rank's attention does more of the work")
    if cp_impl == "all_gather":  # Llama 3's, keeping only the local K/V: meshlab's is nearest
        notes.append("context_parallel=all_gather (Llama 3's): runs meshlab's all-gather, which "
                     "keeps the gathered K/V for backward")
        cp_impl = "meshlab"
    chunked: dict[str, Any] = ({"cp_chunks": layout.cp_chunks,
                                "cp_offload": layout.cp_offload} if cp_impl == "chunked" else {})
    if _accumulation_reduced_once(layout) and not layout.reduce_once:
        notes.append("reduce_once=0: meshlab's gradient accumulation holds FSDP2's reduction "
                     "back to the last micro-batch (reduce_once=1)")
    if _pipeline_reduced_once(layout) and not layout.reduce_once:
        notes.append(f"reduce_once=0 with schedule={layout.schedule}: its backward in halves "
                     "cannot reduce every micro-batch; torch's stage reduces once "
                     "(reduce_once=1)")
    mixed: bool | str = "fp16" if layout.precision == "fp16" else layout.precision != "fp32"
    pipelined = layout.pp > 1
    plan = ParallelPlan(
        data_parallel=dp, seq_len=seq,
        sequence_parallel=layout.sequence_parallel if layout.tp > 1 else None,
        sp_regather=layout.sp_regather,
        activation_checkpoint=layout.recompute,
        mixed_precision=mixed,
        context_parallel=cp_impl, **chunked,
        qat=None if layout.qat == "none" else layout.qat,
        pipeline_schedule=layout.schedule, virtual=layout.virtual,
        microbatches=layout.microbatches if pipelined else 1,
        grad_accum=1 if pipelined else layout.microbatches,
        reduce_every_microbatch=_reduces_every_microbatch(layout),
        offload_params=layout.offload_params, offload_activations=layout.offload_activations,
        replica_sync=layout.replica_sync, sync_every=layout.sync_every)
    return plan, notes


MODEL_OPTIONS = ("tp_plan", "blocks", "split_points")
"""What a ParallelPlan says about the model itself (its TP plan, its blocks, where a
pipeline splits it): a dry run takes them from the user's plan, the rest from the layout."""


def with_model_options(made: ParallelPlan, given: ParallelPlan | None) -> ParallelPlan:
    """``made`` (the layout's plan) with ``given``'s model options; ValueError where
    ``given`` sets anything else the layout decides otherwise."""
    if given is None:
        return made
    from meshlab.parallel import ParallelPlan

    if not isinstance(given, ParallelPlan):
        raise ValueError(f"plan={given!r} is a {type(given).__name__}, not a ParallelPlan: "
                         "give ParallelPlan(tp_plan=..., blocks=..., split_points=...)")

    default = ParallelPlan()
    clash = [f.name for f in dataclasses.fields(ParallelPlan)
             if f.name not in (*MODEL_OPTIONS, "seq_len")
             and getattr(given, f.name) != getattr(default, f.name)
             and getattr(given, f.name) != getattr(made, f.name)]
    if clash:
        said = ", ".join(f"{n}={getattr(given, n)!r}" for n in clash)
        decided = ", ".join(f"{n}={getattr(made, n)!r}" for n in clash)
        raise ValueError(f"plan sets {said}, which the layout decides otherwise ({decided}): "
                         "a dry run takes the model's options from the plan "
                         f"({', '.join(MODEL_OPTIONS)}) and the rest from the layout: say "
                         "them in the layout (zero=, sp=, ac=, m=, ...) or leave them out of "
                         "the plan")
    return dataclasses.replace(made, **{k: getattr(given, k) for k in MODEL_OPTIONS
                                        if getattr(given, k) is not None})


def ran(layout: Layout) -> Layout:
    """The layout ``plan_for``'s plan runs, in the planner's words (what it changes: ep's
    gradients reduced without ZeRO; FSDP2's units per block)."""
    changes: dict[str, Any] = {}
    if layout.ep > 1:
        changes["zero"] = 0
    if layout.shard_unit == "weight":
        changes["shard_unit"] = "layer"
    if ((_accumulation_reduced_once(layout) or _pipeline_reduced_once(layout))
            and not layout.reduce_once):
        changes["reduce_once"] = True
    return dataclasses.replace(layout, **changes) if changes else layout


def _pipelined_fsdp(layout: Layout) -> bool:
    """Whether meshlab runs ``layout``'s pipeline stages under FSDP2."""
    return layout.pp > 1 and layout.zero >= 2 and layout.ep == 1 and layout.dp * layout.cp > 1


def _reduces_every_microbatch(layout: Layout) -> bool:
    """Whether meshlab runs ``layout``'s pipeline with FSDP2 reducing every micro-batch."""
    return (_pipelined_fsdp(layout) and not layout.reduce_once
            and layout.schedule not in SPLIT_BACKWARD)


def _pipeline_reduced_once(layout: Layout) -> bool:
    """Whether ``layout``'s pipeline runs FSDP2 and cannot reduce every micro-batch."""
    return _pipelined_fsdp(layout) and layout.schedule in SPLIT_BACKWARD


def _accumulation_reduced_once(layout: Layout) -> bool:
    """Whether meshlab runs ``layout``'s micro-batches as gradient accumulation under FSDP,
    whose reduction it holds back to the last one (``parallel.accumulate``)."""
    return layout.fsdp_accumulation and layout.ep == 1 and layout.dp * layout.cp > 1


def describe(layout: Layout) -> str:
    """Every field that differs from its default, as ``Layout.parse`` takes it back."""
    parts = []
    for f in dataclasses.fields(Layout):
        value = getattr(layout, f.name)
        if value != f.default:
            parts.append(f"{f.name}={int(value) if isinstance(value, bool) else value}")
    return " ".join(parts)


def model_factory(model: Callable[[], nn.Module] | ModelShape | str, seq: int | None,
                  tp_plan: Mapping[str, Any] | None = None
                  ) -> tuple[Callable[[], nn.Module], ModelShape | None, str, str, list[str]]:
    """(factory, the planner's shape of it or None, a name, whose code: meshlab,
    transformers or other, what its attention does beside the planner's count, its TP plan
    ``tp_plan`` or its own: ``attention_facts``)."""
    if isinstance(model, (str, ModelShape)):
        shape = model_shape(model)
        return (_meshlab_factory(shape, seq or shape.seq_len), shape, shape.name, "meshlab",
                [])
    if not callable(model):
        raise ValueError(f"model={model!r}: give a factory (a callable returning an "
                         "nn.Module), a ModelShape or a preset name")
    import torch

    from meshlab.models import Transformer

    with torch.device("meta"):
        probe = model()
    family = ("meshlab" if isinstance(probe, Transformer) else "transformers"
              if type(probe).__module__.startswith("transformers.") else "other")
    facts = attention_facts(probe, tp_plan) if family == "transformers" else []
    return model, shape_of(probe, seq), type(probe).__name__, family, facts


def attention_facts(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> list[str]:
    """What a block's attention does beside the planner's count: "whole" where the TP plan
    splits none of it (transformers' DeepSeek-V3 ships one without its MLA: every tp rank
    holds and runs it whole), "qk_norm" where it normalizes its queries and keys per head
    (Qwen3's, OLMo2's: the projections' outputs are kept for those norms)."""
    from meshlab.parallel.tensor import model_plan
    from meshlab.parallel.tensor_styles import name_matches

    attention = next((name for name, module in model.named_modules()
                      if type(module).__name__.endswith("Attention")), None)
    if attention is None:
        return []
    names = [f"{attention}.{n}" for n, _ in model.get_submodule(attention).named_modules() if n]
    facts = ["qk_norm"] if {"q_norm", "k_norm"} <= {n.rpartition(".")[2] for n in names} else []
    try:
        plan = tp_plan or model_plan(model)
    except ValueError:  # no plan: refused where tp is used, with the fix
        return facts
    # a plan names modules from the model or from its base model (transformers' two plans)
    split = any(name_matches(p, n) or name_matches(p, n.partition(".")[2])
                for p in plan for n in names)
    return facts if split else ["whole", *facts]


def _meshlab_factory(shape: ModelShape, seq: int) -> Callable[[], nn.Module]:
    """meshlab's Transformer at ``shape``'s widths; ValueError for what it cannot build."""
    lacks = [what for what, has in (("a GELU MLP", not shape.gated_ffn),
                                    ("tied embeddings", shape.tied_embeddings),
                                    ("learned positions", shape.learned_positions),
                                    ("dropout", shape.dropout),
                                    (f"heads {shape.head_width} wide on a hidden of "
                                     f"{shape.hidden}", shape.head_width * shape.heads
                                     != shape.hidden),
                                    ("shared experts", shape.shared_ffn),
                                    ("multi-head latent attention", shape.kv_lora_rank))
             if has]
    if lacks:
        raise ValueError(f"{shape.name} has {', '.join(lacks)}, which meshlab's Transformer "
                         "(Llama-style) does not: pass a factory that builds the model, e.g. "
                         "lambda: transformers.AutoModelForCausalLM.from_config(config)")
    from meshlab.models import ModelConfig

    cfg = ModelConfig(dim=shape.hidden, n_layers=shape.layers, n_heads=shape.heads,
                      n_kv_heads=shape.n_kv_heads, vocab_size=shape.vocab,
                      ffn_hidden=shape.ffn, max_seq_len=seq, n_experts=shape.experts,
                      top_k=shape.top_k if shape.experts else 2)
    return partial(_transformer, cfg)  # a partial of a module's function: worker processes
    # can be sent it


def _transformer(cfg: Any) -> nn.Module:
    from meshlab.models import Transformer

    return Transformer(cfg)


def shape_of(model: nn.Module, seq: int | None = None) -> ModelShape | None:
    """The planner's shape of a meshlab Transformer or a transformers decoder (from its
    config), or of a hand-written one (from its modules: meshlab.dry_run.shape_from_modules); None
    for a model whose shape it cannot read."""
    from torch.nn import LayerNorm  # the model is a torch module: torch is loaded

    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "n_layers"):
        return ModelShape.from_config(cfg, seq_len=seq, name=type(model).__name__)
    c: Any = getattr(model, "config", None)
    try:
        return ModelShape.from_transformers(
            c, seq_len=seq, name=getattr(c, "model_type", None) or type(model).__name__,
            layer_norm=any(isinstance(m, LayerNorm) for m in model.modules()))
    except (AttributeError, TypeError, ValueError):
        from meshlab.dry_run.shape_from_modules import shape_from_modules

        return shape_from_modules(model, seq)  # a hand-written model
