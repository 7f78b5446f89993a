"""Rank-side bootstrap: environment, device pinning and the process group.

Cluster engines and exported torchrun scripts both start here, so a cell that
works in the notebook sees the same ``rank``, ``world_size`` and ``device`` in a
batch job. Plain torch only: no IPython, ipyparallel or widgets.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import random
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshlab.rank import import_noise
from meshlab.rank.network import (
    bind_address,
    ephemeral_port_floor,
    host_info,
    is_loopback,
    listen_socket,
)
from meshlab.rank.private_files import STORE_PREFIX, open_private, private_dir


@dataclass(slots=True)
class RankState:
    """What this process knows about its place in the cluster."""

    rank: int
    world_size: int
    cluster_rank: int
    cluster_size: int
    local_rank: int
    device: torch.device
    backend: str
    timeout: float
    generation: int = 0


_store: dist.Store | None = None  # one long-lived rendezvous store per cluster
_store_file: str | None = None  # its path, when it is a file (every rank on one host)
_state: RankState | None = None

_before_reform: list[Callable[[], None]] = []
"""What holds the default group's objects (meshlab.mesh's built meshes), to drop before a
new group replaces it: registered by their owners, which import this module (not the other
way round)."""


def before_reform(forget: Callable[[], None]) -> None:
    """Call ``forget`` before ``reform`` replaces the process group (once per function)."""
    if forget not in _before_reform:
        _before_reform.append(forget)
optimizer_steps = 0  # optimizer.step() calls in this process: which cells trained
_step_hook: Any = None  # the global hook that counts them, installed once

LOOPBACK_INTERFACE = "lo0" if sys.platform == "darwin" else "lo"
"""The interface gloo binds to when every rank is on this machine (GLOO_SOCKET_IFNAME)."""

FLIGHT_RECORDER_ENTRIES = "64"
"""Collectives each rank remembers (torch's flight recorder), for the table shown on a hang."""


def state() -> RankState:
    """This rank's state; raises if the process group was never set up."""
    if _state is None:
        raise RuntimeError("meshlab.runtime.setup() has not run in this process")
    return _state


def device() -> torch.device:
    """This rank's device: the one ``setup`` or ``init_from_env`` pinned; where neither ran
    (a plain torchrun script, a lone process), the current CUDA device, else the CPU."""
    if _state is not None:
        return _state.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def private_store(timeout: float = 60.0) -> str:
    """Start the rendezvous store on this rank (rank 0) as a file only this user can open,
    for ranks that all run on this host; returns its path, which they pass to ``setup``.

    Not a TCPStore: it has no authentication, and any local user can connect to a port on
    loopback, then list, read and write its keys. The file sits in a folder made by
    ``mkdtemp`` (0700, this process's pid in its name), removed when this process exits, or
    by the next store or cut-output folder this user makes after it died.
    """
    global _store, _store_file
    if _store is not None:
        if _store_file is None:
            raise RuntimeError("this rank already has a TCP rendezvous store: a cluster uses "
                               "one store, a file (one host) or TCP (several), never both")
        return _store_file
    folder = private_dir(prefix=STORE_PREFIX)
    atexit.register(_remove_folder, folder, os.getpid())
    path = folder / "store"
    open_private(path).close()  # 0600 (torch would make it 0644), there before a rank looks
    _store, _store_file = _file_store(str(path), timeout), str(path)
    return str(path)


def _remove_folder(folder: Path, owner: int) -> None:
    # a process a cell forks inherits this handler: only rank 0 itself removes the folder
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def _file_store(path: str, timeout: float) -> dist.FileStore:
    # world_size -1: torch never deletes the file, which a later reform() still needs
    store = dist.FileStore(path, -1)
    store.set_timeout(datetime.timedelta(seconds=timeout))
    return store


def serve_store(host: str = "127.0.0.1", timeout: float = 60.0) -> int:
    """Start the rendezvous store on this rank (rank 0) as a TCPStore on ``host`` and return
    its port: for ranks on several hosts (on one, ``private_store`` is not reachable by
    other local users).

    The port is chosen right before binding and below the ephemeral range: ports
    picked earlier can be taken by gloo's own connections in the meantime. When ``host``
    is an address the socket is bound to it here and handed to the store: TCPStore on its
    own listens on every interface, whatever ``host`` says.
    """
    global _store
    if _store is not None:
        if _store_file is not None:
            raise RuntimeError(f"this rank already has a file rendezvous store ({_store_file}):"
                               " a cluster uses one store, a file (one host) or TCP (several)")
        return int(_store.port)  # type: ignore[attr-defined]
    address = bind_address(host)
    floor = ephemeral_port_floor()
    last_error: Exception | None = None
    for _ in range(50):
        port = random.randrange(max(1024, floor - 12000), floor)
        try:
            fd = None if address is None else listen_socket(address, port)
            _store = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout), master_listen_fd=fd,
            )
            return port
        except (RuntimeError, OSError) as e:  # DistNetworkError: port taken, try another
            last_error = e
    raise RuntimeError(f"could not bind a rendezvous store on {host}: {last_error}")


