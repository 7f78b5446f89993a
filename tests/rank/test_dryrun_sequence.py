"""Activations in a dry run beside the planner where the sequence is not as long as the model
is wide.

The activation terms (meshlab.plan.activation_differences) were first held at Llama 3 8B's
widths with 4,096-token sequences and at 70B's with 8,192: tokens equal to hidden, where a
weight's gradient (hidden x ffn) and an intermediate (tokens x ffn) are the same size, so a
term could count one for the other unseen. Here 2,048 tokens at 4,096 wide tell them apart.

Where the step's peak is the loss's backward the terms are exact byte counts: the loss's
logits, and the final norm's and the output projection's inputs they keep beside them; the
dry run's figure is deterministic (fake tensors), and every row here is within 0.1%, so 1%
holds them. Where the peak falls inside a layer's backward the terms are not yet right at
this length (the MLP's backward is counted at two moments, not op by op): that case is held
as an expected failure with its figure, so that mending it is seen.
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


@pytest.mark.parametrize("layout", ["dp=8 zero=3", "dp_shard=4 tp=2 precision=fp32"])
def test_the_loss_backward_peak_is_counted_to_the_byte_at_any_length(layout: str) -> None:
    dry, explained = activations(layout)
    assert abs(explained / dry - 1) < 0.01, (dry, explained)


@pytest.mark.xfail(strict=True, reason="a layer's backward at 2,048 tokens, 4,096 wide: the "
                   "planner's terms are 7.5% short (3.19 GiB measured, 2.95 explained)")
def test_a_peak_inside_a_layers_backward_is_counted_at_any_length() -> None:
    dry, explained = activations("dp=8 zero=3 precision=fp32")
    assert abs(explained / dry - 1) < 0.05, (dry, explained)
