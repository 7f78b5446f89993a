"""Cluster: one ipyparallel engine per rank, a torch.distributed group across them.

Notebook side. Rank r is engine ``self._engines[r]``; every rank is bootstrapped by
``meshlab.runtime.setup`` (the same code an exported torchrun script calls).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipyparallel as ipp

import meshlab.measure.comms
import meshlab.measure.profiling
from meshlab import runtime
from meshlab.measure.sharding import ModuleReport, ShardingReport, merge
from meshlab.mesh import MeshSpec
from meshlab.notebook import launch, on_ranks, profiles
from meshlab.notebook.cell import CellRun
from meshlab.notebook.cell_channel import CellChannel
from meshlab.notebook.engine_processes import EngineProcesses
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import CellResult, MeshError, group, strip_ansi
from meshlab.notebook.probes import RankProbes
from meshlab.notebook.ranks import host_by_host, label, parse_ranks, ranks_are
from meshlab.notebook.recovery import GROUP_CREATION, GroupRecovery, Stuck
from meshlab.notebook.transfers import PULL_WARN_BYTES, Transfers
from meshlab.rank import network
from meshlab.rank.private_files import STORE_PREFIX, private_dir

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_OUTPUT_LINES = 5000  # per rank, stream and cell
MAX_OUTPUT_BYTES = 2**20
STORE_HEADROOM = 2**20  # bytes the store's disk must have free before groups are made
PEERS_AFTER_A_FAILURE = 5.0  # seconds the other ranks get to finish once one has failed
MAX_CUT_OUTPUT_BYTES = 2**30  # the cut output kept on disk; the oldest cells' go first


class Cluster(RankProbes, GroupRecovery, Transfers):
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
        order = host_by_host([hosts[r]["host"] for r in range(self.world_size)],
                             self.profile.hosts)
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

    # -- running code ----------------------------------------------------------------------

    def run(
        self,
        code: str,
        ranks: str | list[int] | None = None,
        timeout: float | None = None,
        *,
        on_output: Callable[[CellResult], None] | None = None,
        keep_values: bool = False,
        comms: bool = False,
        profile: bool = False,
        trace: bool = False,
        number: int | None = None,
    ) -> CellResult:
        """Run ``code`` on every rank (or ``ranks``); raise MeshError if any rank fails.

        ``timeout`` (seconds; default from the profile) interrupts ranks still running and
        reports their stacks. ``on_output`` sees the partial result as output streams in.
        ``keep_values``: each rank sends its last expression's value with its reply, into
        ``result.values``.
        ``comms`` traces the collectives each rank issues into ``result.comms``.
        ``profile`` profiles every rank (torch.profiler and timed collectives) into
        ``result.profile``, a CellProfile on the notebook's clock; ``trace`` keeps torch's
        own trace of every rank in it too (what a Perfetto file shows: every op and thread).
        ``number``: the ranks run the cell as In [number] (the notebook's), so tracebacks
        and stacks name it; without it, the count of cells this cluster ran.
        """
        ranks = self._ranks(ranks)
        timeout = timeout if timeout is not None else self.profile.cell_timeout
        # the cell's limit bounds the wait for ranks an earlier cell left stuck too
        spent = self._recover(creates_groups=bool(GROUP_CREATION.search(code)),
                              timeout=timeout or None)
        if comms or profile:  # before the cell is sent: the two travel apart
            view = self._client.direct_view([self._engines[r] for r in ranks])
            if profile:
                remote = [r for r in ranks if self._hosts[r]["host"] != socket.gethostname()]
                clocks_before = self.clocks(remote)
                view.apply_sync(meshlab.measure.profiling.start, trace)
            else:
                view.apply_sync(meshlab.measure.comms.start)
        self._cells_run += 1
        number = self._cells_run if number is None else number
        cell = CellRun(self, self.cell_channel.send(ranks, code, number, keep_values),
                       timeout, on_output, spent=spent)
        result = cell.wait()
        if profile:
            result.profile = self._collect_profiles([r for r in ranks if r not in cell.stuck],
                                                    clocks_before)
            if comms and result.profile is not None:
                result.comms = {r: p.collectives for r, p in result.profile.ranks.items()}
        elif comms:
            result.comms = self._collect_traces([r for r in ranks if r not in cell.stuck])
        self._after_cell(cell, result, code)
        if keep_values:
            result.values, unsent = cell.values()
            result.notes += [f"{label(rs)} value not kept: {why}" for rs, why in group(unsent)]
        if on_output:
            on_output(result)
        if not result.ok:
            raise MeshError(result)
        return result

    def _wait_for(self, pending: list[str], timeout: float) -> bool:
        """Wait until the cells and calls ``pending`` (ids) have ended; whether they did."""
        deadline = time.monotonic() + timeout
        for cell in filter(None, map(self.cell_channel.cell, pending)):
            if not self.cell_channel.wait(cell, deadline - time.monotonic()):
                return False
            self.cell_channel.forget(cell)
        calls = [i for i in pending if not self.cell_channel.owns(i)]
        return self._client.wait(calls, timeout=max(0.0, deadline - time.monotonic()))

    def _collect_traces(self, ranks: list[int]) -> dict[int, list[Any]]:
        alive = [r for r in ranks if r not in self._dead]
        if not alive:
            return {}
        ar = self._client.direct_view([self._engines[r] for r in alive]).apply_async(
            meshlab.measure.comms.stop)
        return dict(zip(alive, ar.get(timeout=30), strict=True))

    def _collect_profiles(self, ranks: list[int], clocks_before: dict[int, tuple[int, int]]
                          ) -> Any:
        from meshlab.notebook.cell_profile import CellProfile, clocks_from

        alive = [r for r in ranks if r not in self._dead]
        stop = meshlab.measure.profiling.stop
        pending = {r: self._client[self._engines[r]].apply_async(stop, rank=r)
                   for r in alive}
        profiles = {r: p for r, ar in pending.items() if (p := ar.get(timeout=60)) is not None}
        if not profiles:
            return None
        clocks = clocks_from(profiles, clocks_before, self.clocks(list(clocks_before)))
        return CellProfile(profiles, clocks, self.mesh_spec, self.world_size)

    def regroup(self, ranks: str | list[int] | None = None) -> None:
        """Replace the process group by a fresh one over all ranks (or a subset).

        A mesh built on the old group is rebuilt on the new one when it still fits.
        """
        members = None if ranks is None else parse_ranks(ranks, self.world_size)
        self._members = members
        self._generation += 1
        gen = self._generation
        self._check_store_disk("re-forming the process group")
        self._apply_each(on_ranks.regroup_rank, lambda r: {"generation": gen, "members": members},
                         timeout=self.profile.pg_timeout + 30)
        self._needs_regroup, self._diverged = False, None
        if self.mesh_spec is not None:
            if members is None:
                self.init_mesh(self.mesh_spec)
            else:
                self.mesh_spec = None  # a subset group no longer matches the mesh

    def init_mesh(self, spec: str | MeshSpec) -> MeshSpec:
        """Build the named DeviceMesh ``mesh`` on every rank; ValueError names a bad spec."""
        spec = MeshSpec.parse(spec) if isinstance(spec, str) else spec
        spec.check(self.world_size if self._members is None else len(self._members))
        self._ranks(None)
        if not self._busy and not self._dead and not self._diverged:
            # one round trip per `%mesh init`: groups made unevenly where meshlab could not
            # see it would deadlock the mesh's own new_group calls
            for note in self._check_groups():
                logging.getLogger("meshlab").info("%s", note)
        self._recover(creates_groups=True)
        self._check_store_disk("building the mesh")
        self._apply_each(on_ranks.build_mesh, lambda r: {"spec": spec},
                         timeout=self.profile.pg_timeout + 30)
        self.mesh_spec = spec
        return spec

    # -- moving data -----------------------------------------------------------------------

    def inspect(self, expr: str, ranks: str | list[int] | None = None
                ) -> ShardingReport | ModuleReport:
        """Evaluate ``expr`` on the ranks and merge what each holds into one report."""
        ranks = self._ranks(ranks)
        self._recover()
        ar = self._client.direct_view([self._engines[r] for r in ranks]).apply_async(
            on_ranks.describe, expr)
        try:
            reports = ar.get(timeout=self.profile.pg_timeout)
        except ipp.CompositeError as e:
            why = {r: f"{ename}: {evalue}" for r, ename, evalue in self._failures(e, ranks)}
            lines = [f"  {label(group_ranks)} {text}" for group_ranks, text in group(why)]
            raise ClusterError(f"cannot inspect {expr!r}:\n" + "\n".join(lines)) from None
        return merge(dict(zip(ranks, reports, strict=True)))

    def memory(self, model: str, optimizer: str | None = None, inputs: str | None = None
               ) -> tuple[dict[int, Any], int, dict[int, tuple[int, int]]]:
        """Bytes each rank holds for ``model`` (an expression) and its optimizer, the
        parameters one tensor-parallel rank holds (Ψ without TP), and (device, host) bytes one
        forward on ``inputs`` saves for backward, if given."""
        self._ranks(None)
        out = self._apply_each(on_ranks.measure_memory, lambda r: {
            "model": model, "optimizer": optimizer, "inputs": inputs})
        activations = {r: a for r, (_, _, a) in out.items() if a is not None}
        return {r: report for r, (report, _, _) in out.items()}, out[0][1], activations

    # -- signals ---------------------------------------------------------------------------

    def interrupt(self, ranks: str | list[int] | None = None) -> None:
        """Send SIGINT to ranks (a KeyboardInterrupt in the cell they are running)."""
        targets = [self._engines[r] for r in self._ranks(ranks, check_dead=False)
                   if r not in self._dead]
        if targets:
            self._client.send_signal(signal.SIGINT, targets=targets, block=False)

    # -- helpers ---------------------------------------------------------------------------

    def _ranks(self, spec: str | list[int] | Any, check_dead: bool = True) -> list[int]:
        if not self.running:
            raise ClusterError("no cluster is running: start one with `%mesh start N` "
                               "(or meshlab.Cluster(N).start())")
        ranks, gone = parse_ranks(spec, self.world_size), self.dead()
        dead = [r for r in ranks if r in gone]
        if check_dead and dead:
            raise ClusterError(
                "; ".join(f"rank {r} died: {self._dead[r]}" for r in dead)
                + ". `%mesh restart` starts fresh engines and replays the session's cells.")
        return ranks

    def _failures(self, error: Any, ranks: list[int]) -> list[tuple[int, str, str]]:
        """(rank, exception name, message) for each engine an ipyparallel call failed on."""
        rank_of = {self._engines[r]: r for r in ranks}
        return [(rank_of[info["engine_id"]], ename, evalue)
                for ename, evalue, _, info in error.elist]

    def _check_store_disk(self, doing: str) -> None:
        """Refuse ``doing`` (it writes the rendezvous store) when the store's disk is full:
        the rank whose write fails raises, and the others wait for its key."""
        if self._store_dir is None:
            return
        free = shutil.disk_usage(self._store_dir).free
        if free < STORE_HEADROOM:
            raise ClusterError(
                f"{doing} writes the ranks' rendezvous store in {self._store_dir}, and its disk "
                f"has {free // 1024} KiB free: free space there (df {self._store_dir.parent}), "
                "or set TMPDIR to a folder on another disk before %mesh start; nothing ran")

    def _apply_each(self, fn: Callable[..., Any], kwargs: Callable[[int], dict[str, Any]] | None
                    = None, timeout: float = 60.0) -> dict[int, Any]:
        """Call ``fn(**kwargs(rank))`` on every rank at once; wait for all. Once one has
        failed, the others get PEERS_AFTER_A_FAILURE seconds more: in a set-up step they wait
        for it in the store or a collective, until the process-group timeout."""
        pending = {r: self._client[eid].apply_async(fn, **(kwargs(r) if kwargs else {}))
                   for r, eid in enumerate(self._engines)}
        out: dict[int, Any] = {}
        failed: dict[int, str] = {}
        tracebacks: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(failed) < len(pending):
                for r, ar in pending.items():
                    if r in out or r in failed or not ar.ready():
                        continue
                    try:
                        out[r] = ar.get()
                    except ipp.RemoteError as e:
                        failed[r], tracebacks[r] = f"{e.ename}: {e.evalue}", e.traceback
                        deadline = min(deadline, time.monotonic() + PEERS_AFTER_A_FAILURE)
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(0.01)
        except (KeyboardInterrupt, TimeoutError) as stop:
            # meshlab must know the ranks still in it: the next cell waits for them, then
            # re-forms the group (a Ctrl-C'd `%mesh init` would otherwise hang the next cell)
            stuck = {r: ar.msg_ids[0] for r, ar in pending.items() if not ar.ready()}
            self.interrupt(list(stuck))
            self._busy.update(stuck)
            self._needs_regroup = True
            why = ("was interrupted" if isinstance(stop, KeyboardInterrupt) else
                   f"did not finish within {timeout:g} s" if not failed else
                   "failed")
            # the ranks that failed are usually why the others wait: say what they said
            said = "".join(f"; {label(ranks)} failed: {text}" for ranks, text in group(failed))
            raise ClusterError(
                f"{fn.__name__} {why}; {ranks_are(stuck)} still in it{said}. The next cell "
                f"waits up to {self.profile.pg_timeout + 30:g} s for them, then re-forms the "
                "process group; `%mesh restart` replaces the engines now.") from None
        if failed:  # one line per group of ranks; the lowest rank's traceback at debug level
            logging.getLogger("meshlab").debug("rank %d: %s", min(failed),
                                               strip_ansi(tracebacks[min(failed)]))
            raise ClusterError("\n".join(f"{label(ranks)} {why}" for ranks, why in group(failed)))
        return out

    def dead(self) -> dict[int, str]:
        """Ranks whose process has ended, with how: ``{2: "killed by SIGKILL"}``."""
        codes = self._processes.exit_codes() if self._hosts else {}
        here = socket.gethostname()  # pids are this machine's: a remote rank's may coincide
        for r, h in enumerate(self._hosts):
            if r not in self._dead and ((h["host"] == here and codes.get(h["pid"]) is not None)
                                        or self._engines[r] not in self._client.ids):
                self._dead[r] = self._processes.cause_of_death(h["pid"]) if h["host"] == here \
                    else self._silent_host(h["host"])
        return dict(self._dead)

    def _silent_host(self, host: str) -> str:
        """Why a rank on another host is gone: the controller stopped hearing its engine
        (its heartbeats), alone or with every rank of that host."""
        on_host = [r for r, h in enumerate(self._hosts) if h["host"] == host]
        if all(self._engines[r] not in self._client.ids for r in on_host):
            return (f"its host {host} stopped answering: no heartbeat from any of its "
                    f"{len(on_host)} ranks (a network link, or the machine)")
        return f"its engine on {host} stopped responding"


