"""Per-rank output grouped and deduplicated; errors summarised by rank."""

from __future__ import annotations

from meshlab.notebook.output import (
    CellResult,
    RankError,
    RankOutput,
    clean_traceback,
    render_groups,
)


def test_identical_output_collapses_and_different_output_groups_by_rank() -> None:
    assert render_groups({0: "x\n", 1: "x\n", 2: "x\n", 3: "x\n"}) == "[ranks 0-3] x"
    assert render_groups({0: "a\n", 1: "b\n", 2: "a\n", 3: ""}) == "[ranks 0,2] a\n[rank 1] b"
    assert render_groups({0: "a\nb\n", 1: "a\nb\n"}) == "[ranks 0-1]\na\nb"


def test_summary_groups_ranks_with_the_same_error() -> None:
    outputs = {r: RankOutput(r, status="ok") for r in range(4)}
    for r in (1, 3):
        outputs[r] = RankOutput(r, status="error", error=RankError("ValueError", "bad"))
    summary = CellResult([0, 1, 2, 3], outputs).summary()
    assert summary.splitlines() == ["2 of 4 ranks failed:", "  [ranks 1,3] ValueError: bad"]


def test_clean_traceback_drops_internal_frames() -> None:
    chunks = ["ValueError  Traceback", "Cell In[2], line 1\n----> 1 f()",
              "File /x/site-packages/ipyparallel/engine/kernel.py:10, in run\n  ...",
              "File /work/model.py:3, in f\n  raise ValueError", "ValueError: bad"]
    assert clean_traceback(chunks) == [chunks[0], chunks[1], chunks[3], chunks[4]]
