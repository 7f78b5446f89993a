"""Recovery after a cell breaks the process group: meshlab notices, re-forms it (whatever the
backend raised) and says so, or names `%mesh restart`; the root-cause rank comes first."""

from __future__ import annotations

import pytest

from meshlab import Cluster, MeshError
from meshlab.notebook.export.journal import Journal
from meshlab.notebook.output import CellResult, RankError, RankOutput, strip_ansi
from meshlab.notebook.restore import destroys_default_group, plan

ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"


@pytest.mark.cluster
def test_a_rank_failing_inside_collectives_waited_out_is_shown_first_and_the_group_re_forms(
        cluster: Cluster) -> None:
    # no time limit: the user waits until gloo gives up on rank 2 (the 10 s group timeout)
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
