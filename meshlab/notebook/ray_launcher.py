"""An ipyparallel launcher that starts the ranks on a Ray cluster (``launcher = "ray"``):
one placement group with a bundle per rank (the profile's CPUs and GPUs each, ``PACK``ed
so that a node's ranks are neighbours), and on each bundle an actor
(meshlab.rank.ray_actor) that runs the rank's engine. The engines dial back to the
controller as every other profile's do; everything after that is meshlab's own.

This process is the Ray job's driver: the actors are the job's, so they end when it does
(``%mesh stop``, a notebook that dies). A rank whose actor dies is told with Ray's reason.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from typing import Any

from ipyparallel.cluster.launcher import EngineLauncher
from traitlets import Bool, Float, Unicode

from meshlab.notebook.errors import ClusterError
from meshlab.notebook.profiles import is_loopback_host


class RayEngineSetLauncher(EngineLauncher):
    """n engines, one Ray actor each, on one placement group."""

    entrypoint_name = f"{__module__}.RayEngineSetLauncher"  # as ForkEngineSetLauncher's
    name = Unicode("ipengine-ray")
    address = Unicode("auto", config=True, help='the Ray cluster: "auto" (the one `ray '
                      'start` made on this machine), or "ray://HEAD:10001" (Ray Client)')
    start_local = Bool(False, config=True, help='with address "auto" and no cluster found, '
                       "start one of this machine for this session")
    cpus_per_rank = Float(1.0, config=True, help="CPUs in each rank's bundle")
    gpus_per_rank = Float(0.0, config=True, help="GPUs in each rank's bundle (1 on GPU nodes)")
    strategy = Unicode("PACK", config=True, help="the placement group's strategy")
    controller_ip = Unicode("127.0.0.1", config=True, help="the profile's: where the "
                            "engines find the controller")
    wait = Float(300.0, config=True, help="seconds the bundles may take to be placed")

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.actors: list[Any] = []
        self.placed: list[dict[str, Any]] = []  # each rank's pid, host, node
        self.ended: dict[tuple[str, int], tuple[int | None, str]] = {}  # (host, pid) ->
        self.failure = ""  # why the start failed, for the engines' log tail
        self._group: Any = None
        self._connected = False
        self._stopping = threading.Event()
        self._starting: threading.Thread | None = None
        self._watchers: list[threading.Thread] = []

    def find_args(self) -> list[str]:
        return ["ray", self.address]

    def start(self, n: int) -> None:
        self.n = n
        self.notify_start(self.address)
        # Ray's connection, the bundles' placement and the engines' start take seconds: off
        # the controller's event loop, which the engines register with meanwhile (and off
        # the main thread, where ray.init would replace the notebook's SIGTERM handler)
        self._starting = threading.Thread(target=self._start_ranks, args=(n,), daemon=True,
                                          name="ray ranks")
        self._starting.start()

    def _failed(self, e: Exception) -> None:
        """The start's wait reports it, with the engines' log tail: this."""
        self.failure = f"the Ray launcher failed: {e}"
        self.log.warning(self.failure)
        self.ended[("", -1)] = (1, self.failure)
        self.notify_stop({"exit_code": 1, "reason": self.failure})

    def _start_ranks(self, n: int) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from meshlab.rank.ray_actor import RankActor

            self._connect(ray)
            bundle = {"CPU": self.cpus_per_rank} | (
                {"GPU": self.gpus_per_rank} if self.gpus_per_rank else {})
            self._group = placement_group([dict(bundle) for _ in range(n)],
                                          strategy=self.strategy, name=f"meshlab-{self.cluster_id}")
            if not self._group.wait(self.wait):
                raise ClusterError(
                    f"Ray could not place {n} bundles of {bundle} ({self.strategy}) within "
                    f"{self.wait:g} s: the cluster has {ray.cluster_resources()}; start fewer "
                    "ranks, lower cpus_per_rank/gpus_per_rank in [launcher], or add nodes")
            self._check_reach(ray)
            actor = ray.remote(RankActor)
            env = {k: str(v) for k, v in self.get_env().items()}
            logs = os.path.join(self.profile_dir, "log", f"ipengine-{self.cluster_id}-ray")
            for i in range(n):
                self.actors.append(actor.options(
                    max_concurrency=4, num_cpus=self.cpus_per_rank, num_gpus=self.gpus_per_rank,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._group, placement_group_bundle_index=i)).remote())
            argv = ["-m", "ipyparallel.engine", *self.cluster_args, *self.engine_args]
            self.placed = ray.get([a.start.remote(argv, env, f"{logs}-{i}.log")
                                   for i, a in enumerate(self.actors)])
            self._watchers = [threading.Thread(target=self._watch, args=(ray, i, a),
                                               daemon=True, name=f"ray rank {i}")
                              for i, a in enumerate(self.actors)]
            for watcher in self._watchers:
                watcher.start()
        except Exception as e:
            if self._connected:  # what it placed and started goes; the next start is clean
                self._release(ray)
            self._failed(e)

    def _connect(self, ray: Any) -> None:
        """Attach this process to the profile's Ray cluster, or share the attachment another
        session of this notebook holds (ray.init is one per process)."""
        global _users, _attached_to
        with _attach_lock:
            if ray.is_initialized():
                if _attached_to is not None and _attached_to != self.address:
                    raise ClusterError(
                        f"this notebook is attached to the Ray cluster at {_attached_to!r} "
                        f"for another session, and Ray attaches a process to one cluster: "
                        f"stop that session first, or give this profile address = "
                        f"\"{_attached_to}\" too")
                _users += 1  # another session's, or the user's own ray.init(): shared
                self._connected = True
                return
            # Ray's own warnings (no SIGTERM handler off the main thread) are not the
            # notebook's
            logging.getLogger("ray").setLevel(logging.ERROR)
            # the engines' output stays in their logs, not in the notebook
            kwargs: dict[str, Any] = {"log_to_driver": False, "configure_logging": False}
            try:
                _answers(self.address)  # ray.init retries a silent address for minutes
                ray.init(address=self.address, **kwargs)
            except ConnectionError as e:
                if not (self.start_local and self.address == "auto"):
                    raise ClusterError(
                        f"no Ray cluster at address {self.address!r} ({_first_line(e)}): "
                        "start one (`ray start --head` on this machine), attach to its head "
                        "with address = \"ray://HEAD:10001\", or add start_local = true to "
                        "[launcher] for a cluster of this machine") from None
                # this machine's only, for this session, its address loopback (Ray's servers
                # still listen on every interface: docs/guides/security.md). Its CPUs are
                # scheduling tokens: as many as the ranks ask, as the local profile puts
                # more ranks than cores on a machine
                _start_local_ray(ray, num_cpus=max(os.cpu_count() or 1,
                                                   math.ceil(self.n * self.cpus_per_rank)),
                                 **kwargs)
            _users, _attached_to = 1, self.address
            self._connected = True

    def _disconnect(self, ray: Any) -> None:
        """Let go of the attachment; the last session of this notebook to hold the one
        meshlab made ends it (one the user made stays theirs)."""
        global _users, _attached_to, _local_ray
        with _attach_lock:
            self._connected = False
            _users -= 1
            if _users == 0 and _attached_to is not None:
                if _local_ray is not None:
                    _local_ray.set()  # its keeper shuts it down, and returns
                    _local_ray.keeper.join()
                    _local_ray = None
                else:
                    ray.shutdown()
                _attached_to = None

    def _check_reach(self, ray: Any) -> None:
        """Refuse a loopback controller that ranks on other nodes could not reach."""
        if not is_loopback_host(self.controller_ip):
            return
        from ray.util.placement_group import placement_group_table

        here = ray.util.get_node_ip_address()
        nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        away = sorted({nodes.get(node, node) for node in
                       placement_group_table(self._group)["bundles_to_node_id"].values()}
                      - {here})
        if away:
            raise ClusterError(
                f"controller_ip {self.controller_ip!r} is loopback, but Ray placed ranks on "
                f"{', '.join(away)}, which cannot reach it: set controller_ip in [cluster] "
                "to this machine's address on the Ray nodes' network")

    def _watch(self, ray: Any, i: int, actor: Any) -> None:
        """Wait for rank i's engine; record how it ended, in Ray's words when its actor
        died (a node that died, an actor killed)."""
        where, ended = self.placed[i], actor.wait.remote()
        # in short waits: a stop disconnects from Ray only once no thread is inside it
        while not ray.wait([ended], timeout=0.5)[0]:
            if self._stopping.is_set():
                return
        try:
            code: int | None = ray.get(ended)
            why = (f"killed by signal {-code}" if code is not None and code < 0
                   else f"exited with status {code}")
        except Exception as e:  # RayActorError: the node or the actor died
            code, why = None, f"its Ray actor died: {_first_line(e)}"
        self.ended[(where["host"], where["pid"])] = (code, why)
        if len(self.ended) == len(self.actors):
            self.notify_stop({"exit_code": code, "reason": why})

    def signal(self, sig: int) -> None:
        import ray

        for actor in self.actors if self._connected else []:
            with contextlib.suppress(Exception):
                ray.get(actor.signal.remote(int(sig)), timeout=5)

    def stop(self) -> None:
        import ray

        if self._starting is not None:  # a stop during the start: after what it began
            self._starting.join(self.wait)
        if self._connected:  # (not: stopped already; a Ray call now would start a local Ray)
            self._release(ray)
        self.notify_stop({"exit_code": None, "reason": "stopped"})

    def _release(self, ray: Any) -> None:
        """End the actors (their engines with them), free the bundles, let go of Ray."""
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        deadline = time.monotonic() + 10  # the watchers see their actors go
        while self._watchers and len(self.ended) < len(self.actors) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stopping.set()
        for watcher in self._watchers:
            watcher.join()
        if self._group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._group)
        self._disconnect(ray)

    def get_output(self, remove: bool = False) -> str:
        """The engines' last lines (each on its node), or why the start failed."""
        if not (self.actors and self._connected):  # (ipyparallel asks after the stop too)
            return self.failure
        import ray

        tails = []
        for i, actor in enumerate(self.actors):
            try:
                tails.append(f"[rank {i}] " + ray.get(actor.tail.remote(), timeout=5))
            except Exception as e:
                tails.append(f"[rank {i}] no output: {_first_line(e)}")
        return self.failure + "\n".join(tails)

    def reason(self, host: str, pid: int, wait: float = 0.0) -> str | None:
        """How the engine ``pid`` on ``host`` ended, once Ray has said. One of these ranks
        gets up to ``wait`` seconds for it: the controller may hear the engine go before
        Ray tells this process that its actor died."""
        ours = any(p["host"] == host and p["pid"] == pid for p in self.placed)
        deadline = time.monotonic() + wait
        while ours and (host, pid) not in self.ended and time.monotonic() < deadline:
            time.sleep(0.05)
        ended = self.ended.get((host, pid))
        return None if ended is None else f"{ended[1]} (on {host})"


