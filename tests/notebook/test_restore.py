"""Faults and recovery: %mesh restart replays the session, from the start or a checkpoint;
%mesh stacks and the flight recorder on a hang; %mesh debug after a failed cell.

The restart tests kill a rank of their own 2-rank cluster (the shared one stays whole) and
check that training continues with exactly the losses of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from meshlab import Cluster, MeshError
from meshlab.notebook.export import Journal, select
from meshlab.notebook.output import first_mismatch, postmortem_text, stacks_text, strip_ansi
from meshlab.notebook.restore import ReplayError, RestoreError, plan

# -- the replay plan, without a cluster --------------------------------------------------------


def session() -> Journal:
    j = Journal(world_size=2, backend="gloo")
    j.record_mesh("dp=2", 1)
    j.record_cell("model = make()\noptimizer = opt(model)\nstep = 0", 2)
    j.record_cell("def train(n): ...", 3)
    j.record_cell("train(3)\nstep += 3", 4, trained=True)
    j.record_checkpoint("save(...)", 5, "save", "/ckpt")
    j.record_cell("train(1)", 6, trained=True)
    j.record_cell("# meshlab: skip\nprint(step)", 7)
    return j


def test_a_restart_replays_every_entry_but_checkpoint_saves() -> None:
    assert [e.number for e in plan(session()).entries] == [1, 2, 3, 4, 6, 7]


def test_upto_and_the_restore_point_mark_choose_where_the_replay_stops() -> None:
    j = session()
    assert [e.number for e in plan(j, upto=3).entries] == [1, 2, 3]
    j.record_cell("# meshlab: restore-point\nx = 1", 8)
    j.record_cell("y = 2", 9)
    assert [e.number for e in plan(j).entries][-1] == 8
    assert [e.number for e in plan(j, upto=9).entries][-1] == 9  # --upto wins over the mark
    with pytest.raises(RestoreError, match=r"--upto 42: no recorded cell ran as In \[42\]"):
        plan(j, upto=42)


def write_manifest(folder: Path, **extra: Any) -> None:
    folder.mkdir()
    import json

    (folder / "meshlab.json").write_text(json.dumps(
        {"names": ["model", "optimizer", "step"], "extra": extra}))


def test_from_a_checkpoint_the_cells_that_trained_before_it_are_skipped(tmp_path: Path) -> None:
    j = session()
    write_manifest(tmp_path / "ckpt", session=j.session, cell=5)
    steps = plan(j, checkpoint=str(tmp_path / "ckpt"))
    assert [e.number for e in steps.entries] == [1, 2, 3, 6, 7]
    assert [e.number for e in steps.skipped] == [4]
    assert steps.load is not None and "meshlab.checkpoint.sharded.load(" in steps.load.code
    # a cell that trains but also builds a saved name runs: the load then overwrites it
    j.entries[2] = type(j.entries[2])("cell", 2, "model = make()\ntrain(1)", trained=True)
    assert 2 in [e.number for e in plan(j, checkpoint=str(tmp_path / "ckpt")).entries]


def test_a_checkpoint_from_elsewhere_or_half_written_is_refused_with_the_fix(
        tmp_path: Path) -> None:
    write_manifest(tmp_path / "other", session="someone-else", cell=5)
    with pytest.raises(RestoreError, match=r"not saved in this session.*checkpoint load"):
        plan(session(), checkpoint=str(tmp_path / "other"))
    (tmp_path / "half").mkdir()
    with pytest.raises(RestoreError, match=r"incomplete checkpoint.*interrupted"):
        plan(session(), checkpoint=str(tmp_path / "half"))
    with pytest.raises(RestoreError, match="no checkpoint at"):
        plan(session(), checkpoint=str(tmp_path / "missing"))


def test_steps_replay_one_by_one_and_export_as_one_whole_step() -> None:
    j = Journal(world_size=2)
    j.record_cell("x = 1", 1)
    j.record_pipeline("model", __import__("meshlab.schedules").schedules.build(
        "gpipe", ranks=2, microbatches=2), 2)
    j.record_step(3, slots=2)
    j.record_step(4, slots=None)
    assert [e.redo and (e.redo[0], e.redo[1].get("slots")) for e in plan(j).entries] == [
        None, ("pipeline", None), ("step", 2), ("step", None)]
    assert [e.note for e in select(j)] == ["", "%mesh pipeline model", "%mesh step"]


def test_the_first_collective_the_ranks_issued_differently_is_named() -> None:
    def call(seq: int, op: str, size: int, group: str = "default_pg", state: str = "done"
             ) -> dict[str, Any]:
        return {"seq": seq, "op": op, "sizes": [[size]] if size else [], "group": group,
                "state": state}

    same = [call(1, "all_reduce", 4), call(2, "broadcast", 4)]
    assert first_mismatch({0: same, 1: same}) is None
    skipped = {0: [*same, call(3, "all_reduce", 8)], 1: same, 2: [*same, call(3, "all_reduce", 8)]}
    assert first_mismatch(skipped) == ("ranks part at collective #3 on default_pg: "
                                       "[ranks 0,2] all_reduce[8] · [rank 1] never issued it")
    sizes = {0: [call(7, "all_reduce", 8, state="in flight")],
             1: [call(7, "all_reduce", 3, state="in flight")]}
    assert "[rank 0] all_reduce[8] · [rank 1] all_reduce[3]" in (first_mismatch(sizes) or "")
    # a rank whose history no longer reaches back that far, or outside the group, is not blamed
    assert first_mismatch({0: [call(1, "x", 1), call(2, "y", 1)], 1: [call(2, "y", 1)]}) is None
    assert first_mismatch({0: [call(1, "x", 1, "mesh_tp")], 1: [call(1, "y", 1)]}) is None
    # a collective every rank finished is not where they part: a scatter's root alone passes
    # the list (after an interrupted checkpoint save, it was blamed)
    finished = {0: [call(6, "scatter", 32)], 1: [call(6, "scatter", 0)]}
    assert first_mismatch(finished) is None
    assert first_mismatch({**finished, 1: [call(6, "scatter", 0, state="in flight")]})


def test_stacks_group_identical_ranks_and_name_the_silent_ones() -> None:
    text = stacks_text({0: "File cell 1\n  wait()", 1: "File cell 1\n  wait()",
                        3: "File cell 2\n  go()"}, {}, [0, 1, 2, 3])
    assert text == ("[ranks 0-1]\nFile cell 1\n  wait()\n[rank 3]\nFile cell 2\n  go()\n"
                    "[rank 2] did not answer (dead, or its process is frozen)")
    assert postmortem_text(1, None) == "rank 1 has no failed cell to examine"


# -- on the shared cluster ---------------------------------------------------------------------

@pytest.mark.cluster
def test_a_hang_shows_each_ranks_last_collectives_and_where_they_part(cluster: Cluster) -> None:
    with pytest.raises(MeshError) as failed:
        cluster.run("x = torch.ones(4)\ndist.all_reduce(x)\n"
                    "if rank != 2:\n    dist.all_reduce(torch.ones(8))", timeout=3)
    summary = failed.value.result.summary()
    assert "last collectives per rank (flight recorder" in summary
    assert "never issued it" in summary and "[rank 2]" in summary
    assert "all_reduce[8]" in summary, summary
    cluster.run("dist.barrier()")  # the next cell waits out the hang and re-forms the group


@pytest.mark.cluster
def test_mesh_stacks_answers_while_a_cell_is_still_running(shell: Any) -> None:
    cluster = shell.magics_manager.registry["MeshMagics"].session.cluster
    errors: list[BaseException] = []

    def slow_cell() -> None:
        try:
            cluster.run("import time\ndef wait_here():\n    time.sleep(3 if rank != 1 else 0)\n"
                        "wait_here()")
        except BaseException as e:  # the assertion below reports it
            errors.append(e)

    running = threading.Thread(target=slow_cell)
    running.start()
    time.sleep(1.5)
    with capture_output() as cap:
        shell.run_line_magic("mesh", "stacks")
    running.join()
    assert not errors
    assert "[ranks 0,2-3]" in cap.stdout and "wait_here()" in cap.stdout, cap.stdout


@pytest.mark.cluster
def test_mesh_debug_shows_the_failing_frame_of_one_rank(shell: Any) -> None:
    cell = ("%%mesh\ndef scale(batch, factor):\n    scaled = batch * factor\n"
            "    if rank == 3:\n        raise ValueError(f'bad factor {factor}')\n"
            "    return scaled\nscale(torch.arange(3), 7)")
    assert not shell.run_cell(cell).success
    with capture_output() as cap:
        shell.run_line_magic("mesh", "debug 3")
    assert "rank 3: ValueError: bad factor 7" in cap.stdout
    assert re.search(r"variables in Cell In\[\d+\], line 4, in scale", cap.stdout), cap.stdout
    assert "factor = 7" in cap.stdout and "scaled = Tensor(shape=(3,)" in cap.stdout
    with pytest.raises(UsageError, match=r"out of range|rank 9"):
        shell.run_line_magic("mesh", "debug 9")


# -- restart on a cluster of its own -----------------------------------------------------------

SETUP = """%%mesh
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank, train

