"""A watchdog process that stops a cluster's processes when the notebook kernel dies.

ipyparallel starts the controller and every engine in a session of its own
(``start_new_session=True``) and stops them from an ``atexit`` hook. A kernel that exits
normally (a graceful restart) runs the hook; a killed kernel (a crash, the OOM killer, a
forced restart) does not, and its controller, engines and their children keep running
with their ports open (measured for 2 ranks: 13 processes, 25 listening ports).

So ``Cluster.start()`` starts this module as a small process of its own::

    python -m meshlab.notebook.watchdog [--cancel CMD...] PID...

in its own session (jupyter's kill of the kernel's process group does not reach it), with
a pipe from the kernel on its stdin. It sleeps in ``select`` and acts when

- its stdin reaches end of file: ``Cluster.stop()`` closed it, or the kernel died and the
  OS closed it;
- its parent changed: the kernel died (covers a pipe kept open by a forked child);
- every watched process and child is gone already (and there is no batch job to cancel).

It then sends SIGTERM to each watched process still alive, their descendants (also those
seen earlier that have left their parent, like an engine's nanny after the engine exits)
and every process of the sessions they lead, SIGKILL a few seconds later to what remains,
runs the ``--cancel`` commands (``scancel JOBID`` for engines in a Slurm job), removes the
``--remove`` files (the cluster's file in the ipyparallel profile, which ipyparallel removes
only from a clean stop: left behind, JupyterLab's ipyparallel extension logs "Controller ...
not running" for it every few seconds, for good), and exits.

Why not the alternatives: ``PR_SET_PDEATHSIG`` needs a ``preexec_fn`` that ipyparallel's
launchers do not take (a subclass of every launcher), is Linux-only, and fires when the
*thread* that forked exits, and ipyparallel starts processes from a background thread
inside a kernel; a watchdog thread in each engine would miss the controller and its
children, and cannot see the kernel from another host.

Plain Python and psutil: no IPython, no ipyparallel.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shlex
import signal
import subprocess
import sys
import time
import weakref
from typing import Any

import psutil

POLL_S = 0.5  # how soon a dead kernel is noticed
GRACE_S = 3.0  # SIGTERM to SIGKILL: a rank stuck in a collective ignores SIGTERM
SCAN_S = 2.0  # how often the processes' children are looked up (one pass over /proc)

# ipyparallel cluster object -> its watchdog; dropping the cluster closes the pipe
_watchdogs: weakref.WeakKeyDictionary[Any, subprocess.Popen[bytes]] = (
    weakref.WeakKeyDictionary())


def watch(ipp_cluster: Any) -> None:
    """Start a watchdog that stops ``ipp_cluster``'s processes if this process dies."""
    pids, cancel = _targets(ipp_cluster)
    if not pids and not cancel:
        return
    args = [sys.executable, "-m", "meshlab.notebook.watchdog"]
    for command in cancel:
        args += ["--cancel", shlex.join(command)]
    if getattr(ipp_cluster, "cluster_file", ""):
        args += ["--remove", ipp_cluster.cluster_file]
    _watchdogs[ipp_cluster] = subprocess.Popen(
        [*args, *map(str, pids)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL, start_new_session=True)


def release(ipp_cluster: Any, timeout: float = 2 * GRACE_S + 5) -> None:
    """The cluster was stopped: its watchdog sweeps up anything left over and exits."""
    proc = _watchdogs.pop(ipp_cluster, None)
    if proc is None:
        return
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _targets(ipp_cluster: Any) -> tuple[list[int], list[list[str]]]:
    """Local pids of the controller and engine launchers; commands that cancel batch jobs."""
    launchers = [ipp_cluster.controller] if ipp_cluster.controller is not None else []
    for engine_set in ipp_cluster.engines.values():
        launchers += [engine_set, *getattr(engine_set, "launchers", {}).values()]
    pids, cancel = [], []
    for launcher in launchers:
        process = getattr(launcher, "process", None)  # local (and ssh, mpiexec) processes
        if process is not None:
            pids.append(process.pid)
        job_id = getattr(launcher, "job_id", None)  # Slurm, PBS, SGE, LSF, HTCondor
        if job_id and getattr(launcher, "delete_command", None):
            cancel.append([*launcher.delete_command, str(job_id)])
    return pids, cancel


# -- the watchdog process ------------------------------------------------------------------------


def _alive(proc: psutil.Process) -> bool:
    # a zombie is dead: its ports are closed, and PID 1 in a container may never reap it
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _family(roots: list[psutil.Process]) -> dict[int, psutil.Process]:
    """The roots, their descendants and the members of the sessions they lead: one scan."""
    # Launchers use start_new_session=True, and a session outlives its leader (the
    # controller's children after a kill -9 of it). Linux does not reuse a pid while it
    # names a live session, so a leader's pid that is free, or still ours, names our session.
    leaders = {p.pid for p in roots if p.is_running() or not psutil.pid_exists(p.pid)}
    found = {p.pid: p for p in roots}
    children: dict[int, list[psutil.Process]] = {}
    for proc in psutil.process_iter(["ppid"]):
        children.setdefault(proc.info["ppid"], []).append(proc)
        with contextlib.suppress(OSError):
            if os.getsid(proc.pid) in leaders:
                found.setdefault(proc.pid, proc)
    parents = [p.pid for p in found.values() if _alive(p)]
    while parents:
        for child in children.get(parents.pop(), []):
            if child.pid not in found:
                found[child.pid] = child
                parents.append(child.pid)
    found.pop(os.getpid(), None)
    return found


def reap(procs: list[psutil.Process], cancel: list[str], grace: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL, the processes still alive; then run the cancel commands."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = [p for p in procs if _alive(p)]
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
        deadline = time.monotonic() + grace
        while (procs := [p for p in procs if _alive(p)]) and time.monotonic() < deadline:
            time.sleep(0.05)
    for command in cancel:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            subprocess.run(shlex.split(command), stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=30)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m meshlab.notebook.watchdog",
                                     description=__doc__)
    parser.add_argument("pids", nargs="*", type=int, help="processes to stop with the parent")
    parser.add_argument("--cancel", action="append", default=[],
                        help="a command to run when reaping, e.g. 'scancel 42'")
    parser.add_argument("--remove", action="append", default=[],
                        help="a file to remove once the processes are gone")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a kernel interrupt is not for us
    parent = os.getppid()
    roots = []
    for pid in args.pids:
        with contextlib.suppress(psutil.Error):
            roots.append(psutil.Process(pid))
    # Remembered, because a child outlives its parent: an engine's nanny lingers for seconds
    # after the engine exits, no longer its child and in a session of its own.
    family: dict[int, psutil.Process] = {}
    scanned = -SCAN_S
    while True:
        if time.monotonic() - scanned > SCAN_S:
            family.update(_family(roots))
            scanned = time.monotonic()
        readable, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break  # stop() closed the pipe, or the kernel died
        if os.getppid() != parent:
            break  # the kernel died; we were handed to init
        if not args.cancel and not any(_alive(p) for p in family.values()):
            break  # stopped without us
    family.update(_family(roots))
    reap(list(family.values()), args.cancel)
    for path in args.remove:  # (a clean stop removed it already)
        with contextlib.suppress(OSError):
            os.remove(path)


if __name__ == "__main__":
    main()