_attach_lock = threading.Lock()
_users = 0  # this process's sessions on Ray (their launchers), sharing one attachment
_attached_to: str | None = None  # the address meshlab attached to (None: not meshlab's)


class _LocalRay(threading.Event):
    """Set: the Ray this process started goes. Ray starts its processes to die with the
    *thread* that started them (PR_SET_PDEATHSIG), so a thread of their own starts them and
    lives as long as they should: a session's start thread would take them with it."""

    keeper: threading.Thread


_local_ray: _LocalRay | None = None


def _start_local_ray(ray: Any, **kwargs: Any) -> None:
    """ray.init a Ray of this machine, on a thread that keeps it until _local_ray is set."""
    global _local_ray
    stop, started = _LocalRay(), threading.Event()
    failed: list[BaseException] = []

    def keep() -> None:
        try:
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
        except BaseException as e:
            failed.append(e)
            return
        finally:
            started.set()
        stop.wait()
        ray.shutdown()

    stop.keeper = threading.Thread(target=keep, daemon=True, name="local ray")
    stop.keeper.start()
    started.wait()
    if failed:
        raise failed[0]
    _local_ray = stop


def _answers(address: str, seconds: float = 5.0) -> None:
    """ConnectionError at once unless something accepts a connection where ``address``
    leads ("auto": the cluster RAY_ADDRESS or this machine's last ``ray start`` names)."""
    from ray._private.services import canonicalize_bootstrap_address

    if address.startswith("ray://"):
        where = address.removeprefix("ray://")
    else:
        try:
            where = canonicalize_bootstrap_address(address) or ""  # ConnectionError: none
        except ValueError:
            raise ClusterError(f"address {address!r} in [launcher] is not a Ray address: "
                               'give "auto", "HOST:6379" (a head\'s GCS) or '
                               '"ray://HEAD:10001" (Ray Client)') from None
    host, _, port = where.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=seconds).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"nothing answers at {where or address!r}: {e}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
