"""Start and stop ipyparallel's controller and engines for a Cluster, as its profile says."""

from __future__ import annotations

import contextlib
import glob
import html
import importlib.util
import logging
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import ipyparallel as ipp

from meshlab.notebook import watchdog
from meshlab.notebook.engine_processes import EngineProcesses
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.fork_launchers import ForkEngineSetLauncher, SSHForkEngineSetLauncher
from meshlab.notebook.profiles import Profile
from meshlab.rank.private_files import private_profile

# CurveZMQ on every controller socket: a local peer without the server key (in the 0600
# connection files only) fails the handshake, so it can neither read iopub nor make the hub
# buffer or log anything (signing alone let it subscribe to every rank's display output).
# Errors only: the hub logs a line per request otherwise, into a log that grows for ever.
# The hub counts an engine once it answers a heartbeat, within two periods: ipyparallel's
# 3 s made every start wait 3-6 s for it; at 200 ms loaded engines never answered in time.
# A late answer (to the ping before) still counts, and 20 misses in a row keep a silent
# engine's detection at 10 s, as 10 misses of 1 s did.
CONTROLLER_ARGS = ["--IPController.enable_curve=True", "--log-level=ERROR",
                   "--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=20"]
IPP_PROFILE = "meshlab"  # ipyparallel's profile: a folder of meshlab's own, kept 0700
SLURM_TRAITS = {"queue": "partition", "account": "account", "qos": "qos",
                "timelimit": "time"}  # [launcher] keys -> the sbatch options they mean
SHUTDOWN_WAIT = 10.0  # seconds engines get to leave cleanly before the launcher stops them
_scratch: dict[int, str] = {}  # id(ipyparallel cluster) -> the folder it was started from


class StartProgress:
    """One progress line through a start's phases: the controller, the engines registering
    (it counts them), the process group; closed when the ranks are ready, so the time it
    shows is the whole start, as the "ready" line says.

    In a notebook it is one HTML output updated in place: a widget (tqdm's) makes JupyterLab's
    widget manager open a kernel subshell, whose reply showed the kernel Idle for the whole
    start, and a saved notebook kept only "model not found" of it. In a terminal, tqdm."""

    SAYS: ClassVar[dict[str, str]] = {
        "controller": "starting the controller", "engines": "engines registering",
        "process group": "forming the process group"}
    REDRAW = 0.25  # seconds between redraws while nothing but the clock changed

    def __init__(self, n: int, enabled: bool = True) -> None:
        self.n, self.k, self.enabled = n, 0, enabled
        self._started = self._since = time.perf_counter()
        self._drawn = 0.0
        self._ended: float | None = None
        self.phases: dict[str, float] = {}  # phase -> seconds it took
        self._phase = "controller"
        self.says = self.SAYS["controller"]  # what the line says now
        self._display: Any = None  # the notebook's output, updated in place
        self._bar: Any = None  # tqdm's, in a terminal
        if not enabled:
            return
        if in_kernel():
            from IPython.display import display

            self._display = display(_Drawn(self), display_id=True)
        else:
            from tqdm import tqdm

            self._bar = tqdm(total=n, unit="rank", desc=self.says,
                             bar_format="{desc}: {n_fmt}/{total_fmt} ranks {bar} {elapsed}")

    def phase(self, name: str) -> None:
        """The previous phase is over; ``name`` starts."""
        now = time.perf_counter()
        self.phases[self._phase] = now - self._since
        self._phase, self._since = name, now
        self._redraw(self.SAYS[name])

    def registered(self, k: int) -> None:
        if k != self.k or time.perf_counter() - self._drawn > self.REDRAW:
            self.k = k
            self._redraw(self.says)

    def close(self, ok: bool = True) -> str:
        """End the line; returns the phases with their times ('controller 1.1 s, ...')."""
        self._ended = time.perf_counter()  # elapsed() stops here: the time the line ends at
        self.phases[self._phase] = self._ended - self._since
        self._redraw("ready" if ok else f"failed {self.SAYS[self._phase]}")
        if self._bar is not None:
            self._bar.close()
        return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases.items())

    def elapsed(self) -> float:
        return (self._ended or time.perf_counter()) - self._started

    def text(self) -> str:
        return f"{self.says}: {self.k}/{self.n} ranks {self.elapsed():.1f} s"

    def _redraw(self, says: str) -> None:
        self.says, self._drawn = says, time.perf_counter()
        if self._display is not None:
            self._display.update(_Drawn(self))
        elif self._bar is not None:
            self._bar.set_description_str(says)
            self._bar.update(self.k - self._bar.n)


class _Drawn:
    """The start's progress as the notebook shows it: a bar in HTML, a line in text."""

    def __init__(self, progress: StartProgress) -> None:
        self.text = progress.text()
        self.fraction = progress.k / progress.n if progress.n else 1.0
        self.failed = progress.says.startswith("failed")
        self.ready = progress.says == "ready"

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        colour = "#c0392b" if self.failed else "#2e7d32" if self.ready else "#1f77b4"
        return (f"<div class='meshlab-start' style='display:flex;align-items:center;gap:8px'>"
                f"<span>{html.escape(self.text)}</span><span style='display:inline-block;"
                f"width:200px;height:10px;border:1px solid #999'><span style='display:block;"
                f"height:100%;width:{self.fraction * 100:.0f}%;background:{colour}'></span>"
                f"</span></div>")


