"""Second and third local accounts for the security tests (CI runs as root): an intruder,
and a victim that is a normal account, as on a shared GPU node.

The victim runs meshlab from this checkout and this environment, which may sit under folders
only root can enter (/root, a mkdtemp): its session runs in a mount namespace of its own
where both are bound at a path it can reach, and nothing else of the machine changes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import meshlab

# What an attacker's script (another user, the system's Python) starts with: every TCP socket
# a uid listens on (any user may read /proc/net/tcp), and reading exactly n bytes from one.
SOCKETS_OF = r"""
import ipaddress


def listeners(uid):
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or int(fields[7]) != uid:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # little-endian 32-bit words
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1]
                                                   for i in range(0, len(raw), 4)))
                if ip.version == 6 and ip.ipv4_mapped:
                    ip = ip.ipv4_mapped
                if ip.is_unspecified:  # every interface: loopback too
                    ip = ipaddress.ip_address("::1" if ip.version == 6 else "127.0.0.1")
                yield str(ip), int(port, 16)


def exactly(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data
"""
SYSTEM_PYTHON = "/usr/bin/python3"  # the intruder cannot enter /root, where ours may live
REPO = Path(meshlab.__file__).resolve().parents[1]


def local_user(name: str, home: bool = False) -> str:
    """``name``, an unprivileged local account made here; with ``home``, Debian's default
    0755 home folder in /home."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("runuser"):
        pytest.skip("creating a second local user needs root and useradd/runuser")
    if subprocess.run(["id", name], capture_output=True).returncode != 0:
        subprocess.run(["useradd", "--create-home" if home else "--no-create-home",
                        "--shell", "/usr/sbin/nologin", name], check=True)
    if home:
        os.chmod(Path("~" + name).expanduser(), 0o755)
    return name


def as_user(user: str, code: str, *args: str, timeout: float = 60
            ) -> subprocess.CompletedProcess[str]:
    """Python ``code`` run as ``user`` by the system's interpreter (no meshlab, no zmq),
    with ``args`` in its sys.argv."""
    return subprocess.run(["runuser", "-u", user, "--", SYSTEM_PYTHON, "-c", code, *args],
                          capture_output=True, text=True, timeout=timeout, cwd="/")


@contextlib.contextmanager
def meshlab_as(user: str, code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """``code`` (``args`` in its sys.argv) run as ``user`` by this environment's Python with
    this checkout's meshlab,
    in a clean environment with the user's home; stdin and stdout are pipes. Killed (the
    whole namespace's first process) on the way out if still running."""
    home = Path("~" + user).expanduser()
    bound = Path(tempfile.mkdtemp(prefix="meshlab-as-user-"))
    os.chmod(bound, 0o755)
    (bound / "env").mkdir()
    (bound / "repo").mkdir()
    env = bound / "env"
    python = env / Path(sys.executable).relative_to(sys.prefix)
    script = (f"mount --bind {sys.prefix} {env} && mount --bind {REPO} {bound / 'repo'} && "
              f"exec runuser -u {user} -- env -i HOME={home} PATH=/usr/bin:/bin "
              f"PYTHONPATH={bound / 'repo'} {python} -c \"$0\" \"$@\"")
    proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             script, code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)
        shutil.rmtree(bound, ignore_errors=True)
