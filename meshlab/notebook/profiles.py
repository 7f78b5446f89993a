"""Cluster profiles: ``clusters/*.toml`` read into a checked dataclass."""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib

BACKENDS = ("auto", "gloo", "nccl")
LAUNCHERS = ("local", "ssh", "slurm", "mpi", "ray")
FORKING = ("local", "ssh")  # launchers that can start a host's ranks from one forkserver


@dataclass(kw_only=True, slots=True)
class Profile:
    """How to start a cluster: which launcher, how many ranks, which backend, which limits."""

    name: str
    """Profile name (the file's stem)."""
    launcher: str = "local"
    """ipyparallel engine launcher: local, ssh, slurm, mpi or ray."""
    ranks: int | None = None
    """Default number of ranks; None = one per visible GPU, else 4."""
    backend: str = "auto"
    """auto (nccl on GPU ranks, gloo on CPU ranks), gloo or nccl."""
    cell_timeout: float | None = None
    """Default time limit of a %%mesh cell in seconds; None = no limit."""
    pg_timeout: float = 60.0
    """torch.distributed timeout: a collective that waits longer raises on every rank."""
    start_timeout: float = 120.0
    """Seconds to wait for engines to register before failing with their logs."""
    debug: bool = False
    """Set TORCH_DISTRIBUTED_DEBUG=DETAIL on every rank (mismatched collectives raise at once)."""
    memory_on_oom: bool = False
    """Track every cell's memory (as ``%%mesh --on-oom``): a rank that runs out writes its
    snapshot, the error says where. On CPU ranks each op then costs more."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set on every rank before torch initialises."""
    controller_ip: str = "127.0.0.1"
    """The address the controller listens on (on loopback, the rendezvous store and gloo stay
    there too). Local profiles keep loopback; a multi-host profile names its cluster network's
    interface, never all interfaces by default."""
    allow_all_interfaces: bool = False
    """Let ``controller_ip`` be a wildcard ("*", "0.0.0.0", "::"): off unless written out,
    since every host that can reach the machine could then knock on the controller."""
    hosts: list[str] = field(default_factory=list)
    """Machines the engines start on: required by the ssh and mpi launchers, a node list for
    slurm. Ranks fill one host before the next, so ``tp`` (the innermost axis) stays on one."""
    ranks_per_host: int | None = None
    """Ranks on each host (one per GPU); None: the ranks asked for, split evenly."""
    launcher_options: dict[str, Any] = field(default_factory=dict)
    """Traits for the ipyparallel engine launcher class, e.g. {"timelimit": "1:00:00"}."""
    fork: bool | None = None
    """Start each host's ranks by forking one process that imported torch and the engine
    once (``meshlab.notebook.forkserver``); false: a fresh interpreter per rank. None: on
    where the launcher can (local, ssh on Linux hosts), off for slurm and mpi, whose ranks
    their own launchers start."""

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(
                f"profile {self.name!r}: launcher {self.launcher!r} is not one of {LAUNCHERS}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"profile {self.name!r}: backend {self.backend!r} is not one of {BACKENDS}"
            )
        if self.ranks is not None and self.ranks < 1:
            raise ValueError(f"profile {self.name!r}: ranks must be >= 1, got {self.ranks}")
        if _is_wildcard(self.controller_ip) and not self.allow_all_interfaces:
            raise ValueError(
                f"profile {self.name!r}: controller_ip {self.controller_ip!r} listens on all "
                "interfaces; name the address engines reach the controller on (the cluster "
                "network's), or add allow_all_interfaces = true to [cluster] to mean it"
            )
        for key in ("pg_timeout", "start_timeout"):
            if getattr(self, key) <= 0:
                raise ValueError(f"profile {self.name!r}: {key} must be > 0 seconds")
        self._check_hosts()
        if self.fork and self.launcher not in FORKING:
            raise ValueError(f"profile {self.name!r}: fork = true, but the {self.launcher} "
                             f"launcher starts each rank itself; only {FORKING} fork ranks "
                             "from one process per host: remove fork from [cluster]")
        if self.fork is None:
            self.fork = self.launcher in FORKING and sys.platform == "linux"

    def _check_hosts(self) -> None:
        where = f"profile {self.name!r}"
        if self.launcher in ("ssh", "mpi") and not self.hosts:
            raise ValueError(f"{where}: the {self.launcher} launcher needs the machines to start "
                             "engines on: add hosts = [\"node1\", \"node2\"] to [cluster]")
        if self.launcher == "ray" and (self.hosts or self.ranks_per_host):
            raise ValueError(f"{where}: the ray launcher places ranks where its placement "
                             "group's bundles go (a node's ranks together); remove hosts and "
                             "ranks_per_host, and size a rank with cpus_per_rank/gpus_per_rank "
                             "in [launcher]")
        if self.launcher == "local" and self.hosts:
            raise ValueError(f"{where}: the local launcher starts every rank on this machine; "
                             f"hosts = {self.hosts} needs launcher = \"ssh\", \"mpi\" or "
                             "\"slurm\"")
        if len(set(self.hosts)) != len(self.hosts):
            raise ValueError(f"{where}: hosts = {self.hosts} names a host twice; give each once "
                             "and set ranks_per_host")
        if self.ranks_per_host is not None:
            if self.ranks_per_host < 1:
                raise ValueError(f"{where}: ranks_per_host must be >= 1, got "
                                 f"{self.ranks_per_host}")
            if not self.hosts:
                raise ValueError(f"{where}: ranks_per_host needs hosts = [...] to say which "
                                 "machines")
            if self.ranks is None:
                self.ranks = len(self.hosts) * self.ranks_per_host
        remote = [h for h in self.hosts if not is_loopback_host(h)]
        if remote and is_loopback_host(self.controller_ip):
            raise ValueError(f"{where}: controller_ip {self.controller_ip!r} is loopback, which "
                             f"engines on {remote[0]} cannot reach: set controller_ip to this "
                             "machine's address on the network the hosts share")

    def per_host(self, n: int) -> int:
        """Ranks on each host when ``n`` ranks start; ValueError names a count that does not
        split evenly over the hosts."""
        if not self.hosts:
            return n
        if self.ranks_per_host is not None and n != self.ranks_per_host * len(self.hosts):
            raise ValueError(
                f"profile {self.name!r}: {n} ranks, but {len(self.hosts)} hosts x "
                f"ranks_per_host={self.ranks_per_host} make "
                f"{self.ranks_per_host * len(self.hosts)}: start that many (or no count)")
        if n % len(self.hosts):
            raise ValueError(
                f"profile {self.name!r}: {n} ranks do not split evenly over {len(self.hosts)} "
                f"hosts ({', '.join(self.hosts)}): start a multiple of {len(self.hosts)}")
        return n // len(self.hosts)