def in_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (whose outputs can be updated in place)."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    return getattr(shell, "kernel", None) is not None


RANK_BYTES = 256 * 2**20
"""What one local rank takes before any cell: 170-240 MB resident, measured on forked CPU
ranks with torch imported (most of it shared with the forkserver)."""


def check_local_ranks(profile: Profile, n: int) -> None:
    """Refuse more ranks on this machine than its available memory holds idle (every local
    rank is a process here; forking 100,000 ended in an unclear error from the nanny)."""
    if profile.launcher != "local":
        return
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with contextlib.suppress(OSError, ValueError):  # Linux counts reclaimable memory too
        with open("/proc/meminfo") as info:
            fields = dict(line.split(":", 1) for line in info)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    most = max(1, available // RANK_BYTES)
    if n > most:
        raise ValueError(f"{n} ranks on this machine need about {n * RANK_BYTES / 2**30:.0f} "
                         f"GiB before any cell ({RANK_BYTES // 2**20} MiB each), and it has "
                         f"{available / 2**30:.1f} GiB available: start at most {most}, or "
                         "spread them over machines with a slurm, ssh or mpi profile")


def start(profile: Profile, n: int, progress: StartProgress
          ) -> tuple[ipp.Cluster, Any, EngineProcesses]:
    """The controller and ``n`` registered engines: (ipyparallel cluster, client, processes).
    On any failure what was started is stopped again and ClusterError says why."""
    check_local_ranks(profile, n)
    engines: Any = profile.launcher
    if profile.fork:
        engines = {"local": ForkEngineSetLauncher, "ssh": SSHForkEngineSetLauncher}[
            profile.launcher]
    if profile.launcher == "ray":
        if importlib.util.find_spec("ray") is None:
            raise ClusterError(f"profile {profile.name!r} starts ranks on Ray, which is not "
                               "installed here: pip install \"meshlab[ray]\" (the Ray "
                               "cluster's nodes need it too)")
        from meshlab.notebook.ray_launcher import RayEngineSetLauncher

        engines = RayEngineSetLauncher
    # Forkservers start with the controller, importing torch meanwhile, and hand their
    # engines its connection once it is written. (ipyparallel waits 1 s blindly, then for
    # the controller, to pass its connection in the engines' environment.)
    cluster = ipp.Cluster(n=n, engines=engines, log_level=logging.ERROR,
                          delay=0 if profile.fork or profile.launcher == "ray" else 1,
                          profile=IPP_PROFILE,
                          send_engines_connection_env=not profile.fork,
                          controller_ip=profile.controller_ip, controller_args=CONTROLLER_ARGS)
    private_profile(cluster.profile_dir)
    processes = EngineProcesses(cluster)
    for key, value in launcher_traits(profile, n, cluster.cluster_id,
                                      cluster.profile_dir).items():
        setattr(cluster.config[cluster.engine_launcher_class.__name__], key, value)
    client = None
    try:
        # a batch launcher writes its job script (slurm_engine.sbatch) to the working
        # directory: not into the notebook's folder. Engines start in it too (then move to
        # the notebook's), so it goes when they have stopped.
        _scratch[id(cluster)] = tempfile.mkdtemp(prefix="meshlab-")
        with _working_directory(_scratch[id(cluster)]):
            cluster.start_cluster_sync()
        watchdog.watch(cluster)  # a watchdog stops them if this process dies
        client = cluster.connect_client_sync()
        progress.phase("engines")
        _wait_for_engines(client, processes, n, profile.start_timeout, progress)
        for log in glob.glob(os.path.join(cluster.profile_dir, "log", f"*{cluster.cluster_id}*")):
            os.chmod(log, 0o600)  # in a 0700 folder already: private by their own mode too
    except BaseException:
        stop(cluster, client, None)
        raise
    return cluster, client, processes


def launcher_traits(profile: Profile, n: int, cluster_id: str = "",
                    profile_dir: str = "") -> dict[str, Any]:
    """The engine launcher's traits: where the profile's hosts put ``n`` ranks, then the
    profile's own [launcher] table (its lists extend meshlab's, its other values win)."""
    per_host = profile.per_host(n)
    traits: dict[str, Any] = {}
    if profile.launcher == "ssh":
        # the same interpreter on every host, as on a cluster with a shared software tree;
        # ipyparallel's default `python3` is the system's, without meshlab
        traits = {"remote_python": sys.executable}
        if profile.fork:  # one login and one forkserver per host
            traits |= {"hosts": dict.fromkeys(profile.hosts, per_host),
                       "wait": profile.start_timeout}
        else:
            traits["engines"] = dict.fromkeys(profile.hosts, per_host)
    elif profile.launcher == "local" and profile.fork:
        traits = {"wait": profile.start_timeout}
    elif profile.launcher == "mpi":
        # mpiexec does not pass ipyparallel's IPP_* environment to other hosts (Open MPI
        # needs -x, MPICH does it): the engines are told their cluster on the command line
        traits = {"mpi_args": ["--host", ",".join(f"{h}:{per_host}" for h in profile.hosts)],
                  "engine_cmd": [sys.executable, "-m", "meshlab.notebook.mpi_engine"],
                  "engine_args": [f"--cluster-id={cluster_id}", f"--profile-dir={profile_dir}"]}
    elif profile.launcher == "slurm":
        traits = {"batch_template": slurm_engine_script(profile, per_host)}
    elif profile.launcher == "ray":
        traits = {"controller_ip": profile.controller_ip, "wait": profile.start_timeout}
    for key, value in profile.launcher_options.items():
        if isinstance(value, list) and isinstance(traits.get(key), list):
            traits[key] = traits[key] + value
        elif profile.launcher != "slurm" or key not in ("options", *SLURM_TRAITS):
            traits[key] = value  # (slurm's are in its script)
    return traits


def slurm_engine_script(profile: Profile, per_host: int) -> str:
    """ipyparallel's engine job script, with the profile's nodes and its [launcher] queue,
    account, qos, timelimit and ``options`` as #SBATCH lines. ipyparallel adds the first
    four only to its own template, and ``options`` to none: they were silently dropped."""
    given = profile.launcher_options
    options = ([f"--nodes={len(profile.hosts)}", f"--ntasks-per-node={per_host}",
                f"--nodelist={','.join(profile.hosts)}"] if profile.hosts else [])
    options += [f"--{flag}={given[key]}" for key, flag in SLURM_TRAITS.items() if given.get(key)]
    options += shlex.split(str(given.get("options", "")))
    return "\n".join(["#!/bin/sh", "#SBATCH --export=ALL",
                      "#SBATCH --job-name=ipengine-{cluster_id}", "#SBATCH --ntasks={n}",
                      "#SBATCH --output={output_file}",
                      *(f"#SBATCH {o}".replace("{", "{{").replace("}", "}}") for o in options),
                      "srun {program_and_args}", ""])


def stop(cluster: ipp.Cluster | None, client: Any, engines: list[int] | None) -> None:
    """Shut ``engines`` (None: all) down cleanly, then stop the controller and whatever is
    left (engines busy with a cell cannot take a shutdown request)."""
    if client is not None:
        try:  # a clean exit first; the launcher's SIGTERM would dump every engine's log
            leaving = set(client.ids if engines is None else engines)
            if leaving:
                client.shutdown(targets=engines, hub=False, block=False)
            # not ipyparallel's blocking wait: an engine the hub no longer hears never
            # replies, and that wait has no end; whatever is left is the launcher's to stop
            deadline = time.monotonic() + SHUTDOWN_WAIT
            while leaving & set(client.ids) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception as e:
            logging.getLogger("meshlab").debug("shutdown: %r", e)
        client.close()
    if cluster is not None:
        # how a forkserver's ranks ended: read until now, of no use once they are all gone
        exits = [es.exits_file for es in cluster.engines.values() if getattr(es, "exits_file", "")]
        try:
            with _stderr_to_log(cluster.engine_launcher_class.__name__.startswith("SSH")):
                cluster.stop_cluster_sync()
        except Exception as e:  # a half-started cluster: nothing more to stop
            logging.getLogger("meshlab").debug("stop: %r", e)
        watchdog.release(cluster)
        # the controller's record of its engines, kept for a restart of the same controller
        for record in [os.path.join(cluster.profile_dir, "log",
                                    f"engines{cluster.cluster_id}.json"), *exits]:
            with contextlib.suppress(OSError, TypeError):
                os.remove(record)
        shutil.rmtree(_scratch.pop(id(cluster), ""), ignore_errors=True)


def visible_gpus() -> int:
    """GPUs this process sees (the default rank count when there are any)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _wait_for_engines(client: Any, processes: EngineProcesses, n: int, timeout: float,
                      progress: StartProgress) -> None:
    deadline = time.monotonic() + timeout
    while len(client.ids) < n:
        progress.registered(len(client.ids))
        exited = [pid for pid, rc in processes.exit_codes().items() if rc is not None]
        if exited or time.monotonic() > deadline:
            why = (f"{len(exited)} engine process(es) exited during start-up"
                   if exited else
                   f"only {len(client.ids)} of {n} engines registered within "
                   f"{timeout:g} s (profile start_timeout)")
            raise ClusterError(f"{why}. Engine log tail:\n{processes.log_tail()}")
        time.sleep(0.1)
    progress.registered(n)


@contextlib.contextmanager
def _stderr_to_log(active: bool) -> Iterator[None]:
    """While active, what child processes write to stderr goes to meshlab's debug log: the
    SSH launcher kills each engine over ssh even when it has left, and the remote side
    prints a traceback for the missing process, which a notebook would show."""
    if not active:
        yield
        return
    with tempfile.TemporaryFile() as caught:
        saved = os.dup(2)
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            text = caught.read().decode(errors="replace").strip()
            if text:
                logging.getLogger("meshlab").debug("stopping the engines: %s", text)


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)
