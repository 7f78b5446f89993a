"""Where a rank sits on the network: the address a rendezvous store binds, whether a host is
this machine's loopback, the route and interface toward the controller, and the ports left
to pick. Rank-side: plain sockets, no IPython or ipyparallel."""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Any

import torch


def ephemeral_port_floor() -> int:
    """Lowest port the kernel hands out on its own; ports we pick stay below it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bind_address(host: str) -> str | None:
    """The address the store listens on for ``host``; None (all interfaces) for a host name,
    which may resolve to another address here than on the peers (Debian's 127.0.1.1)."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (then every rank runs here)."""
    address = bind_address(host)
    return address is not None and ipaddress.ip_address(address).is_loopback


def listen_socket(address: str, port: int) -> int:
    """A listening socket on ``address:port``, as a file descriptor the store takes over."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock.detach()


def host_info(reach: str = "127.0.0.1") -> dict[str, Any]:
    """Where this process runs: its host, and the address and interface it reaches ``reach``
    (the controller) from, which is the network its peers share with it."""
    address = route_to(reach)
    return {
        "host": socket.gethostname(),
        "addr": address,
        "iface": interface_of(address),
        "pid": os.getpid(),
        "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
        else os.cpu_count() or 1,
    }


def route_to(host: str) -> str:
    """This machine's address on the route to ``host`` (the kernel picks it; nothing is
    sent: connecting a UDP socket only looks the route up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address``, or None."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            return name
    return None
