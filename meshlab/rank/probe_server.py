"""Questions a rank answers from a side thread while its main thread is busy or stuck.

The cluster installs these on each engine's control channel, so `%mesh status`,
stack dumps on a timeout and tab completion work even while a cell hangs in a
collective. Plain Python and torch only.
"""

from __future__ import annotations

import json
import linecache
import os
import rlcompleter
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any

import torch

from meshlab.rank import cell_names
from meshlab.rank.cell_names import short_paths


def main_thread_stack(limit: int = 60) -> str:
    """The current Python stack of the main thread (where cells run)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "(no main thread frame)"
    if frame.f_code.co_filename.endswith(("selectors.py", "base_events.py")):
        return "(idle: waiting for the next cell)"  # the engine's event loop, not a cell
    lines = [short_paths(line) for line in traceback.format_stack(frame, limit=limit)]
    # Start at the user's cell: the engine's event-loop frames above it are noise.
    cell = [i for i, line in enumerate(lines)
            if line.lstrip().startswith(('Cell In[', 'File "cell '))]
    # and end there when it is at a pdb prompt: the debugger's frames are not the cell's
    pdb = [i for i, line in enumerate(lines) if '/bdb.py"' in line]
    return "".join(lines[cell[0] if cell else 0:pdb[0] if pdb else None]).rstrip()


def main_thread_state() -> dict[str, Any]:
    """Where the main thread is, and in what: ``state`` "collective" (in torch.distributed;
    ``place`` is then the call that got there, "`dist.all_reduce(t)` (Cell In[5], line 2)"),
    "debugger" (stopped at a breakpoint), "running" (a cell, elsewhere) or "no cell" (busy
    with something else, or done); ``place`` the innermost frame, "`time.sleep(.1)` (Cell
    In[5], line 3)"."""
    from meshlab.rank import cell_exec, debugger

    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    place = _place(frame) if frame is not None else "(no main thread frame)"
    stopped = debugger.stopped()
    if not cell_exec.running:
        state = "no cell"
    elif stopped is not None:
        state = "debugger"
        place = f"`{stopped['code']}` ({stopped['file']}, line {stopped['line']})"
    elif frame is not None and "/torch/distributed/" in frame.f_code.co_filename:
        state = "collective"
        caller = frame  # the place is the call that got there: `dist.all_reduce(t)`
        while caller.f_back is not None and "/torch/" in caller.f_code.co_filename:
            caller = caller.f_back
        place = _place(caller)
    else:
        state = "running"
    return {"state": state, "place": place}


def stop_ignored() -> dict[str, Any]:
    """Where the main thread is, once meshlab's SIGINTs have not ended its cell; a cell that
    caught one and went on is sent meshlab's stop signal (cell_exec.STOP_SIGNAL) here.

    ``state`` says which: "collective" (in torch.distributed: the SIGINT waits until the
    collective returns, at the process-group timeout, and a stop pending then would cut
    short what the cell does about it, so none is sent), "ignored" (signalled), "native" (a
    call that has not returned to Python since the SIGINT came) or "no cell" (not in a
    cell: busy with something else, or done); ``place`` as main_thread_state says.
    """
    from meshlab.rank import cell_exec

    found = main_thread_state()
    if found["state"] in ("running", "debugger"):
        if cell_exec.interrupts:  # its SIGINT handler ran, yet the cell goes on: it caught it
            found["state"] = "ignored"
            signal.pthread_kill(threading.main_thread().ident or 0, cell_exec.STOP_SIGNAL)
        else:
            found["state"] = "native"
    return {**found, "stack": main_thread_stack()}


def cell_progress() -> dict[str, Any]:
    """The running cell's id (None: no cell runs) and its optimizer.step() calls so far, which
    meshlab.runtime counts on every rank: a training loop reports steps with no code of its
    own. Two reads of module globals: cheap enough to ask every second."""
    from meshlab import runtime
    from meshlab.rank import cell_exec, cell_server

    server = cell_server._server
    cell = server.cell if server is not None and cell_exec.running else None
    return {"cell": cell, "steps": runtime.optimizer_steps - cell_exec.steps_before}


def _place(frame: Any) -> str:
    path, line = frame.f_code.co_filename, frame.f_lineno
    name = short_paths(f'File "{path}"').removeprefix('File "').strip('"')
    code = linecache.getline(path, line).strip()
    return f"`{code}` ({name}, line {line})" if code else f"{name}, line {line}"


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
    from meshlab.measure import throttle

    row["throttle"] = throttle.current_factor()  # 1.0: full speed (%mesh throttle)
    return row


