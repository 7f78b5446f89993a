"""Whether a model can take a layout: each refusal names the value and what it must be."""

from __future__ import annotations

from meshlab.plan.context_formulas import cp_refusal
from meshlab.plan.layout import DEFAULT_SCHEDULE, Layout
from meshlab.plan.shapes import ModelShape
from meshlab.schedules import check_virtual


def check(model: ModelShape, layout: Layout) -> None:
    """Raise ValueError naming what the layout cannot do with this model."""
    t = layout.tp
    for name, value in (("heads", model.heads), ("kv_heads", model.n_kv_heads),
                        ("ffn", model.ffn)):
        if value % t:
            raise ValueError(f"tp={t} must divide {name}={value} of {model.name}")
    check_virtual(layout.schedule, layout.virtual)  # a ScheduleError is a ValueError
    stages = layout.pp * layout.stages_per_rank
    if stages > model.layers:
        raise ValueError(f"pp={layout.pp} x {layout.stages_per_rank} stages per rank = {stages} "
                         f"stages, but {model.name} has {model.layers} layers")
    if model.seq_len % (2 * layout.cp if layout.cp > 1 else 1):
        raise ValueError(f"cp={layout.cp}: the sequence ({model.seq_len}) must split into "
                         f"2 x cp = {2 * layout.cp} chunks (load-balanced causal attention)")
    refused = cp_refusal(layout.context_parallel, heads=model.heads, kv_heads=model.n_kv_heads,
                         tp=t, cp=layout.cp)
    if refused:
        raise ValueError(f"{model.name}: {refused}")
    if layout.context_parallel == "chunked" and layout.cp > 1 and \
            model.seq_len % layout.cp_chunks:
        raise ValueError(f"cp_chunks={layout.cp_chunks} must divide the sequence "
                         f"({model.seq_len}) of {model.name}: use a power of two")
    if layout.ep > 1 and (not model.experts or model.experts % layout.ep):
        raise ValueError(f"ep={layout.ep} must divide the experts ({model.experts}) of "
                         f"{model.name}")
    if layout.pp == 1 and (layout.schedule != DEFAULT_SCHEDULE or layout.virtual != 1):
        raise ValueError("a schedule and virtual stages need pp > 1")
