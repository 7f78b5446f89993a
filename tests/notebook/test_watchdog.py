"""No stray processes or ports: after `%mesh stop`, a kernel restart, or a kernel crash.

Each test counts the cluster's processes (controller, its children, engines, their nannies,
the watchdog) and the TCP ports they listen on while it runs, then checks that every one of
those processes is gone and none of those ports still listens. Other clusters may run on the
machine meanwhile (the session's 4-rank cluster, other test runs), so only processes and
ports attributed to the cluster under test count.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from jupyter_client import BlockingKernelClient, KernelManager

from meshlab import Cluster

GONE_WITHIN_S = 15.0


def _alive(proc: psutil.Process) -> bool:
    """Running and not a zombie (PID 1 in a container may never reap an orphan)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _descendants(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True) if _alive(p)]


def _ours() -> list[psutil.Process]:
    """This process's descendants, less the Jupyter kernels' trees: the tour runs its
    notebooks in kernels beside the tests (tests/tour/conftest.py), clusters and all."""
    theirs: set[int] = set()
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any("ipykernel" in part for part in child.cmdline()):
                theirs |= {child.pid, *(p.pid for p in _descendants(child.pid))}
    return [p for p in _descendants(os.getpid()) if p.pid not in theirs]


def _listening() -> dict[int, int | None]:
    """TCP port -> pid of each listening inet socket on this machine."""
    return {c.laddr.port: c.pid for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def _ports_of(procs: list[psutil.Process]) -> set[int]:
    pids = {p.pid for p in procs}
    return {port for port, pid in _listening().items() if pid in pids}


def _survivors(procs: list[psutil.Process], timeout: float = GONE_WITHIN_S
               ) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline()[:4])}")
        except psutil.Error:
            out.append(str(p.pid))
    return out


def _kinds(procs: list[psutil.Process]) -> dict[str, int]:
    """How many controller (with its forked children), engine and watchdog processes."""
    counts = {"controller": 0, "engine": 0, "watchdog": 0}
    for p in procs:
        try:
            line, name = " ".join(p.cmdline()), p.name()
        except psutil.Error:
            continue
        if "ipyparallel.controller" in line:
            counts["controller"] += 1
        elif ("ipyparallel.engine" in line and "nanny" not in line) or name == "ipengine":
            counts["engine"] += 1  # started as itself, or forked by a forkserver
        elif "meshlab.notebook.watchdog" in line:
            counts["watchdog"] += 1
    return counts


def _has_a_whole_cluster(procs: list[psutil.Process], engines: int = 2) -> bool:
    kinds = _kinds(procs)
    return kinds["controller"] >= 1 and kinds["engine"] == engines and kinds["watchdog"] == 1


def _assert_all_gone(procs: list[psutil.Process], ports: set[int],
                     baseline: dict[int, int | None], within: float = GONE_WITHIN_S) -> None:
    assert ports, "the cluster listened on no port: nothing was measured"
    deadline = time.monotonic() + within
    left = _survivors(procs, within)
    assert not left, f"{len(left)} of {len(procs)} cluster processes survive: {_describe(left)}"
    # a process's main thread is a zombie while its other threads (zmq's) still close its
    # sockets: a port may outlive it by moments, never past the deadline
    while (still := {port: pid for port, pid in _listening().items()
                     if port in ports and port not in baseline}) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not still, f"ports the cluster opened still listen (port: pid): {still}"


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:  # a failed test must not leave its strays to the next one
        if _alive(p):
            p.kill()


# -- the watchdog on its own, no cluster ---------------------------------------------------------

PARENT = """
import subprocess, sys, time
# a process in its own session with a child of its own, as ipyparallel's launchers start them
leader = subprocess.Popen(["sh", "-c", "sleep 60 & exec sleep 61"], start_new_session=True)
watchdog = subprocess.Popen([sys.executable, "-m", "meshlab.notebook.watchdog", str(leader.pid)],
                            stdin=subprocess.PIPE, start_new_session=True)
print(leader.pid, watchdog.pid, flush=True)
time.sleep(60)
"""


def test_watchdog_stops_its_processes_and_their_children_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    leader_pid, watchdog_pid = map(int, parent.stdout.readline().split())
    procs = [psutil.Process(leader_pid), psutil.Process(watchdog_pid)]
    deadline = time.monotonic() + 10
    while not (children := psutil.Process(leader_pid).children()) and \
            time.monotonic() < deadline:
        time.sleep(0.05)  # the shell forks its `sleep 60`
    procs += children
    try:
        assert len(procs) == 3, _describe(procs)
        parent.kill()
        parent.wait()
        left = _survivors(procs, timeout=10)
        assert not left, f"survivors: {_describe(left)}"
    finally:
        _kill(procs)


