"""Start and stop ipyparallel's controller and engines for a Cluster, as its profile says."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import ipyparallel as ipp

from meshlab.notebook import watchdog
from meshlab.notebook.engine_processes import EngineProcesses
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.profiles import Profile

_scratch: dict[int, str] = {}  # id(ipyparallel cluster) -> the folder it was started from


def start(profile: Profile, n: int, progress: bool = True
          ) -> tuple[ipp.Cluster, Any, EngineProcesses]:
    """The controller and ``n`` registered engines: (ipyparallel cluster, client, processes).
    On any failure what was started is stopped again and ClusterError says why."""
    cluster = ipp.Cluster(n=n, engines=profile.launcher, log_level=logging.ERROR,
                          controller_ip=profile.controller_ip)
    processes = EngineProcesses(cluster)
    for key, value in profile.launcher_options.items():
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
        _wait_for_engines(client, processes, n, profile.start_timeout, progress)
    except BaseException:
        stop(cluster, client, [])
        raise
    return cluster, client, processes


def stop(cluster: ipp.Cluster | None, client: Any, engines: list[int]) -> None:
    """Shut ``engines`` down cleanly, then stop the controller and whatever is left."""
    if client is not None:
        try:  # a clean exit first; the launcher's SIGTERM would dump every engine's log
            client.shutdown(targets=engines or None, hub=False, block=True)
        except Exception as e:
            logging.getLogger("meshlab").debug("shutdown: %r", e)
        client.close()
    if cluster is not None:
        try:
            cluster.stop_cluster_sync()
        except Exception as e:  # a half-started cluster: nothing more to stop
            logging.getLogger("meshlab").debug("stop: %r", e)
        watchdog.release(cluster)
        # the controller's record of its engines, kept for a restart of the same controller
        with contextlib.suppress(OSError, TypeError):
            os.remove(os.path.join(cluster.profile_dir, "log",
                                   f"engines{cluster.cluster_id}.json"))
        shutil.rmtree(_scratch.pop(id(cluster), ""), ignore_errors=True)


def visible_gpus() -> int:
    """GPUs this process sees (the default rank count when there are any)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _wait_for_engines(client: Any, processes: EngineProcesses, n: int, timeout: float,
                      progress: bool) -> None:
    from tqdm.auto import tqdm

    deadline = time.monotonic() + timeout
    bar = tqdm(total=n, desc="starting ranks", unit="rank", disable=not progress)
    try:
        while len(client.ids) < n:
            if len(client.ids) != bar.n:
                bar.update(len(client.ids) - bar.n)
            exited = [pid for pid, rc in processes.exit_codes().items() if rc is not None]
            if exited or time.monotonic() > deadline:
                why = (f"{len(exited)} engine process(es) exited during start-up"
                       if exited else
                       f"only {len(client.ids)} of {n} engines registered within "
                       f"{timeout:g} s (profile start_timeout)")
                raise ClusterError(f"{why}. Engine log tail:\n{processes.log_tail()}")
            time.sleep(0.1)
        bar.update(n - bar.n)
    finally:
        bar.close()


@contextlib.contextmanager
def _working_directory(path: str) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)
