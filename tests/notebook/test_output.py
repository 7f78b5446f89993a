"""Per-rank output grouped and deduplicated; errors summarised by rank."""

from __future__ import annotations

from pathlib import Path

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


class _ChunkedChannel:
    """Stands in for the cell channel: each poll, every rank has printed one more chunk."""

    def __init__(self, cell: object, chunks: list[str]) -> None:
        self.cell, self.chunks, self.forgotten = cell, list(chunks), False

    def poll(self, timeout: float) -> bool:
        chunk = self.chunks.pop(0) if self.chunks else ""
        for got in self.cell.replies.values():  # type: ignore[attr-defined]
            got.stdout += chunk
            if not self.chunks:
                got.reply = {"status": "ok", "result": None, "optimizer_steps": 0}
        return True

    def forget(self, cell: object) -> None:
        self.forgotten = True


class _FakeCluster:
    def __init__(self, folder: object, channel: _ChunkedChannel) -> None:
        self.output_dir, self.max_output_lines, self.max_output_bytes = folder, 1000, 2**20
        self.cell_channel = channel

    def dead(self) -> dict[int, str]:
        return {}

    def cut_output_folder(self) -> Path:
        return Path(str(self.output_dir))


def test_a_flood_is_streamed_in_increments_and_capped_with_a_marker(tmp_path: object) -> None:
    from pathlib import Path

    from meshlab.notebook.cell import CellRun
    from meshlab.notebook.cell_channel import RankReply, SentCell
    from meshlab.notebook.output import LiveOutput

    lines = [f"step {i} loss 2.72\n" for i in range(20_000)]
    chunks = ["".join(lines[i:i + 500]) for i in range(0, len(lines), 500)]
    cell = SentCell("cell:1", [0, 1, 2, 3], {r: RankReply() for r in range(4)})
    channel = _ChunkedChannel(cell, chunks)
    live, sent = LiveOutput(), []

    def on_output(result: CellResult) -> None:
        before = live.sent
        live.update(result)
        sent.append(live.sent - before)

    run = CellRun(_FakeCluster(tmp_path, channel), cell, None, on_output)  # type: ignore[arg-type]
    result = run.wait()
    # each update carries only what is new (the 4 equal ranks once), never the whole so far
    assert max(sent) <= max(len(c) for c in chunks) + 100
    out = result.outputs[2]
    assert out.stdout.count("\n") == 1000 and out.dropped == {"stdout": 19_000}
    assert sum(len(o.stdout) for o in result.outputs.values()) <= 4 * len("".join(lines[:1000]))
    marker = result.truncated()
    assert "[ranks 0-3] … 19,000 more stdout lines not shown" in marker
    assert result.full_output is not None and result.full_output in marker
    assert (Path(result.full_output) / "rank2.stdout").read_text() == "".join(lines)
    assert "19,000 more stdout lines" in str(result)
    assert cell.replies[0].stdout == "" and channel.forgotten  # taken as it came, then let go


def test_sentences_about_one_rank_are_singular() -> None:
    from meshlab.notebook.ranks import ranks_are

    assert ranks_are([0]) == "rank 0 is" and ranks_are([2, 0]) == "ranks 0,2 are"


def test_one_line_longer_than_the_cap_shows_its_start_and_announces_the_rest(
        tmp_path: object) -> None:
    from meshlab.notebook.cell import CellRun
    from meshlab.notebook.cell_channel import RankReply, SentCell

    line = "Z" * 3 * 2**20  # one 3 MiB line, no newline: the cap counted newlines only
    cell = SentCell("cell:1", [0, 1], {r: RankReply() for r in range(2)})
    result = CellRun(_FakeCluster(tmp_path, _ChunkedChannel(cell, [line])),  # type: ignore[arg-type]
                     cell, None, None).wait()
    assert result.outputs[0].stdout == "Z" * 2**20  # the first MiB, the byte cap
    assert ("[ranks 0-1] … 2,097,152 more stdout characters not shown (one line longer than "
            "the cap)") in result.truncated()
    assert result.full_output is not None
    assert (Path(result.full_output) / "rank1.stdout").read_text() == line
