"""meshlab's MoE in a dry run held to the planner at Mixtral's widths, every memory category.

The planner counts an MoE layer as a dense MLP top_k times as wide plus each token's routed
copies (Megatron's); meshlab's MoE keeps what meshlab.plan.moe_activation_differences names
beside it (its backward's peak: its experts' gradients as unbind's backward stacks them, or
the first expert's SwiGLU backward where few local experts take many pairs each; the whole
sequence under tp), and under tp beside FSDP2 its experts gathered and reduced whole. Four
layers at real widths, so that a layer, not the loss or the optimizer, makes the step's
peak. The figures are deterministic (fake tensors, even routing); every category of every
rank here is within 1.3% once the differences are applied, so 2% holds them where the
issue's 5% would let a term go missing unseen.
"""

from __future__ import annotations

import dataclasses

import pytest

from meshlab.dry_run.run import dryrun, planner_beside
from meshlab.plan import ModelShape
from meshlab.plan.reconcile import Row

MIXTRAL_LIKE = ModelShape(name="mixtral-like", layers=4, hidden=4096, heads=32, kv_heads=8,
                          ffn=14336, vocab=32000, seq_len=4096, experts=8, top_k=2)
TINY_MOE = ModelShape(name="tiny-moe", layers=4, hidden=256, heads=8, kv_heads=4, ffn=256,
                      vocab=1024, seq_len=64, experts=8, top_k=2)
# FSDP2 in bf16 (its unsharded gradients bf16) and expert parallelism in fp32 (in bf16 it
# runs under autocast: not compared), each beside tp and a pipeline
COMPARED = ["dp_shard=8", "dp_shard=8 ep=4 precision=fp32", "tp=2 dp_shard=4",
            "tp=2 dp_shard=4 ep=4 precision=fp32", "pp=2 tp=2 dp_shard=8 m=2",
            "pp=2 tp=2 dp_shard=8 ep=4 m=2 precision=fp32"]
CATEGORIES = {"params", "grads", "optimizer", "activations", "buffers"}


def memory_rows(model: ModelShape, layout: str) -> list[Row]:
    return [r for r in planner_beside(dryrun(model, layout, workers=1))
            if r.what == "memory" and r.name in CATEGORIES]


def activation_rows(model: ModelShape, layout: str) -> list[Row]:
    return [r for r in memory_rows(model, layout) if r.name == "activations"]


@pytest.mark.parametrize("layout", COMPARED)
def test_moe_memory_matches_the_planner_at_mixtral_widths(layout: str) -> None:
    rows = memory_rows(MIXTRAL_LIKE, layout)
    assert rows and all(r.comparable for r in rows)
    off = {(r.rank, r.name): (r.dry_run, round(r.explained), r.difference) for r in rows
           if abs(r.explained - r.dry_run) > 0.02 * max(r.dry_run, 2**20)}
    assert not off
    # the MoE's own terms, not a loose match: the planner's activations alone are >5% off
    assert any(abs(r.planner - r.dry_run) > 0.05 * r.dry_run for r in rows
               if r.name == "activations")


def test_autocast_is_not_compared_and_says_why() -> None:
    """16-bit compute without FSDP2 runs under autocast, which keeps a 16-bit copy of every
    weight for each micro-batch in flight: not reconciled, for a dense model or an MoE."""
    dense = dataclasses.replace(TINY_MOE, name="tiny", experts=0, top_k=1)
    for model, layout in ((TINY_MOE, "dp_shard=8 ep=4"), (dense, "dp=8 zero=0")):
        (row,) = activation_rows(model, layout)
        assert not row.comparable
        assert row.difference.startswith("not compared under autocast")