def pin_device(local_rank: int) -> torch.device:
    """One GPU per rank (by LOCAL_RANK among the visible ones), else the CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    # Triton reads this when @triton.jit decorates: kernels defined later on this CPU rank
    # (meshlab's or a cell's) run in its interpreter instead of failing for want of a GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")
    return torch.device("cpu")


def resolve_backend(backend: str, device: torch.device) -> str:
    """``auto`` -> NCCL for CUDA tensors (gloo alongside for CPU tensors), gloo on CPU ranks."""
    if backend != "auto":
        return backend
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def setup(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    master_addr: str | None = None,
    master_port: int | None = None,
    store_file: str | None = None,
    backend: str = "auto",
    timeout: float = 60.0,
    debug: bool = False,
    threads: int | None = None,
    env: dict[str, str] | None = None,
    interface: str | None = None,
) -> dict[str, Any]:
    """Bootstrap one cluster rank; returns the names a %%mesh cell sees. The store is rank 0's
    ``store_file`` (``private_store``: every rank on this host) or its TCPStore at
    ``master_addr:master_port`` (``serve_store``). ``interface`` is the one facing the other
    hosts: gloo binds there, unless the profile's env names another."""
    global _store, _store_file, _state
    if store_file is None and (master_addr is None or master_port is None):
        raise ValueError(f"setup(rank={rank}) got no rendezvous store (master_addr="
                         f"{master_addr!r}, master_port={master_port!r}, store_file=None): "
                         "pass rank 0's private_store() path, or its serve_store() address")
    # torch would wait out the whole timeout for a file that is not there
    if store_file is not None and not Path(store_file).is_file():
        raise RuntimeError(
            f"rank {rank} on {socket.gethostname()}: rank 0's rendezvous store {store_file} is "
            "not on this machine. Ranks that report one host name share a file store, so "
            "hosts that share a name must share the temp directory too: give each its own name")
    os.environ.update(env or {})
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank))
    if store_file is not None:
        # No TCP store listens: an env:// rendezvous in a cell fails at once, naming the
        # variable, rather than dialling a port another local user may have taken since.
        os.environ.pop("MASTER_ADDR", None)
        os.environ.pop("MASTER_PORT", None)
    else:
        os.environ.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port))
    if store_file is not None or is_loopback(master_addr or ""):
        # every rank is on this machine: keep gloo off the address the hostname resolves to
        os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    elif interface:
        # gloo would bind what the hostname resolves to: loopback, or a public interface
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    if debug:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.set_debug_level_from_env()  # torch read the variable when it was imported
    if threads:
        torch.set_num_threads(threads)  # more ranks than cores: do not thrash
    # read when a process group is created: on before the first one
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    _count_optimizer_steps()
    device = pin_device(local_rank)
    import_noise.quiet(gpu=device.type != "cpu")
    if _store is None and store_file is not None:
        _store, _store_file = _file_store(store_file, timeout), store_file
    elif _store is None and master_addr is not None and master_port is not None:
        _store = dist.TCPStore(
            master_addr, master_port, is_master=False, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
    _state = RankState(
        rank=rank, world_size=world_size, cluster_rank=rank, cluster_size=world_size,
        local_rank=local_rank, device=device, backend=resolve_backend(backend, device),
        timeout=timeout,
    )
    _init_group(rank, world_size)
    return namespace()


def _count_optimizer_steps() -> None:
    """Count every optimizer.step() (a restore skips cells a checkpoint already holds)."""
    global _step_hook

    def count(*_: Any) -> None:
        global optimizer_steps
        optimizer_steps += 1

    if _step_hook is None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _step_hook = register_optimizer_step_post_hook(count)



def _init_group(rank: int, world_size: int) -> None:
    st = state()
    assert _store is not None
    # A fresh key prefix per generation lets the same store rendezvous again and again.
    store = dist.PrefixStore(f"meshlab/gen{st.generation}", _store)
    dist.init_process_group(
        st.backend, store=store, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=st.timeout),
        # Binding the GPU makes NCCL connect now, not on the first collective.
        device_id=st.device if st.device.type == "cuda" else None,
    )


