"""A rank's native stack: ``py-spy dump --native`` of its own process, its main thread's
frames, C and C++ (gloo's, NCCL's, libc's) among the Python ones. What a rank stuck inside a
collective is doing below Python.

The rank asks py-spy about itself from the probe server's thread, so it answers while a cell
runs or hangs. py-spy reads the rank's memory through ptrace, which Linux allows a process of
the same user; where Yama restricts it to the traced process's ancestors
(``kernel.yama.ptrace_scope`` 1, Ubuntu's default) the rank names py-spy's process its
tracer first (``PR_SET_PTRACER``), before py-spy attaches. A missing py-spy, or a kernel
or container that forbids ptrace altogether, is said in the reply instead of a stack.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PR_SET_PTRACER = 0x59616D61
"""prctl's option (Yama): let this process be traced by the one named."""
MISSING = ("py-spy is not installed where this rank runs ({python}): pip install py-spy "
           "(or meshlab's debug extra, pip install 'meshlab[debug]'), then %mesh stacks "
           "--native again")
FORBIDDEN = ("py-spy may not attach to this rank (pid {pid}): the kernel or the container "
             "forbids ptrace (kernel.yama.ptrace_scope 2 or 3, or no CAP_SYS_PTRACE in a "
             "container); %mesh stacks shows the Python frames without it. py-spy said: {said}")


def py_spy() -> str | None:
    """py-spy beside this interpreter, or on PATH."""
    beside = str(Path(sys.executable).parent)
    return shutil.which("py-spy", path=os.pathsep.join([beside, os.environ.get("PATH", "")]))


def native_stack(timeout: float = 20.0, cells: dict[str, int] | None = None) -> str:
    """This process's main thread as ``py-spy dump --native`` sees it (addresses that differ
    from process to process written ``0x…``, so that ranks stuck alike read alike; a cell's
    file, named in ``cells`` by its base name, as ``Cell In[n]``), or why there is none."""
    exe = py_spy()
    if exe is None:
        return MISSING.format(python=sys.executable)
    # py-spy runs once this process has named it its tracer: a pause, then exec (same pid)
    proc = subprocess.Popen(["/bin/sh", "-c", 'sleep 0.2; exec "$0" dump --native --pid "$1"',
                             exe, str(os.getpid())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _let_trace(proc.pid)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"py-spy did not finish within {timeout:g} s (pid {os.getpid()})"
    if proc.returncode:
        said = next((line for line in err.splitlines() if line.strip()), "no message")
        if "ermission" in err or "not permitted" in err:
            return FORBIDDEN.format(pid=os.getpid(), said=said)
        return f"py-spy failed on this rank (pid {os.getpid()}): {said}"
    return main_thread(out, cells or {})


def _let_trace(pid: int) -> None:
    """Name ``pid`` this process's tracer where Yama asks for one (elsewhere a no-op)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, pid, 0, 0, 0)


def main_thread(dump: str, cells: dict[str, int] | None = None) -> str:
    """The main thread's block of a py-spy dump as a stack of a cell reads: down to the cell
    (the engine's frames below it left out), raw addresses elided, C++ template arguments
    folded, colours dropped."""
    lines = [ANSI.sub("", line) for line in dump.splitlines()]
    start = next((i for i, line in enumerate(lines)
                  if line.startswith("Thread ") and '"MainThread"' in line), None)
    if start is None:
        return "\n".join(lines).strip()
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("Thread ")),
               len(lines))
    state = re.search(r"\((\w+)\)", lines[start])
    frames = []
    for line in lines[start + 1:end]:
        if ENGINE in line:
            frames.append("    … (the engine's frames below the cell)")
            break
        line = re.sub(r"\((\d+\.py):(\d+)\)",  # a cell: as a Python stack names it
                      lambda m: (f"(Cell In[{cells[m[1]]}], line {m[2]})"
                                 if cells and m[1] in cells else m[0]), line)
        frames.append(_folded(re.sub(r"0x[0-9a-fA-F]+", "0x…", line)))
    head = f"main thread ({state[1] if state else 'unknown'}), native frames included:"
    return "\n".join([head, *frames])


ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENGINE = "(meshlab/rank/cell_exec.py"
"""The frame that runs a cell: those below it are the engine's, the same on every rank."""


INNERMOST = re.compile(r"<((?:[^<>()]|<…>|\(…\))*)>|\(((?:[^<>()]|<…>|\(…\))*)\)")


def _folded(frame: str, width: int = 120) -> str:
    """A frame over ``width`` characters with its innermost <...> and (...) folded to <…>
    and (…) until it fits (pybind11's dispatchers run to 2,000 characters); the last
    parenthesis, the frame's library or file, stays."""
    where = frame.rfind(" (")
    name, place = (frame[:where], frame[where:]) if where > 0 else (frame, "")

    def fold(m: re.Match[str]) -> str:
        if m[1] is not None:
            return m[0] if m[1] == "…" else "<…>"
        return m[0] if m[2] == "…" else "(…)"

    while len(name) + len(place) > width:
        folded = INNERMOST.sub(fold, name)
        if folded == name:
            break
        name = folded
    return name + place