torch.manual_seed(0)
cfg = ModelConfig()
plan = ParallelPlan(data_parallel="ddp")
model = parallelize(Transformer(cfg), mesh, plan)
optimizer = build_optimizer(model, mesh, plan, lr=0.01)
step, losses = 0, []
"""

TRAIN = """%%mesh
def fit(n):
    global step
    dp_rank, dp_ranks = data_rank(mesh)
    batches = [local_batch(step=step + s, batch=4, seq=16, vocab=cfg.vocab_size, rank=dp_rank,
                           ranks=dp_ranks) for s in range(n)]
    losses.extend(train(model, optimizer, batches, average_over=mesh["dp"].get_group()))
    step += n
"""


@pytest.fixture
def own(shell: Any, test_profile: Path) -> Iterator[Any]:
    """The shell driving a fresh 2-rank cluster; the shared one is put back afterwards."""
    session = shell.magics_manager.registry["MeshMagics"].session
    shared, journal = session.cluster, session.journal
    session.cluster = None
    try:
        with capture_output():
            shell.run_line_magic("mesh", f"start 2 --profile {test_profile}")
        yield shell
    finally:
        if session.cluster is not None:
            session.cluster.stop()
        session.cluster, session.journal, session.bound_pipeline = shared, journal, None


def run(shell: Any, *cells: str) -> str:
    with capture_output() as cap:
        for cell in cells:
            result = shell.run_cell(cell, store_history=True)
            assert result.success, (cell, cap.stdout, cap.stderr, result.error_in_exec)
    return cap.stdout


def kill_rank(shell: Any, rank: int) -> None:
    cluster = shell.magics_manager.registry["MeshMagics"].session.cluster
    os.kill(cluster._hosts[rank]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 10
    while rank not in cluster.dead() and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.cluster
def test_after_a_rank_dies_restart_replays_and_training_continues_identically(own: Any) -> None:
    session = own.magics_manager.registry["MeshMagics"].session
    run(own, "%mesh init dp=2", SETUP, TRAIN, "%%mesh\nfit(3)")
    before = own.run_line_magic("mesh", "pull losses")[0]
    assert [e.trained for e in session.journal.entries if e.kind == "cell"] == [False, False, True]

    kill_rank(own, 1)
    with capture_output() as cap:
        assert not own.run_cell("%%mesh\nfit(1)").success
    assert "`%mesh restart` starts fresh engines and replays" in cap.stdout + cap.stderr

    out = run(own, "%mesh restart", "%%mesh\nfit(2)")
    assert "replaying 4 recorded entries" in out and "session restored" in out
    # the start's time is its progress line's, its phases': the stop's is said apart
    found = re.search(r"stopped the old ranks in \d+\.\d s; 2 fresh ranks ready in (\d+\.\d) s "
                      r"\(controller (\d+\.\d) s, engines (\d+\.\d) s, process group "
                      r"(\d+\.\d) s\)", out)
    assert found, out
    total, *phases = (float(x) for x in found.groups())
    assert sum(phases) == pytest.approx(total, abs=0.15)  # up to rounding
    resumed = own.run_line_magic("mesh", "pull losses")[0]

    run(own, "%%mesh\nstep, losses = 0, []\ntorch.manual_seed(0)\n"  # the uninterrupted run
        "model = parallelize(Transformer(cfg), mesh, plan)\n"
        "optimizer = build_optimizer(model, mesh, plan, lr=0.01)\nfit(5)")
    uninterrupted = own.run_line_magic("mesh", "pull losses")[0]
    assert resumed[:3] == before
    assert resumed == uninterrupted  # bit for bit: deterministic data, model and order


@pytest.mark.cluster
def test_restart_from_a_checkpoint_skips_the_training_it_holds(own: Any, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run(own, "%mesh init dp=2", SETUP, TRAIN, "%%mesh\nfit(3)", f"%mesh checkpoint save {ckpt}",
        "%%mesh\nfit(1)")
    uninterrupted = own.run_line_magic("mesh", "pull losses")[0]
    kill_rank(own, 0)

    out = run(own, f"%mesh restart --from-checkpoint {ckpt}")
    assert "skipped: it trained" in out and "checkpoint load" in out
    assert own.run_line_magic("mesh", "pull step") == {0: 4, 1: 4}
    # losses is not in the checkpoint: after the load only the replayed fit(1) appended to it
    assert own.run_line_magic("mesh", "pull losses")[0] == uninterrupted[3:]


@pytest.mark.cluster
def test_a_replay_that_fails_says_where_and_keeps_what_ran(own: Any) -> None:
    run(own, "%%mesh\nimport os\nx = 1", "%%mesh\nassert not os.path.exists('/tmp/never')")
    session = own.magics_manager.registry["MeshMagics"].session
    first, last = (e.number for e in session.journal.entries)
    session.journal.record_cell("\n# on replay only\nraise RuntimeError('only on replay')", 99)
    session.journal.record_cell("y = 2", 100)
    with pytest.raises(ReplayError) as failed:
        own.run_line_magic("mesh", "restart")
    assert str(failed.value) == (
        "%mesh restart stopped at In [99] `# on replay only`, which failed on replay:\n"
        "  [ranks 0-1] RuntimeError: only on replay\n"
        "Not replayed: In [100].\n"
        f"The 2 ranks are up and hold the state of what was replayed before it (In [{first}], "
        f"[{last}]).\n"
        f"To go on: fix the cause and run `%mesh restart` again, or `%mesh restart --upto {last}` "
        f"to replay only up to In [{last}] and leave out the rest (run what you need of it by "
        "hand).")
    assert own.run_line_magic("mesh", "pull x") == {0: 1, 1: 1}
    with capture_output():  # the way on it names works
        own.run_line_magic("mesh", f"restart --upto {last}")
    assert own.run_line_magic("mesh", "pull x") == {0: 1, 1: 1}


@pytest.mark.notebook
def test_a_failed_replay_is_a_cell_error_that_stops_run_all(test_profile: Path,
                                                             tmp_path: Path) -> None:
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    data = tmp_path / "input.txt"
    data.write_text("tokens")
    cells = [f"%load_ext meshlab\n%mesh start 2 --profile {test_profile}",  # In [1]
             "%%mesh\nimport os",                                            # In [2]
             f"%%mesh\ntext = open({str(data)!r}).read()",                  # In [3]
             "%%mesh\nn = len(text)",                                        # In [4]
             f"import os\nos.remove({str(data)!r})",                        # In [5]
             "%mesh restart",                                                 # In [6]
             "print('Run All went on')",                                      # In [7]
             "%mesh stop"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    with pytest.raises(CellExecutionError):
        NotebookClient(nb, timeout=120, kernel_name="python3",
                       resources={"metadata": {"path": str(tmp_path)}}).execute()
    restart, after = nb.cells[5], nb.cells[6]
    error = next(o for o in restart.outputs if o.output_type == "error")
    assert error.ename == "ReplayError"
    shown = strip_ansi("\n".join(error.traceback))
    assert "ReplayError: %mesh restart stopped at In [3] `text = open(" in shown, shown
    assert ("`, which failed on replay:\n  [ranks 0-1] FileNotFoundError: [Errno 2] No such "
            f"file or directory: {str(data)!r}\nNot replayed: In [4].\nThe 2 ranks are up and "
            "hold the state of what was replayed before it (In [2]).\nTo go on: fix the cause "
            "and run `%mesh restart` again, or `%mesh restart --upto 2`") in shown, shown
    assert after.execution_count is None and not after.outputs
