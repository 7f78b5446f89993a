"""ipyparallel launchers that start each host's ranks through one forkserver
(``meshlab.notebook.forkserver``): on this machine, and over ssh with one login per host.

Over ssh, ipyparallel's own launcher starts engines one at a time, each with five ssh round
trips (two of them start Python on the host) and an scp of the connection file. Here each
host gets one ``ssh HOST python -m meshlab.notebook.forkserver ...``, all hosts at once and
alongside the controller, so the logins and the hosts' imports overlap its start. The
cluster's connection (the engines' key among it) follows on that ssh's stdin once the
controller has written it, never on a command line, and the stdin stays open as a lifeline:
when the ssh ends (``%mesh stop``, a dead notebook, the watchdog) the forkserver on the host
stops its ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import threading
import time
from subprocess import PIPE, STDOUT, Popen
from typing import Any

import psutil
from ipyparallel.cluster.launcher import (
    EngineLauncher,
    LocalEngineSetLauncher,
    LocalProcessLauncher,
    SSHLauncher,
)
from traitlets import Dict, Float, Integer, List, Unicode

from meshlab.notebook import forkserver


class ForkEngineSetLauncher(LocalProcessLauncher, EngineLauncher):
    """n engines on this machine, forked from one process that imported torch and the
    engine once."""

    # how ipyparallel writes the class into the cluster file: its default, "module:Class",
    # is one its own reader cannot import, and JupyterLab's ipyparallel extension logged
    # "could not be imported" for every running meshlab cluster every few seconds
    entrypoint_name = f"{__module__}.ForkEngineSetLauncher"
    name = Unicode("ipengine-fork")
    exits_file = Unicode(help="where the forkserver writes PID STATUS as ranks end"
                         ).tag(to_dict=True)
    wait = Float(120.0, config=True, help="seconds the engines wait for the controller's "
                 "connection file (they start with the controller)")

    def find_args(self) -> list[str]:
        return forkserver.command(sys.executable, self.n, self.wait, "--exits", self.exits_file,
                                  engine_args=[*self.cluster_args, *self.engine_args])

    def start(self, n: int) -> Any:
        self.n = n
        if not self.exits_file:
            self.exits_file = os.path.join(self.profile_dir, "log", f"{self.identifier}.exits")
        return super().start()


class SSHHostLauncher(LocalProcessLauncher, EngineLauncher):
    """One host's ranks: a local ``ssh`` whose remote end is that host's forkserver."""

    hostname = Unicode()
    ranks = Integer(1)
    ssh_cmd = List(["ssh"])
    ssh_args: List[str] = List()
    remote_python = Unicode()
    wait = Float(120.0)

    def find_args(self) -> list[str]:
        remote = forkserver.command(self.remote_python, self.ranks, self.wait,
                                    "--environment-on-stdin", engine_args=self.engine_args)
        return [*self.ssh_cmd, *self.ssh_args, self.hostname, shlex.join(remote)]

    def start(self) -> None:
        # LocalProcessLauncher.start, with a pipe on stdin instead of /dev/null; started at
        # once, so the login and the host's imports overlap the controller's start
        with open(self.output_file, "ab") as out:
            proc = self._popen_process = Popen(self.args, stdout=out.fileno(), stderr=STDOUT,
                                               stdin=PIPE, cwd=self.work_dir,
                                               start_new_session=True)
        self.pid = proc.pid
        self.process = psutil.Process(proc.pid)
        self.notify_start(self.process.pid)
        self._start_waiting()
        threading.Thread(target=self._send_environment, args=(proc,), daemon=True,
                         name=f"environment for {self.hostname}").start()

    def _send_environment(self, proc: Popen[bytes]) -> None:
        """Once the controller has written its connection, send it with the rest of the
        engines' environment; stdin then stays open, the forkserver's lifeline."""
        assert proc.stdin is not None
        path, deadline = self.connection_files["engine"], time.monotonic() + self.wait
        while True:
            try:  # written once the controller listens (a half-written file: read again)
                with open(path) as f:
                    connection = json.load(f)
                break
            except (OSError, ValueError) as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.log.warning("no connection for the ranks on %s: %r", self.hostname, e)
                    proc.stdin.close()  # the forkserver says so in the engines' log, and ends
                    return
                time.sleep(0.02)
        env = {**self.get_env(), "IPP_CONNECTION_INFO": json.dumps(connection),
               "IPP_PROFILE_DIR": SSHLauncher._strip_home(self.profile_dir)}
        with contextlib.suppress(OSError):  # the ssh ended: its exit is reported
            proc.stdin.write(json.dumps(env).encode() + b"\n")
            proc.stdin.flush()


class SSHForkEngineSetLauncher(LocalEngineSetLauncher):
    """Every host's ranks at once, one ssh login and one forkserver per host."""

    entrypoint_name = f"{__module__}.SSHForkEngineSetLauncher"  # as ForkEngineSetLauncher's
    launcher_class = SSHHostLauncher
    hosts = Dict(config=True, help="host (as ssh knows it) -> ranks to fork there")
    ssh_cmd = List(["ssh"], config=True)
    ssh_args: List[str] = List(config=True)
    scp_args: List[str] = List(config=True, help="unused (nothing is copied); the "
                               "profile may carry it for ipyparallel's ssh launcher")
    remote_python = Unicode(sys.executable, config=True)
    wait = Float(120.0, config=True)

    def start(self, n: int) -> list[str]:
        for host, ranks in self.hosts.items():
            launcher = self.launchers[host] = self.launcher_class(
                work_dir=self.work_dir, parent=self, log=self.log, profile_dir=self.profile_dir,
                cluster_id=self.cluster_id, environment=self.environment, identifier=host,
                hostname=host, ranks=ranks, ssh_cmd=self.ssh_cmd, ssh_args=self.ssh_args,
                remote_python=self.remote_python, wait=self.wait,
                engine_args=list(self.engine_args),
                output_file=os.path.join(self.profile_dir, "log",
                                         f"ipengine-{self.cluster_id}-{host}.log"))
            launcher.on_stop(self._notice_engine_stopped)
            launcher.start()
        self.n = sum(self.hosts.values())
        self.notify_start(list(self.launchers))
        return list(self.launchers)
