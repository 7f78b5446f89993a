"""Cluster: one ipyparallel engine per rank, a torch.distributed group across them.

Notebook side. Rank r is engine ``self._engines[r]``; every rank is bootstrapped by
``meshlab.runtime.setup`` (the same code an exported torchrun script calls).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from meshlab import runtime
from meshlab.mesh import MeshSpec
from meshlab.notebook import launch, on_ranks, profiles
from meshlab.notebook.cell_channel import CellChannel
from meshlab.notebook.engine_processes import EngineProcesses
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.probes import RankProbes
from meshlab.notebook.process_groups import ProcessGroups
from meshlab.notebook.rank_calls import RankCalls
from meshlab.notebook.rank_reports import RankReports
from meshlab.notebook.ranks import host_by_host, ranks_are
from meshlab.notebook.recovery import GroupRecovery, Stuck
from meshlab.notebook.running import CellRunning
from meshlab.notebook.transfers import PULL_WARN_BYTES, Transfers
from meshlab.rank import network
from meshlab.rank.private_files import STORE_PREFIX, private_dir

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_OUTPUT_LINES = 5000  # per rank, stream and cell
MAX_OUTPUT_BYTES = 2**20
MAX_CUT_OUTPUT_BYTES = 2**30  # the cut output kept on disk; the oldest cells' go first


class Cluster(RankProbes, GroupRecovery, Transfers, CellRunning, ProcessGroups, RankReports,
              RankCalls):
    """One ipyparallel engine per rank with a torch.distributed process group across them.

    >>> with Cluster(4) as c:
    ...     print(c.run("dist.all_reduce(t := torch.ones(1)); t"))
    """

    def __init__(
        self,
        n: int | None = None,
        *,
        profile: str | Path | profiles.Profile = "local",
        backend: str | None = None,
        debug: bool | None = None,
    ) -> None:
        self.profile = profile if isinstance(profile, profiles.Profile) else profiles.load(profile)
        if n is not None and n < 1:
            raise ValueError(f"a cluster needs at least 1 rank, got {n}")
        self.n = n
        self.backend = backend or self.profile.backend
        if self.backend not in profiles.BACKENDS:
            raise ValueError(f"backend {self.backend!r} is not one of {profiles.BACKENDS}")
        self.debug = self.profile.debug if debug is None else debug
        self._ipp: Any = None
        self._processes = EngineProcesses()
        self._client: Any = None
        self.cell_channel: Any = None  # CellChannel while running: cells go straight to ranks
        self._engines: list[int] = []  # rank -> engine id
        self._hosts: list[dict[str, Any]] = []  # rank -> host, pid, gpus, cpus
        self._generation = 0
        self._cells_run = 0  # numbers the cells sent without one, alike on every rank
        self._tracking: set[int] = set()  # ranks a --memory cell left tracking (it got stuck)
        self._members: list[int] | None = None  # ranks in the process group; None = all
        self.mesh_spec: MeshSpec | None = None  # the mesh every rank holds as `mesh`
        self._busy: dict[int, str] = {}  # rank -> msg id of a cell it has not finished
        self._needs_regroup = False
        self._diverged: str | None = None  # ranks made different groups: why, till regroup
        self._wedged = False  # stuck ranks outlived the process-group timeout: restart
        self._stuck: dict[int, Stuck] = {}  # ranks in _busy, as their cell found them
        self._recovered: list[str] = []  # one line per recovery made before the next cell
        self._dead: dict[int, str] = {}
        self.pull_warn_bytes = PULL_WARN_BYTES  # pull() warns above this many bytes in all
        # a cell keeps this much of each rank's stdout and stderr; the rest goes to a file
        self.max_output_lines, self.max_output_bytes = MAX_OUTPUT_LINES, MAX_OUTPUT_BYTES
        self.max_cut_output_bytes = MAX_CUT_OUTPUT_BYTES
        self.output_dir: Path | None = None  # where cut output goes; None: the temp directory
        self._cut_output: Path | None = None  # this cluster's private folder there
        self._store_dir: Path | None = None  # rank 0's store folder, where it is on this machine
        self.start_phases = ""  # 'controller 1.1 s, engines 5.0 s, process group 4.1 s'
        self.start_seconds = 0.0  # the last start's, as its progress line ends

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._client is not None

    @property
    def world_size(self) -> int:
        return len(self._engines)

    @property
    def host_of(self) -> list[str]:
        """Each rank's host, by rank."""
        return [h["host"] for h in self._hosts]

    def describe(self) -> str:
        """One line: backend, devices, profile."""
        devices = sorted({"cuda" if h["gpus"] else "cpu" for h in self._hosts}) or ["?"]
        backend = self.backend if self.backend != "auto" else (
            "nccl" if devices == ["cuda"] else "gloo")
        return (f"{backend} on {'/'.join(devices)}, "
                f"profile {self.profile.name}{', debug' if self.debug else ''}")

    def start(self, progress: bool = True) -> Cluster:
        """Start the engines, then a process group across them; returns self. A bar shows
        the phases while it starts; ``start_phases`` says how long each took."""
        if self.running:
            raise ClusterError(f"the cluster is already running with {self.world_size} ranks")
        n = self.n or self.profile.ranks or launch.visible_gpus() or 4
        bar = launch.StartProgress(n, enabled=progress)
        try:
            self._ipp, self._client, self._processes = launch.start(self.profile, n, bar)
            try:
                self._engines = sorted(self._client.ids)[:n]
                self.cell_channel = CellChannel(self.profile.controller_ip)
                bar.phase("process group")
                self._bootstrap(loopback=self.profile.controller_ip in LOOPBACK)
            except BaseException:
                self.stop()
                raise
        except BaseException:
            bar.close(ok=False)
            raise
        self.start_phases = bar.close()
        self.start_seconds = bar.elapsed()
        return self

    def stop(self) -> None:
        """Stop the engines and the controller; the cluster object can start again."""
        # a rank still busy with a cell cannot take a shutdown request: the launcher stops it,
        # without waiting for it to leave on its own
        live = [self._engines[r] for r in range(self.world_size)
                if r not in self._dead and r not in self._busy]
        launch.stop(self._ipp, self._client, live)
        if self.cell_channel is not None:
            self.cell_channel.close()
        self._ipp = self._client = self.cell_channel = None
        self._engines, self._hosts, self._busy, self._dead = [], [], {}, {}
        self._tracking = set()
        self._processes = EngineProcesses()
        self._generation, self._needs_regroup, self._members = 0, False, None
        self._diverged, self._wedged, self._recovered = None, False, []
        self.mesh_spec = None
        if self._cut_output is not None:
            shutil.rmtree(self._cut_output, ignore_errors=True)
            self._cut_output = None
        if self._store_dir is not None:  # a forked rank 0 leaves by os._exit, skipping atexit
            shutil.rmtree(self._store_dir, ignore_errors=True)
            self._store_dir = None

    def cut_output_folder(self) -> Path:
        """The folder the output cells cut goes to: made on first use, private to this user
        (meshlab.rank.private_files), removed when the cluster stops."""
        if self._cut_output is None:
            self._cut_output = private_dir(self.output_dir)
        return self._cut_output

    def restart(self, progress: bool = True) -> Cluster:
        """Fresh engines with the same size and profile."""
        n = self.world_size or self.n
        self.stop()
        self.n = n
        return self.start(progress)

    def _bootstrap(self, loopback: bool) -> None:
        reach = self.profile.controller_ip
        hosts = self._apply_each(network.host_info, lambda r: {"reach": reach})
        host_of = [hosts[r]["host"] for r in range(self.world_size)]
        # hosts the profile does not name (Ray's placement, Slurm's) in the order of their names
        order = host_by_host(host_of, self.profile.hosts or sorted(set(host_of)))
        self._engines = [self._engines[r] for r in order]
        self._hosts = [hosts[r] for r in order]
        rank0 = self._client[self._engines[0]]
        store: dict[str, Any]
        if len({h["host"] for h in self._hosts}) == 1:
            # a file in rank 0's private folder: no socket another local user could reach
            path = rank0.apply_sync(runtime.private_store, self.profile.pg_timeout)
            store = {"store_file": path}
            folder = Path(path).parent
            if loopback and folder.name.startswith(STORE_PREFIX):  # on this machine
                self._store_dir = folder
        else:
            # a TCPStore (no authentication) on rank 0's address facing the others only
            master = "127.0.0.1" if loopback else self._hosts[0]["addr"]
            port = rank0.apply_sync(runtime.serve_store, master, self.profile.pg_timeout)
            store = {"master_addr": master, "master_port": port}
        per_host: dict[str, list[int]] = {}
        for r, h in enumerate(self._hosts):
            per_host.setdefault(h["host"], []).append(r)

        def setup_kwargs(r: int) -> dict[str, Any]:
            peers = per_host[self._hosts[r]["host"]]
            host = self._hosts[r]
            threads = None if host["gpus"] else max(1, host["cpus"] // len(peers))
            return dict(
                rank=r, world_size=self.world_size, local_rank=peers.index(r),
                backend=self.backend, timeout=self.profile.pg_timeout, debug=self.debug,
                threads=threads, env=self.profile.env, cwd=os.getcwd(),
                cells=self.cell_channel.address, cells_key=self.cell_channel.key,
                interface=host["iface"], **store,
            )

        self._apply_each(on_ranks.setup_rank, setup_kwargs, timeout=self.profile.pg_timeout + 60)
        silent = self.cell_channel.wait_connected(list(range(self.world_size)), timeout=30)
        if silent:
            raise ClusterError(
                f"{ranks_are(silent)} did not connect to the notebook's cell channel at "
                f"{self.cell_channel.address} within 30 s: a firewall between the engines "
                "and this host? The profile's controller_ip is where both listen.")
