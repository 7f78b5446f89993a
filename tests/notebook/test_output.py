"""Per-rank output grouped and deduplicated; errors summarised by rank."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshlab.notebook.cluster import Cluster
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

    def take_threads(self) -> tuple[list[object], dict[int, int]]:
        return [], {}


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


TICKER = """
import threading, sys
go, printed, later = threading.Event(), threading.Event(), threading.Event()
def tick():
    print('tick 0')  # still this cell's: a thread it started, while it runs
    go.wait(30)
    print('while the next cell runs')
    print('to stderr', file=sys.stderr)
    printed.set()
    later.wait(30)
    import meshlab.rank.cell_exec as cell_exec  # the cell that set it may still be ending:
    while cell_exec.running:                    # a loaded machine let it print into it
        time.sleep(0.01)
    time.sleep(0.2)  # and its reply sent
    print('between cells')
threading.Thread(target=tick, name='ticker', daemon=True).start()
time.sleep(0.2)
"""


@pytest.mark.cluster
def test_a_background_threads_printing_is_its_own_never_the_next_cells(cluster: Cluster) -> None:
    first = cluster.run("import time" + TICKER, ranks="0-1")
    assert first.outputs[0].stdout == "tick 0\n" and not first.threads
    second = cluster.run("go.set(); printed.wait(30); print('own')", ranks="0-1")
    assert {r: o.stdout for r, o in second.outputs.items()} == {0: "own\n", 1: "own\n"}
    ticker = second.threads["ticker"]
    assert ticker[1].stdout == "while the next cell runs\n" and ticker[1].stderr == "to stderr\n"
    assert "[ranks 0-1] thread 'ticker': while the next cell runs" in str(second)
    cluster.run("later.set()", ranks="0-1")
    time.sleep(1.0)  # 'between cells' is printed while no cell runs: kept for the next one
    third = cluster.run("print('own')", ranks="0-1")
    assert third.outputs[0].stdout == "own\n"
    printed_between = {r: o.stdout for r, o in third.threads.get("ticker", {}).items()}
    assert printed_between == {0: "between cells\n", 1: "between cells\n"}


@pytest.mark.cluster
def test_a_thread_flooding_between_cells_is_held_up_to_a_cap_and_the_rest_counted(
        cluster: Cluster) -> None:
    cluster.run("import meshlab.rank.cell_server as cs, threading; cs.THREADS_KEPT = 1000\n"
                "def flood(): print('x' * 4999)\n"
                "threading.Timer(0.2, flood).start()", ranks="2")
    try:
        time.sleep(0.6)  # the timer's thread prints while no cell runs
        result = cluster.run("print('own')", ranks="2")
    finally:
        cluster.run("cs.THREADS_KEPT = 8 * 2**20", ranks="2")
    assert result.outputs[2].stdout == "own\n" and result.threads_dropped == {2: 4999}
    assert ("[rank 2] … 4,999 characters printed by other threads while no cell ran were not "
            "kept") in result.truncated()


def test_cut_output_kept_on_disk_stays_within_its_budget(tmp_path: Path) -> None:
    """A long session's floods do not fill the disk: the oldest cells' files go first."""
    from meshlab.notebook.cell import CellRun
    from meshlab.notebook.cell_channel import RankReply, SentCell

    folders = []
    for _ in range(4):
        cell = SentCell("cell:1", [0, 1], {r: RankReply() for r in range(2)})
        cluster = _FakeCluster(tmp_path, _ChunkedChannel(cell, ["x\n" * 3000]))
        cluster.max_cut_output_bytes = 25_000  # each cell cuts 2 x 6,000 characters
        result = CellRun(cluster, cell, None, None).wait()  # type: ignore[arg-type]
        folders.append(Path(result.full_output or ""))
    assert [f.exists() for f in folders] == [False, True, True, True]
    assert (folders[-1] / "rank1.stdout").read_text() == "x\n" * 3000
