"""Questions a rank answers from a side thread while its main thread is busy or stuck.

The cluster installs these on each engine's control channel, so `%mesh status`,
stack dumps on a timeout and tab completion work even while a cell hangs in a
collective. Plain Python and torch only.
"""

from __future__ import annotations

import os
import re
import rlcompleter
import socket
import sys
import threading
import traceback
from typing import Any

import torch


def main_thread_stack(limit: int = 60) -> str:
    """The current Python stack of the main thread (where cells run)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "(no main thread frame)"
    lines = [_short_paths(line) for line in traceback.format_stack(frame, limit=limit)]
    # Start at the user's cell: the engine's event-loop frames above it are noise.
    cell = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "cell ')]
    return "".join(lines[cell[0]:] if cell else lines).rstrip()
    return "".join(lines).rstrip()


def _short_paths(line: str) -> str:
    # Same code on every rank should give the same text, so stacks group across ranks.
    line = re.sub(r"/tmp/ipykernel_\d+/", "cell ", line)
    return re.sub(r'"[^"]*/site-packages/', '"', line)


def rss_bytes() -> int:
    """Resident memory of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_status(state: Any | None) -> dict[str, Any]:
    """One row of `%mesh status`, from this rank."""
    row: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(state.device) if state is not None else "?",
        "rss_mb": round(rss_bytes() / 2**20, 1),
    }
    if state is not None and state.device.type == "cuda":
        row["gpu_mem_mb"] = round(torch.cuda.memory_allocated(state.device) / 2**20, 1)
        row["gpu_peak_mb"] = round(torch.cuda.max_memory_allocated(state.device) / 2**20, 1)
    return row


def answer(request: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """The value a probe request asks for."""
    from meshlab import runtime

    what = request.get("what")
    if what == "stack":
        return main_thread_stack()
    if what == "status":
        return rank_status(runtime._state)
    if what == "complete":
        return complete(namespace, str(request.get("text", "")))
    raise ValueError(f"unknown probe {what!r}: expected stack, status or complete")


def serve(kernel: Any, namespace: dict[str, Any]) -> None:
    """Answer ``meshlab_probe_request`` messages on a Jupyter kernel's control channel.

    The control channel has its own thread, so the answer comes even while the main
    thread is stuck in a collective.
    """

    def handle(stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        try:
            reply = {"status": "ok", "value": answer(parent["content"], namespace)}
        except Exception as e:
            reply = {"status": "error", "ename": type(e).__name__, "evalue": str(e)}
        kernel.session.send(stream, "meshlab_probe_reply", reply, parent, ident)

    kernel.control_handlers["meshlab_probe_request"] = handle


def complete(namespace: dict[str, Any], text: str, limit: int = 200) -> list[str]:
    """Completions of ``text`` (a name or dotted attribute path) in a rank's namespace."""
    completer = rlcompleter.Completer(namespace)
    matches: list[str] = []
    for i in range(limit):
        match = completer.complete(text, i)
        if match is None:
            break
        matches.append(match.rstrip("("))
    return sorted(set(matches))
