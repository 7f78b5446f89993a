"""A host's ranks forked from one forkserver (the local profile's default): one process
imports torch and the engine, forks the ranks and their nannies, and reports how each ends."""

from __future__ import annotations

import logging
import os
import signal
import time

import psutil
import pytest

from meshlab import Cluster, ClusterError, MeshError
from meshlab.notebook import profiles
from meshlab.notebook.launch import launcher_traits

pytestmark = pytest.mark.cluster


def _rank_processes(cluster: Cluster) -> list[psutil.Process]:
    return [psutil.Process(int(pid)) for pid in cluster.status()["pid"]]


def test_the_ranks_are_forked_by_one_forkserver_that_imported_torch(cluster: Cluster) -> None:
    ranks = _rank_processes(cluster)
    parents = {p.ppid() for p in ranks}
    assert len(parents) == 1
    server = psutil.Process(parents.pop())
    assert "meshlab.notebook.forkserver" in " ".join(server.cmdline())
    assert server.ppid() == os.getpid()  # started by this process's launcher
    assert [p.name() for p in ranks] == ["ipengine"] * 4  # ps says what each one is
    # imported before the fork: a rank never imported torch itself
    assert cluster.run("import sys\n'torch' in sys.modules", keep_values=True).values == \
        dict.fromkeys(range(4), True)


def test_each_rank_has_a_forked_nanny_in_a_group_of_its_own(cluster: Cluster) -> None:
    ranks = _rank_processes(cluster)
    server = psutil.Process(ranks[0].ppid())
    nannies = [p for p in server.children() if p.name() == "ipengine-nanny"]
    assert len(nannies) == 4
    assert all(os.getpgid(p.pid) == p.pid for p in nannies)  # Ctrl-C to a rank skips them
    # in the forkserver's session: the watchdog finds them once the forkserver has gone
    assert all(os.getsid(p.pid) == os.getsid(server.pid) for p in nannies)
    # the nanny relays the time limit's SIGINT to its rank: the cell stops, the rank is free
    with pytest.raises(MeshError, match=r"still running after the 2 s time limit"):
        cluster.run("import time\ntime.sleep(600)", ranks="1", timeout=2)
    assert cluster.run("rank", ranks="1", timeout=30).results() == "Out[rank 1]: 1"


def test_a_forked_rank_that_dies_is_reported_with_its_signal(cluster: Cluster) -> None:
    pid = int(cluster.status().loc[3, "pid"])
    os.kill(pid, signal.SIGKILL)  # as the OOM killer does
    try:
        deadline = time.monotonic() + 30
        while 3 not in cluster.dead() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cluster.dead()[3] == "killed by SIGKILL"  # the forkserver reaped it, said how
        with pytest.raises(ClusterError, match=r"rank 3 died: killed by SIGKILL"):
            cluster.run("1")
    finally:
        cluster.restart()  # whole again for the tests that share it


def test_fork_is_refused_where_the_launcher_starts_each_rank_itself() -> None:
    with pytest.raises(ValueError, match=r"fork = true, but the slurm launcher starts each "
                                         r"rank itself.*remove fork"):
        profiles.from_dict("s", {"cluster": {"launcher": "slurm", "fork": True}})
    assert profiles.from_dict("s", {"cluster": {"launcher": "slurm"}}).fork is False
    assert profiles.from_dict("l", {"cluster": {}}).fork is True


def test_over_ssh_each_host_gets_one_login_and_one_forkserver() -> None:
    from meshlab.notebook.fork_launchers import SSHHostLauncher

    traits = launcher_traits(profiles.load("ssh"), 4)
    assert traits["hosts"] == {"node1": 2, "node2": 2}  # one login per host, not one per rank
    host = SSHHostLauncher(hostname="node1", ranks=2, remote_python="/venv/bin/python",
                           ssh_args=["-F", "cfg"], engine_args=["--log-level=40"])
    assert host.find_args() == [
        "ssh", "-F", "cfg", "node1", "/venv/bin/python -m meshlab.notebook.forkserver -n 2 "
        "--wait 120 --environment-on-stdin -- --log-level=40"]  # the key goes on stdin
    unforked = profiles.from_dict("u", {"cluster": {
        "launcher": "ssh", "hosts": ["a", "b"], "controller_ip": "10.0.0.1", "fork": False}})
    assert launcher_traits(unforked, 4)["engines"] == {"a": 2, "b": 2}


def test_ipyparallels_own_reader_loads_a_running_clusters_file(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """JupyterLab's ipyparallel extension reads every cluster file of a profile every few
    seconds: the fork launcher's class must read back (it logged "could not be imported")."""
    from ipyparallel.cluster.cluster import ClusterManager

    running = cluster._ipp
    manager = ClusterManager()
    with caplog.at_level(logging.WARNING):
        manager.load_clusters(profile_dirs=[running.profile_dir])
    loaded = [c for c in manager.clusters.values() if c.cluster_id == running.cluster_id]
    assert [c.engine_launcher_class for c in loaded] == [type(running.engines[k]) for k in
                                                         running.engines][:1]
    assert not [r.getMessage() for r in caplog.records
                if running.cluster_id in r.getMessage()]