def _is_wildcard(address: str) -> bool:
    """Whether binding ``address`` listens on every interface."""
    if address.strip() in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(address.strip("[] ")).is_unspecified
    except ValueError:
        return False  # a host name


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` names this machine's loopback."""
    if host.strip() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[] ")).is_loopback
    except ValueError:
        return False


def available() -> dict[str, Path]:
    """Built-in profiles by name."""
    folder = resources.files("meshlab.clusters")
    return {
        Path(str(p)).stem: Path(str(p))
        for p in folder.iterdir()
        if str(p).endswith(".toml")
    }


def load(name_or_path: str | Path) -> Profile:
    """A built-in profile by name (``"local"``) or a user's TOML file by path."""
    path = Path(name_or_path).expanduser()
    if not (path.suffix == ".toml" and path.is_file()):
        builtin = available()
        if str(name_or_path) not in builtin:
            names = ", ".join(sorted(builtin))
            raise ValueError(
                f"unknown cluster profile {str(name_or_path)!r}: available profiles are "
                f"{names}, or pass the path of a .toml file"
            )
        path = builtin[str(name_or_path)]
    with path.open("rb") as f:
        data = tomllib.load(f)
    return from_dict(path.stem, data)


def from_dict(name: str, data: dict[str, Any]) -> Profile:
    """Build a Profile from parsed TOML, rejecting keys nobody reads."""
    unknown_tables = set(data) - {"cluster", "env", "launcher"}
    if unknown_tables:
        raise ValueError(
            f"profile {name!r}: unknown table(s) {sorted(unknown_tables)}; "
            "expected [cluster], [env], [launcher]"
        )
    cluster = dict(data.get("cluster", {}))
    known = {"launcher", "ranks", "backend", "cell_timeout", "pg_timeout", "start_timeout", "debug",
             "memory_on_oom", "controller_ip", "allow_all_interfaces", "hosts", "ranks_per_host",
             "fork"}
    unknown = set(cluster) - known
    if unknown:
        raise ValueError(
            f"profile {name!r}: unknown [cluster] key(s) {sorted(unknown)}; "
            f"known keys are {sorted(known)}"
        )
    if cluster.get("ranks") == "auto":
        cluster["ranks"] = None
    if not isinstance(cluster.get("hosts", []), list):
        raise ValueError(f"profile {name!r}: hosts must be a list of names, e.g. "
                         f"hosts = [\"node1\", \"node2\"], got {cluster['hosts']!r}")
    if not cluster.get("cell_timeout"):
        cluster["cell_timeout"] = None
    env = {str(k): str(v) for k, v in data.get("env", {}).items()}
    return Profile(name=name, env=env, launcher_options=dict(data.get("launcher", {})), **cluster)
