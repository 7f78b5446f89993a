"""A real Ray cluster for the Ray profile's tests: its head on this machine (the login node:
no CPUs for ranks), a worker node in each test host (node1, node2: the host's network, UTS
and mount namespaces), token authentication on. Each node is a ``ray start --block`` this
module started, stopped by its own process group; nothing else is touched."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

RAY = str(Path(sys.executable).with_name("ray"))


class RayNodes:
    """The head and the worker nodes, each a process group of ours."""

    def __init__(self, folder: Path, login: str, hosts: dict[str, str],
                 host_pid: dict[str, int]) -> None:
        self.folder, self.login, self.hosts, self.host_pid = folder, login, hosts, host_pid
        self.port = _free_port(login)
        self.address = f"{login}:{self.port}"
        token = folder / "auth_token"
        token.write_text(secrets.token_hex(32))
        token.chmod(0o600)
        self.env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                    "RAY_USAGE_STATS_ENABLED": "0"}
        self.nodes: dict[str, subprocess.Popen[bytes]] = {}

    def start_head(self) -> None:
        self._start("head", [], ["--head", "--port", str(self.port), "--node-ip-address",
                                 self.login, "--num-cpus", "0", "--include-dashboard=false"])

    def start_worker(self, host: str) -> None:
        inside = ["nsenter", "-t", str(self.host_pid[host]), "--net", "--uts", "--mount", "--"]
        self._start(host, inside, ["--address", self.address, "--node-ip-address",
                                   self.hosts[host], "--num-cpus", "2"])

    def _start(self, name: str, prefix: list[str], args: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "ab")  # noqa: SIM115 (the node's, kept open)
        self.nodes[name] = subprocess.Popen(
            [*prefix, RAY, "start", "--block", "--disable-usage-stats",
             "--temp-dir", str(self.folder / name), *args],
            env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_for(self, alive: int, timeout: float = 120) -> None:
        """Until ``alive`` nodes have joined (the head counts)."""
        deadline, shown = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            done = subprocess.run([RAY, "status", "--address", self.address],
                                  env={**os.environ, **self.env}, capture_output=True,
                                  text=True, timeout=60)
            shown = done.stdout + done.stderr
            active = shown.split("Active:")[-1].split("Pending:")[0]
            if len(re.findall(r"\bnode_[0-9a-f]+", active)) >= alive:
                return
            time.sleep(1)
        raise AssertionError(f"{alive} Ray nodes did not join within {timeout:g} s:\n{shown}"
                             + self.logs())

    def stop(self, name: str) -> None:
        """Stop one node: its whole process group, then whatever of it escaped the group."""
        node = self.nodes.pop(name, None)
        if node is None:
            return
        with contextlib.suppress(psutil.Error):
            family = psutil.Process(node.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)
        try:  # a node that takes longer is killed: these nodes hold nothing to keep
            node.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)
        for process in family:
            with contextlib.suppress(psutil.Error):
                process.kill()

    def logs(self) -> str:
        return "".join(f"\n--- {p.name}\n" + p.read_text(errors="replace")[-2000:]
                       for p in sorted(self.folder.glob("*.log")))


@contextlib.contextmanager
def ray_cluster(folder: Path, login: str, hosts: dict[str, str],
                host_pid: dict[str, int]) -> Iterator[RayNodes]:
    nodes = RayNodes(folder, login, hosts, host_pid)
    try:
        nodes.start_head()
        nodes.wait_for(1)
        for host in hosts:
            nodes.start_worker(host)
        nodes.wait_for(1 + len(hosts))
        yield nodes
    finally:
        for name in [*hosts, "head"]:
            nodes.stop(name)


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])
