"""Where the ranks run: hosts, the device's name, memory per rank, and which axis crosses hosts."""

from __future__ import annotations

import socket
from typing import Any

import torch
import torch.distributed as dist

from meshlab.calibrate.collectives import CollectiveFit
from meshlab.plan.hardware import GIB


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return models[0] if models else "cpu"
    except OSError:
        return "cpu"


def _memory(device: torch.device, ranks_here: int) -> tuple[float, float]:
    """(GiB per rank, GiB already taken outside torch) on this rank."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        taken = total - free - torch.cuda.memory_reserved(device)
        return total / GIB, max(0.0, taken / GIB)
    import psutil

    return psutil.virtual_memory().total / ranks_here / GIB, 0.0


def host_facts(device: torch.device) -> tuple[dict[str, list[int]], float, float]:
    """(host -> its ranks, smallest GiB per rank, largest GiB taken outside torch); every
    rank calls it."""
    hostnames: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hostnames, socket.gethostname())
    hosts: dict[str, list[int]] = {}
    for r, h in enumerate(hostnames):
        hosts.setdefault(h, []).append(r)
    memory, reserved = _memory(device, len(hosts[socket.gethostname()]))
    facts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(facts, (memory, reserved))
    return hosts, min(m for m, _ in facts), max(r for _, r in facts)


def choose_axes(fits: list[CollectiveFit], hosts: dict[str, list[int]]
                ) -> tuple[str | None, str | None, list[str]]:
    """The widest axis whose groups stay on one host, and the widest one that spans hosts."""
    host_of = {r: h for h, ranks in hosts.items() for r in ranks}
    axes: dict[str, tuple[int, bool]] = {}
    for f in fits:
        inside = all(len({host_of[r] for r in g}) == 1 for g in f.groups)
        axes.setdefault(f.axis, (f.ranks, inside))
    intra = max((a for a, (_, inside) in axes.items() if inside), key=lambda a: axes[a][0],
                default=None)
    inter = max((a for a, (_, inside) in axes.items() if not inside), key=lambda a: axes[a][0],
                default=None)
    notes = []
    if inter is None and intra is not None:
        notes.append(f"every group is inside one host: the inter link is the intra one "
                     f"({intra}); calibrate across nodes to measure the network")
    if intra is None and inter is not None:
        notes.append(f"no two ranks share a host: the intra link is the inter one ({inter})")
    return intra, inter, notes
