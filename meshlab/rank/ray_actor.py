"""One rank on a Ray cluster: the actor that holds the rank's bundle of the placement group
and runs its engine (meshlab.notebook.ray_launcher starts one per rank).

The engine is the actor's child, the same ipyparallel engine every other profile starts: a
cell, Ctrl-C (SIGINT from the engine's own control channel), a time limit and the process
group behave as they do there. The child dies with the actor (PR_SET_PDEATHSIG), so a
killed actor, a stopped job or a notebook that died leaves no rank behind. GPUs are Ray's
to assign: the actor's CUDA_VISIBLE_DEVICES, which the child inherits.

Stdlib only (Ray imports it on its worker nodes).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections import deque
from typing import Any

PR_SET_PDEATHSIG = 1  # prctl(2): a signal for the child when its parent thread ends


def _as_a_rank() -> None:
    """In the engine's process before it starts: it takes signals as a process started
    from a shell does (Ray's worker threads block SIGINT, and a child inherits the mask:
    Ctrl-C and time limits would wait forever), and it dies with the actor."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class RankActor:
    """Starts one engine, tells where it runs, waits for it, signals it, shows its log.
    Ray runs its methods on threads (max_concurrency): ``wait`` blocks while the others
    answer."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.log = ""

    def start(self, argv: list[str], env: dict[str, str], log: str) -> dict[str, Any]:
        """Start the engine (``argv`` after this node's Python) with ``env`` over the
        actor's own; its output goes to ``log`` on this node."""
        os.makedirs(os.path.dirname(log), mode=0o700, exist_ok=True)
        self.log = log
        with open(log, "ab") as out:
            os.chmod(log, 0o600)
            self.process = subprocess.Popen(
                [sys.executable, *argv], env={**os.environ, **env}, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=_as_a_rank)
        return {"pid": self.process.pid, "host": socket.gethostname(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def wait(self) -> int:
        """The engine's exit code (minus the signal that ended it), once it has ended."""
        assert self.process is not None
        return self.process.wait()

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(sig)

    def tail(self, lines: int = 30) -> str:
        """The engine's last lines of output."""
        try:
            with open(self.log, errors="replace") as f:
                return "".join(deque(f, maxlen=lines))
        except OSError as e:
            return f"(no output on {socket.gethostname()}: {e})"
