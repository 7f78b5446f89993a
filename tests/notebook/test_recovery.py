"""Recovery after a cell breaks the process group: meshlab notices, re-forms it (whatever the
backend raised) and says so, or names `%mesh restart`; the root-cause rank comes first. A cell
that will not stop climbs the ladder: SIGINT, meshlab's stop signal, `%mesh restart`."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest

from meshlab import Cluster, ClusterError, MeshError
from meshlab.notebook.export.journal import Journal
from meshlab.notebook.output import CellResult, RankError, RankOutput, strip_ansi
from meshlab.notebook.restore import destroys_default_group, plan

ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


@pytest.mark.cluster
def test_a_rank_failing_inside_collectives_waited_out_is_shown_first_and_the_group_re_forms(
        cluster: Cluster) -> None:
    # no time limit: the user waits until gloo gives up on rank 2 (the 6 s group timeout)
    loop = ("for i in range(400):\n    t = torch.ones(1000)\n    dist.all_reduce(t)\n"
            "    if rank == 2 and i == 10:\n        raise MemoryError('out of memory')")
    with pytest.raises(MeshError) as info:
        cluster.run(loop, timeout=120)
    result = info.value.result
    reasons = result.summary().splitlines()
    assert reasons[1].startswith("  [rank 2] MemoryError"), result.summary()
    assert strip_ansi(result.first_traceback()[0]) == "Traceback from rank 2:"
    assert "re-forms it before the next cell" in result.summary()
    after = cluster.run(ALL_REDUCE)
    assert after.results() == "Out[ranks 0-3]: 4.0"
    assert any("re-formed" in n for n in after.notes)


@pytest.mark.cluster
def test_a_barrier_only_rank_0_calls_waited_out_leaves_a_working_group(cluster: Cluster) -> None:
    with pytest.raises(MeshError) as info:
        cluster.run("if rank == 0:\n    dist.barrier()", timeout=120)
    assert info.value.result.failed == [0]
    assert cluster.run(ALL_REDUCE).results() == "Out[ranks 0-3]: 4.0"


@pytest.mark.cluster
def test_groups_made_by_some_ranks_only_do_not_deadlock_the_next_group(cluster: Cluster) -> None:
    made = cluster.run("if rank < 2:\n    g = dist.new_group([0, 1])")
    assert any("different numbers of process groups" in n and "%mesh init" in n
               for n in made.notes), made.notes
    # without a regroup first this deadlocks for good in ProcessGroupGloo's constructor
    after = cluster.run("g = dist.new_group([0, 1, 2, 3])\nt = torch.ones(1)\n"
                        "dist.all_reduce(t, group=g)\nt.item()", timeout=120)
    assert after.results() == "Out[ranks 0-3]: 4.0"
    assert any("re-formed the process group first" in n for n in after.notes), after.notes


@pytest.mark.cluster
def test_a_destroyed_default_group_is_re_formed_before_the_next_cell(cluster: Cluster) -> None:
    gone = cluster.run("dist.destroy_process_group()")
    assert any("destroyed" in n and "re-formed" in n for n in gone.notes), gone.notes
    assert cluster.run(ALL_REDUCE).results() == "Out[ranks 0-3]: 4.0"


@pytest.mark.cluster
def test_a_collective_that_times_out_while_the_cell_is_stopped_still_re_forms_the_group(
        test_profile: Path, tmp_path: Path) -> None:
    # the collective raises 2.5 s in, while meshlab stops the cell its 1 s limit ended (the
    # ladder's first SIGINT waits 2 s): the next cell used to run on the broken group
    profile = tmp_path / "short.toml"
    profile.write_text(test_profile.read_text().replace("pg_timeout = 6", "pg_timeout = 2.5"))
    with Cluster(2, profile=profile) as pair:
        with pytest.raises(MeshError) as info:
            pair.run("if rank == 1:\n    dist.all_reduce(torch.ones(1))", timeout=1)
        notes = info.value.result.notes
        assert any("meshlab stopped rank 1 inside a collective that returned only as the "
                   "cell ended" in n for n in notes), notes
        assert pair.run(ALL_REDUCE).results() == "Out[ranks 0-1]: 2.0"


def test_restart_replay_leaves_out_destroying_the_default_group_and_says_so() -> None:
    journal = Journal(4)
    journal.record_cell("x = 1", 1)
    journal.record_cell("dist.destroy_process_group()", 2)
    journal.record_cell("dist.destroy_process_group(group=sub)", 3)  # a subgroup: harmless
    steps = plan(journal)
    assert [e.number for e in steps.entries] == [1, 3]
    assert [e.number for e in steps.unsafe] == [2]
    assert destroys_default_group("import torch.distributed as d\nd.destroy_process_group(None)")


def test_the_root_cause_rank_comes_before_the_backend_errors_it_caused() -> None:
    gloo = RankError("RuntimeError", "[../gloo/transport/tcp/pair.cc:534] Connection closed "
                     "by peer [127.0.0.1]:123")
    outputs = {r: RankOutput(r, status="error", error=gloo) for r in range(4)}
    outputs[2].error = RankError("MemoryError", "out of memory")
    summary = CellResult([0, 1, 2, 3], outputs).summary().splitlines()
    assert summary[1] == "  [rank 2] MemoryError: out of memory"
    assert summary[2].startswith("  [ranks 0-1,3] RuntimeError")


# a cell that catches Ctrl-C's KeyboardInterrupt and goes on; with BaseException, one that
# catches meshlab's stop signal as well
SWALLOWS = "while True:\n    try:\n        time.sleep(.1)\n    except {}:\n        pass"


@pytest.mark.cluster
def test_a_rank_that_swallows_ctrl_c_is_named_with_its_stack_not_called_native_code(
        cluster: Cluster) -> None:
    code = ("import time\nif rank == 2:\n    while True:\n        try:\n"
            "            time.sleep(.1)\n        except KeyboardInterrupt:\n            pass\n"
            "else:\n    time.sleep(60)")
    with pytest.raises(MeshError) as info:
        cluster.run(code, timeout=1)
    summary = info.value.result.summary()
    assert ("[rank 2] CellStopped: still running after the 1 s time limit; ignored Ctrl-C: its "
            "stack is in `time.sleep(.1)` (Cell In[") in summary, summary
    assert "[ranks 0-1,3] still running after the 1 s time limit\n" in summary, summary
    assert "native code" not in summary and "process-group timeout" not in summary, summary


@pytest.mark.cluster
def test_the_stop_signal_ends_a_cell_that_swallows_ctrl_c_and_the_ranks_run_the_next(
        cluster: Cluster) -> None:
    with pytest.raises(MeshError) as info:
        cluster.run("import time\n" + SWALLOWS.format("(KeyboardInterrupt, Exception)"),
                    timeout=1)
    result = info.value.result
    assert {o.error.ename for o in result.outputs.values() if o.error} == {"CellStopped"}
    assert "meshlab's stop signal (SIGUSR2) ended the cell" in result.summary()
    assert "CellStopped: meshlab stopped the cell with SIGUSR2" in strip_ansi(
        "\n".join(result.first_traceback()))
    assert cluster.run(ALL_REDUCE, timeout=30).results() == "Out[ranks 0-3]: 4.0"


@pytest.mark.cluster
def test_ctrl_c_on_ranks_that_swallow_it_stops_them_with_the_stop_signal(
        cluster: Cluster) -> None:
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    with pytest.raises(MeshError) as info:
        cluster.run("import time\n" + SWALLOWS.format("KeyboardInterrupt"))
    assert "[ranks 0-3] CellStopped: ignored Ctrl-C: its stack is in `time.sleep(.1)`" in \
        info.value.result.summary()
    assert cluster.run("rank", timeout=30).results().startswith("Out[rank 0]: 0")


@pytest.mark.cluster
def test_ranks_that_ignore_the_stop_signal_too_need_restart_and_the_next_cell_says_so_at_once(
        test_profile: Path) -> None:
    with Cluster(2, profile=test_profile) as pair:  # its own: it needs a restart after
        with pytest.raises(MeshError) as info:
            pair.run("import time\n" + SWALLOWS.format("BaseException"), timeout=1)
        summary = info.value.result.summary()
        assert ("[ranks 0-1] still running after the 1 s time limit; ignored Ctrl-C and "
                "meshlab's stop signal (SIGUSR2): its stack is in `time.sleep(.1)` (Cell In["
                in summary), summary
        assert "only `%mesh restart` frees them" in summary
        # no time limit: before, the next cell waited out the process-group timeout first
        with pytest.raises(ClusterError, match=r"ranks 0-1 are still running an earlier cell "
                           r"that ignored Ctrl-C and meshlab's stop signal \(SIGUSR2\): its "
                           r"stack is in `time.sleep\(.1\)` .*only `%mesh restart` frees them"):
            pair.run("rank")
        pair.restart(progress=False)
        assert pair.run("rank").results() == "Out[rank 0]: 0\nOut[rank 1]: 1"


@pytest.mark.cluster
def test_the_next_cells_timeout_bounds_its_wait_for_ranks_stuck_in_a_collective(
        cluster: Cluster) -> None:
    # a group of its own whose timeout outlasts the first cell's stop under any load (the
    # shared cluster's 6 s could run out before the second cell looked)
    cluster.run("import datetime\nslow = dist.new_group(timeout=datetime.timedelta(seconds=9))")
    with pytest.raises(MeshError):
        cluster.run("if rank == 1:\n    dist.all_reduce(torch.ones(1), group=slow)", timeout=1)
    with pytest.raises(ClusterError) as info:
        cluster.run("rank", timeout=1)
    message = str(info.value)
    assert message.startswith("rank 1 is still stuck in native code (usually a collective) "
                              "from an earlier cell, at `dist.all_reduce(torch.ones(1), "
                              "group=slow)` (Cell In["), message
    assert "this cell's 1 s time limit ran out" in message and "`--timeout` longer" in message
    assert "`%mesh restart`" in message
    assert not cluster._wedged  # a longer limit still waits it out: both ways on are open
    after = cluster.run(ALL_REDUCE, timeout=60)
    assert after.results() == "Out[ranks 0-3]: 4.0"
    # rank 1 ended that cell on the SIGINT it saw when the collective returned: in a
    # collective, it was never sent the stop signal, which would have cut that short
    last = cluster.postmortem(1)
    assert last is not None and last["error"].startswith("KeyboardInterrupt"), last
