"""A long cell's progress: how long it has run and each rank's optimizer steps, shown while it
runs and ended on what the ranks replied; a short cell shows none."""

from __future__ import annotations

from typing import Any

from IPython.utils.capture import capture_output

from meshlab.notebook.cell_progress import SHOW_AFTER, CellProgress, RankProgress
from meshlab.notebook.progress_line import ProgressLine

# rank r takes 10 - 2r optimizer steps, half a second each: rank 3 is done after 2 s, rank 0
# runs 5 s, past the first showing
TRAINS = """import time
opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
for _ in range(10 - 2 * rank):
    time.sleep(0.5)
    opt.step()
"""


def outputs(cap: Any) -> list[tuple[str, bool, str]]:
    """(display id, whether an update, text) of each output the cell showed."""
    return [((o.transient or {}).get("display_id", ""), bool(o.update),
             o.data.get("text/plain", "")) for o in cap.outputs]


def test_a_long_cell_shows_each_ranks_steps_live_in_one_output_and_ends_on_the_truth(
        shell: Any) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session  # displays go to its shell
    seen: list[tuple[float, dict[int, tuple[str, int | None]], str]] = []
    line = ProgressLine("display")

    def watch(progress: CellProgress) -> None:
        seen.append((progress.elapsed, {r: (p.status, p.steps) for r, p in
                                        progress.ranks.items()}, progress.text()))
        line.update(progress)

    with capture_output() as cap:
        result = session.run(TRAINS, on_progress=watch)
        line.finish(result.progress)
    assert seen, "a 5 s cell showed no progress"
    times = [elapsed for elapsed, _, _ in seen]
    assert times[0] >= SHOW_AFTER and times == sorted(times)
    assert all(text.startswith(f"running {t:.1f} s on 4 ranks") for t, _, text in seen)
    # ranks counted live, part way through their steps
    live = [(text, f"step {steps}") for _, ranks, text in seen
            for r, (status, steps) in ranks.items()
            if status == "running" and steps and steps < 10 - 2 * r]
    assert any(step in text for text, step in live), seen
    assert any("[rank 3] done after" in text and "at step 4" in text for _, _, text in seen)

    final = result.progress
    assert final.ended and final.shown and final.elapsed >= times[-1]
    assert {r: p.steps for r, p in final.ranks.items()} == {0: 10, 1: 8, 2: 6, 3: 4}
    assert final.text() == (f"ran {final.elapsed:.1f} s on 4 ranks: [rank 0] step 10; "
                            "[rank 1] step 8; [rank 2] step 6; [rank 3] step 4")

    shown = outputs(cap)  # one output, updated in place, its last state the final one
    assert len({display_id for display_id, _, _ in shown}) == 1 and shown[0][0]
    assert not shown[0][1] and all(update for _, update, _ in shown[1:])
    assert shown[-1][2] == final.text()


def test_a_short_cell_shows_no_progress_at_all(shell: Any) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    calls: list[str] = []
    line = ProgressLine("display")
    with capture_output() as cap:
        result = session.run("import time\ntime.sleep(0.5)",
                             on_progress=lambda progress: calls.append(progress.text()))
        line.finish(result.progress)
    assert calls == [] and cap.outputs == [] and cap.stdout == cap.stderr == ""
    assert not result.progress.shown and result.progress.ended  # still there to read


def test_a_rank_that_does_not_answer_is_shown_as_such_with_its_last_step() -> None:
    progress = CellProgress({0: RankProgress(steps=12, seen=4.0),
                             1: RankProgress(steps=9, seen=3.0, waiting=5.2)}, elapsed=8.3)
    assert progress.text() == ("running 8.3 s on 2 ranks: [rank 0] step 12; "
                               "[rank 1] not answering for 5 s, last at step 9 (3 s in)")


def test_a_stopped_rank_ends_on_its_last_answer_not_a_count_it_never_sent() -> None:
    progress = CellProgress({0: RankProgress(steps=40, status="ok", replied=True),
                             1: RankProgress(steps=38, seen=50.0, status="timeout")},
                            elapsed=53.1, ended=True)
    assert progress.text() == ("ran 53.1 s on 2 ranks: [rank 0] step 40; [rank 1] stopped "
                               "at the time limit, last seen at step 38 (50 s in)")


def test_cells_that_count_no_steps_say_only_their_time() -> None:
    ranks = {r: RankProgress(steps=0) for r in range(4)}
    assert CellProgress(ranks, elapsed=4.0).text() == "running 4.0 s on 4 ranks"
    for p in ranks.values():
        p.status, p.replied = "ok", True
    assert CellProgress(ranks, elapsed=6.2, ended=True).text() == "ran 6.2 s on 4 ranks"