def answer(request: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """The value a probe request asks for."""
    from meshlab import runtime

    what = request.get("what")
    if what == "clock":  # first: read as close to the request as can be
        return time.time_ns()
    if what == "stack":
        return main_thread_stack()
    if what == "native_stack":
        from meshlab.rank.native_stacks import native_stack

        return native_stack(cells={os.path.basename(path): n
                                   for path, n in cell_names.cell_files.items()})
    if what == "stop":
        return stop_ignored()
    if what == "where":
        return main_thread_state()
    if what == "debug":
        from meshlab.rank import debugger

        return debugger.command(str(request.get("command", "")),
                                float(request.get("wait", debugger.STEP_WAIT)))
    if what == "status":
        return rank_status(runtime._state)
    if what == "complete":
        return complete(namespace, str(request.get("text", "")))
    if what == "collectives":
        return recent_collectives(int(request.get("limit", 8)))
    if what == "optimizer_steps":
        return runtime.optimizer_steps
    if what == "progress":
        return cell_progress()
    if what == "postmortem":
        return postmortem()
    if what == "defined":
        return [n for n in request.get("names", []) if n in namespace]
    raise ValueError(f"unknown probe {what!r}: expected clock, stack, native_stack, stop, "
                     "where, debug, status, complete, collectives, optimizer_steps, "
                     "progress, postmortem or defined")


def serve(kernel: Any, namespace: dict[str, Any],
          cell_files: Mapping[str, int] | None = None) -> None:
    """Answer ``meshlab_probe_request`` messages on a Jupyter kernel's control channel.

    The control channel has its own thread, so the answer comes even while the main
    thread is stuck in a collective. ``cell_files`` maps a cell's file to its In [n]
    (IPython keeps it), so stacks name cells by number.
    """
    cell_names.cell_files = cell_files if cell_files is not None else {}

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


def recent_collectives(limit: int = 8) -> list[dict[str, Any]]:
    """The last collectives this rank issued, oldest first, from torch's flight recorder.

    On a hang the ranks' lists differ at the collective one of them skipped or called with
    other sizes. Empty when the recorder is off (runtime.setup turns it on).
    """
    recorder = torch._C._distributed_c10d
    try:  # private API (FACTS.md): gloo keeps the entries too
        dump = json.loads(recorder._dump_fr_trace_json(  # type: ignore[attr-defined]
            includeCollectives=True))
    except Exception:
        return []
    rows = []
    for e in dump.get("entries", [])[-limit:]:
        group = e.get("process_group") or ["?", ""]
        rows.append({
            "seq": e.get("collective_seq_id"),
            "op": str(e.get("profiling_name", "?")).split(":")[-1],
            "sizes": [list(s) for s in e.get("input_sizes", [])],
            "dtype": ",".join(e.get("input_dtypes", [])),
            "group": group[1] if len(group) > 1 and group[1] not in ("", "undefined")
            else f"pg {group[0]}",
            "state": "done" if e.get("retired") else "in flight",
        })
    return rows


def postmortem(limit: int = 40) -> dict[str, Any] | None:
    """The last failed cell on this rank: its traceback and the failing frame's variables.

    IPython keeps the last exception in sys.last_value; None when no cell has failed.
    """
    error = getattr(sys, "last_value", None)
    if error is None or error.__traceback__ is None:
        return None
    tb = error.__traceback__
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    # the innermost frame of the user's code (cells and their modules), not torch's internals
    user = [f for f in frames if "site-packages" not in f.tb_frame.f_code.co_filename]
    frame = (user or frames)[-1].tb_frame
    local = {name: _short_repr(value) for name, value in list(frame.f_locals.items())[:limit]
             if not name.startswith("__")}
    return {
        "error": f"{type(error).__name__}: {error}",
        "traceback": "".join(short_paths(line) for line in
                             traceback.format_exception(type(error), error, error.__traceback__)),
        "frame": f"{short_paths(frame.f_code.co_filename)}, line {frame.f_lineno}, in "
                 f"{frame.f_code.co_name}",
        "locals": local,
    }


def _short_repr(value: Any, width: int = 120) -> str:
    if isinstance(value, torch.Tensor):
        kind = type(value).__name__
        return f"{kind}(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device})"
    try:
        text = repr(value)
    except Exception as e:
        text = f"<repr failed: {e!r}>"
    return text if len(text) <= width else text[:width - 3] + "..."