def reform(generation: int, members: list[int] | None = None) -> dict[str, Any]:
    """Replace the process group by a fresh one (after a hang, or over a subset of ranks).

    ``members`` are cluster ranks; they become ranks 0..len-1 of the new group in that
    order. A cluster rank outside ``members`` is left without a process group.
    """
    st = state()
    for forget in _before_reform:
        forget()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_sharding_caches()
    # A mesh and its flattened views refer to each other: only the collector frees them,
    # and with them the old groups' threads (which an idle engine would keep forever).
    gc.collect()
    members = list(range(st.cluster_size)) if members is None else members
    st.generation = generation
    if st.cluster_rank in members:
        st.rank, st.world_size = members.index(st.cluster_rank), len(members)
        os.environ.update(RANK=str(st.rank), WORLD_SIZE=str(st.world_size))
        _init_group(st.rank, st.world_size)
    return namespace()


def forget_sharding_caches() -> None:
    """Drop DTensor's memoised sharding decisions: they hold the DeviceMesh first seen.

    A mesh compares equal to any mesh of the same shape and names, whatever its process
    groups, and group names restart at 0 with a new default group. So after a re-form the
    cache hands the first forward the old mesh, whose group names resolve to nothing
    ("Could not resolve the process group") or to another axis's group (a hang). Megatron
    and transformers met the same (Megatron-LM PR 7029, transformers PR 48383).
    """
    from torch.distributed.tensor import DTensor, _redistribute

    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()  # the C++ fast path's copy
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


def init_from_env(backend: str = "auto", timeout: float = 600.0) -> dict[str, Any]:
    """Bootstrap under torchrun (or Slurm + torchrun): process group from the environment."""
    global _state
    needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in needed if k not in os.environ]
    if missing:
        raise RuntimeError(f"{', '.join(missing)} not set: launch this script with torchrun, "
                           "e.g. `torchrun --standalone --nproc_per_node=4 train.py`")
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pin_device(local_rank)
    import_noise.quiet(gpu=device.type != "cpu")  # as on the notebook's ranks
    if device.type == "cpu":  # the cluster's policy: the cores shared by this node's ranks
        peers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, host_info()["cpus"] // peers))
    _state = RankState(
        rank=rank, world_size=world_size, cluster_rank=rank, cluster_size=world_size,
        local_rank=local_rank, device=device, backend=resolve_backend(backend, device),
        timeout=timeout,
    )
    dist.init_process_group(
        _state.backend, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout),
        device_id=device if device.type == "cuda" else None,
    )
    return namespace()


def namespace() -> dict[str, Any]:
    """The names every cell on a rank can use."""
    st = state()
    return {"rank": st.rank, "world_size": st.world_size, "device": st.device,
            "torch": torch, "dist": dist}