def test_a_killed_parents_cluster_file_is_removed_with_its_processes(tmp_path: Path) -> None:
    """What ipyparallel removes only on a clean stop: left, JupyterLab's ipyparallel
    extension logs the dead cluster every few seconds."""
    cluster_file = tmp_path / "cluster-1-abcd.json"
    cluster_file.write_text("{}")
    parent = subprocess.Popen([sys.executable, "-c", PARENT.replace(
        '"meshlab.notebook.watchdog", ', f'"meshlab.notebook.watchdog", "--remove", '
                                        f'{str(cluster_file)!r}, ')],
        stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    leader_pid, watchdog_pid = map(int, parent.stdout.readline().split())
    procs = [psutil.Process(leader_pid), psutil.Process(watchdog_pid)]
    try:
        time.sleep(0.5)  # the watchdog is watching
        assert cluster_file.exists()  # nothing removed while the parent lives
        parent.kill()
        parent.wait()
        assert not _survivors(procs, timeout=10)
        assert not cluster_file.exists()
    finally:
        _kill(procs)


# -- a real cluster ---------------------------------------------------------------------------


@pytest.mark.cluster
def test_mesh_stop_leaves_no_process_or_port(test_profile: Path) -> None:
    before = {p.pid for p in _ours()}
    baseline = _listening()
    cluster = Cluster(2, profile=test_profile).start(progress=False)
    procs = [p for p in _ours() if p.pid not in before]
    try:
        ports = _ports_of(procs)
        assert _has_a_whole_cluster(procs), _describe(procs)
        # A nanny lingers for seconds on its own (3 s when the controller has gone first):
        # stopped, it would never leave unless the watchdog finds it, however recently it
        # was forked and after the forkserver that forked it has gone
        nannies = [p for p in procs if p.name() == "ipengine-nanny"]
        assert nannies, _describe(procs)
        for nanny in nannies:
            nanny.send_signal(signal.SIGSTOP)
        cluster.stop()
        _assert_all_gone(procs, ports, baseline, within=1.0)
    finally:
        cluster.stop()
        _kill(procs)


Kernel = tuple[KernelManager, BlockingKernelClient]

SLURM_PROFILE = """
[cluster]
launcher = "slurm"
backend = "gloo"
pg_timeout = 10
start_timeout = 120
controller_ip = "127.0.0.1"
"""


@pytest.fixture
def kernel(tmp_path: Path) -> Iterator[Kernel]:
    """A real ipykernel, started by jupyter_client as a notebook server starts one."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _run(kernel: Kernel, code: str) -> str:
    """Execute a cell in the kernel; what it printed."""
    said: list[str] = []
    printed: list[str] = []

    def hook(msg: dict) -> None:
        said.append(str(msg["content"]))
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])

    reply = kernel[1].execute_interactive(code, timeout=180, output_hook=hook)
    assert reply["content"]["status"] == "ok", f"{code}: {said}"
    return "".join(printed)


def _start_mesh_in(kernel: Kernel, profile: Path, local_engines: int = 2
                   ) -> tuple[int, list[psutil.Process]]:
    """`%mesh start 2` in the kernel; its pid and the processes of the cluster it started."""
    _run(kernel, "%load_ext meshlab")
    _run(kernel, f"%mesh start 2 --profile {profile}")
    pid = kernel[0].provisioner.process.pid  # type: ignore[union-attr]
    procs = _descendants(pid)
    assert _has_a_whole_cluster(procs, local_engines), _describe(procs)
    return pid, procs


@pytest.mark.cluster
def test_graceful_kernel_restart_stops_the_cluster(kernel: Kernel, test_profile: Path) -> None:
    baseline = _listening()
    _, procs = _start_mesh_in(kernel, test_profile)
    try:
        ports = _ports_of(procs)
        kernel[0].restart_kernel(now=False)  # shutdown_request: the kernel's atexit runs
        _assert_all_gone(procs, ports, baseline)
    finally:
        _kill(procs)


@pytest.mark.cluster
def test_a_killed_kernel_takes_its_cluster_with_it(kernel: Kernel, test_profile: Path) -> None:
    baseline = _listening()
    pid, procs = _start_mesh_in(kernel, test_profile)
    try:
        ports = _ports_of(procs)
        os.kill(pid, signal.SIGKILL)  # a crash: no atexit, no shutdown message
        _assert_all_gone(procs, ports, baseline)
    finally:
        _kill(procs)


def _queued(job: str) -> bool:
    done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True,
                          text=True)
    return done.returncode == 0 and bool(done.stdout.strip())


@pytest.mark.cluster
@pytest.mark.slurm
def test_a_killed_kernel_cancels_its_slurm_job(kernel: Kernel, tmp_path: Path) -> None:
    profile = tmp_path / "slurm.toml"
    profile.write_text(SLURM_PROFILE)
    baseline = _listening()
    pid, procs = _start_mesh_in(kernel, profile, local_engines=0)  # engines: under slurmd
    _run(kernel, "%%mesh\nimport os\njob = os.environ['SLURM_JOB_ID']")
    (job,) = set(_run(kernel, "jobs = %mesh pull job\nprint(*set(jobs.values()))").split())
    try:
        assert _queued(job)
        ports = _ports_of(procs)
        os.kill(pid, signal.SIGKILL)
        _assert_all_gone(procs, ports, baseline)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _queued(job) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _queued(job), f"Slurm job {job} still runs after the kernel died"
    finally:
        _kill(procs)
        subprocess.run(["scancel", job], capture_output=True)
