"""Cluster profiles: the built-in ones, a user's file, and bad files named."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from meshlab.notebook import profiles


def test_builtin_local_profile_loads() -> None:
    p = profiles.load("local")
    assert (p.launcher, p.backend, p.ranks, p.cell_timeout) == ("local", "auto", None, None)


def test_unknown_profile_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster profile 'nope'.*available profiles "
                                         r"are local"):
        profiles.load("nope")


def test_profile_from_a_user_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[cluster]\nranks = 2\npg_timeout = 5\n[env]\nOMP_NUM_THREADS = 1\n')
    p = profiles.load(path)
    assert (p.name, p.ranks, p.pg_timeout, p.env) == ("mine", 2, 5, {"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("text, message", [
    ("[cluster]\nrnaks = 2\n", r"unknown \[cluster\] key\(s\) \['rnaks'\]"),
    ('[cluster]\nbackend = "mpi"\n', "backend 'mpi' is not one of"),
    ("[clusters]\n", r"unknown table\(s\)"),
])
def test_bad_profiles_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        profiles.load(path)


# -- multi-host profiles --------------------------------------------------------------------

SSH = '[cluster]\nlauncher = "ssh"\ncontroller_ip = "10.0.0.1"\n'


@pytest.mark.parametrize("text, message", [
    ('[cluster]\nlauncher = "ssh"\n', r'the ssh launcher needs the machines.*hosts = \["node1"'),
    ('[cluster]\nlauncher = "mpi"\n', r"the mpi launcher needs the machines"),
    ('[cluster]\nhosts = ["a", "b"]\n', r'the local launcher starts every rank on this machine'),
    (SSH + 'hosts = ["a", "a"]\n', r"names a host twice"),
    (SSH + 'hosts = "a,b"\n', r"hosts must be a list of names"),
    (SSH + 'hosts = ["a"]\nranks_per_host = 0\n', r"ranks_per_host must be >= 1"),
    ('[cluster]\nlauncher = "ssh"\nhosts = ["node1"]\n',
     r"controller_ip '127.0.0.1' is loopback, which engines on node1 cannot reach"),
])
def test_bad_multi_host_profiles_name_the_fix(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        profiles.load(path)


def test_ranks_split_evenly_over_the_hosts() -> None:
    p = profiles.from_dict("two", {"cluster": {"launcher": "ssh", "hosts": ["a", "b"],
                                               "ranks_per_host": 8, "controller_ip": "10.0.0.1"}})
    assert (p.ranks, p.per_host(16)) == (16, 8)
    with pytest.raises(ValueError, match=r"12 ranks, but 2 hosts x ranks_per_host=8 make 16"):
        p.per_host(12)
    free = profiles.from_dict("free", {"cluster": {"launcher": "mpi", "hosts": ["a", "b"],
                                                   "controller_ip": "10.0.0.1"}})
    assert free.per_host(6) == 3
    with pytest.raises(ValueError, match=r"5 ranks do not split evenly over 2 hosts .*"
                                         r"start a multiple of 2"):
        free.per_host(5)


def test_every_shipped_profile_loads_and_multi_host_ones_name_their_hosts() -> None:
    for name in ("local", "slurm", "ssh", "mpi", "ray"):
        p = profiles.load(name)
        assert p.launcher == name
    for name in ("ssh", "mpi"):
        p = profiles.load(name)
        assert p.hosts and p.ranks == len(p.hosts) * (p.ranks_per_host or 0)
        assert not profiles.is_loopback_host(p.controller_ip)


def test_the_launcher_is_told_where_each_hosts_ranks_go() -> None:
    import sys

    from meshlab.notebook.launch import launcher_traits

    ssh = profiles.from_dict("s", {"cluster": {"launcher": "ssh", "hosts": ["node1", "node2"],
                                               "controller_ip": "10.0.0.1", "fork": False}})
    traits = launcher_traits(ssh, 4)
    assert traits["engines"] == {"node1": 2, "node2": 2}
    assert traits["remote_python"] == sys.executable  # not the system's python3
    mpi = profiles.from_dict("m", {"cluster": {"launcher": "mpi", "hosts": ["a", "b"],
                                               "controller_ip": "10.0.0.1"},
                                   "launcher": {"mpi_args": ["--mca", "x", "y"]}})
    traits = launcher_traits(mpi, 6, cluster_id="c1", profile_dir="/p")
    assert traits["mpi_args"] == ["--host", "a:3,b:3", "--mca", "x", "y"]  # theirs extend
    assert traits["engine_args"] == ["--cluster-id=c1", "--profile-dir=/p"]
    slurm = profiles.from_dict("s", {
        "cluster": {"launcher": "slurm", "hosts": ["n1", "n2"], "controller_ip": "10.0.0.1"},
        "launcher": {"queue": "gpu", "timelimit": "1:00:00", "options": "--gpus-per-task=1"}})
    traits = launcher_traits(slurm, 4)
    script = traits["batch_template"]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --nodelist=n1,n2",
                 "#SBATCH --partition=gpu", "#SBATCH --time=1:00:00",
                 "#SBATCH --gpus-per-task=1", "#SBATCH --ntasks={n}", "srun {program_and_args}"):
        assert line in script.splitlines(), script
    assert set(traits) == {"batch_template"}  # queue etc. live in the script, not twice


@pytest.mark.cluster  # (it names the missing piece before any engine starts)
def test_the_ray_profile_without_ray_installed_says_how_to_get_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from meshlab.notebook.cluster import Cluster
    from meshlab.notebook.errors import ClusterError

    monkeypatch.setitem(sys.modules, "ray", None)  # as where it is not installed
    with pytest.raises(ClusterError, match=r"profile 'ray' starts ranks on Ray, which is not "
                       r"installed here: pip install \"meshlab\[ray\]\""):
        Cluster(profile="ray").start(progress=False)
