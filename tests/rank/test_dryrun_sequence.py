"""Activations in a dry run beside the planner where the sequence is not as long as the model
is wide.

The activation terms (meshlab.plan.activation_differences) were first held at Llama 3 8B's
widths with 4,096-token sequences and at 70B's with 8,192: tokens equal to hidden, where a
weight's gradient (hidden x ffn) and an intermediate (tokens x ffn) are the same size, so a
term could count one for the other unseen. Here 2,048 tokens at 4,096 wide tell them apart.

Where the step's peak is the loss's backward the terms are exact byte counts: the loss's
logits, and the final norm's and the output projection's inputs they keep beside them. Where
it falls inside the stage's last layer's backward, they count that layer's highest moments
op by op (``layer_backward_bytes``: the gated product's backward, the attention's, the
projections' input gradients, the first norm's fp32 backward), with the output projection's
gradient FSDP holds from the loss's backward on; under full recomputation the layer being
recomputed saves all of it again there, beside every layer's kept input. The dry run's
figure is deterministic (fake tensors), and every row here is within 0.3%, so 1% holds them.
"""

from __future__ import annotations

import pytest

from meshlab.dry_run.run import dryrun, planner_beside
from meshlab.plan import ModelShape

HALF_SEQUENCE = ModelShape(name="llama-8b-widths", layers=4, hidden=4096, heads=32,
                           kv_heads=8, ffn=14336, vocab=32000, seq_len=2048)


def activations(layout: str) -> tuple[float, float]:
    """(dry run, planner with the named differences) of rank 0's activations."""
    row = next(r for r in planner_beside(dryrun(HALF_SEQUENCE, layout, workers=1))
               if r.what == "memory" and r.name == "activations" and r.rank == 0)
    assert row.comparable, row.difference
    return row.dry_run, row.explained


# DDP too: its buckets, real tensors its reducer made, once counted again as a temporary
# each time the fake group reduced one (a whole model's gradients at the step's end)
@pytest.mark.parametrize("layout", ["dp=8 zero=3", "dp_shard=4 tp=2 precision=fp32",
                                    "dp=8 zero=0 precision=fp32 ac=full"])
def test_the_loss_backward_peak_is_counted_to_the_byte_at_any_length(layout: str) -> None:
    dry, explained = activations(layout)
    assert abs(explained / dry - 1) < 0.01, (dry, explained)


# one stage: the peak in the last layer's gated product's backward; a pipeline's first
# stage (two micro-batches in flight, its output's gradient received): in its attention's
# backward, which its product's backward ties; in bf16, its first norm's backward, upcast to
# fp32; under full recomputation, in the recomputed layer's, each layer keeping its input
@pytest.mark.parametrize("layout", ["dp=8 zero=3 precision=fp32",
                                    "pp=2 dp_shard=4 m=4 precision=fp32", "pp=2 dp_shard=4 m=4",
                                    "dp=8 zero=3 precision=fp32 ac=full",
                                    "pp=2 dp_shard=4 m=4 precision=fp32 ac=full"])
def test_a_peak_inside_a_layers_backward_is_counted_at_any_length(layout: str) -> None:
    dry, explained = activations(layout)
    assert abs(explained / dry - 1) < 0.01, (dry, explained)
