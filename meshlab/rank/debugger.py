"""``breakpoint()`` in a cell: pdb on the rank's main thread, driven from the notebook.

The main thread stops in a RankPdb whose commands come from a queue and whose answers go to
a buffer: the probe thread (probe_server, request "debug") puts a command in and returns
what pdb wrote until it asks for the next one. The notebook learns that a rank stopped from
a notice on the cell channel (cell_server.notify), sent as the prompt opens. Ctrl-C and
meshlab's stop signal end the debugger and the cell, as they end a cell that is not stopped.

Plain Python: the shell is the engine's, never imported.
"""

from __future__ import annotations

import linecache
import pdb
import queue
import sys
import threading
from types import FrameType, TracebackType
from typing import Any

from meshlab.rank.cell_names import short_paths

STEP_WAIT = 2.0  # seconds a stepping command gets to stop again before it reads as running
_LEAVE = {"c", "cont", "continue", "q", "quit", "exit"}  # commands that do not stop again
_debugger: RankPdb | None = None  # the one the main thread is in, if any


class RankPdb(pdb.Pdb):
    """pdb reading its commands from the notebook and writing its answers back."""

    def __init__(self) -> None:
        super().__init__(stdin=self, stdout=self, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.use_rawinput = False
        self.prompt = ""  # the notebook writes its own, naming the rank
        self._commands: queue.Queue[str] = queue.Queue()
        self._changed = threading.Condition()  # guards what follows
        self._written: list[str] = []
        self.waiting = False  # at the prompt, a command awaited
        self.taken = 0  # commands read
        self.stops = 0  # prompts opened, so a caller tells a new stop from the last

    # pdb's stdout and stdin
    def write(self, text: str) -> int:
        with self._changed:
            self._written.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        with self._changed:
            self.waiting = True
            self._changed.notify_all()
        try:
            while True:  # in short waits: Ctrl-C's KeyboardInterrupt is raised between them
                try:
                    return self._commands.get(timeout=0.1) + "\n"
                except queue.Empty:
                    continue
        finally:
            with self._changed:
                self.waiting, self.taken = False, self.taken + 1
                self._changed.notify_all()

    def _cmdloop(self) -> None:
        # pdb's own catches KeyboardInterrupt and prompts again; here Ctrl-C (and a time
        # limit, which sends it) ends the cell as it would anywhere else in it
        self.cmdloop()

    def interaction(self, frame: FrameType | None, traceback: TracebackType | None) -> None:
        global _debugger
        outer, _debugger = _debugger, self
        self.stops += 1
        try:
            self.setup(frame, traceback)
            from meshlab.rank import cell_server

            cell_server.notify({"debugger": where(self)})
            self.print_stack_entry(self.stack[self.curindex])
            self._cmdloop()
            self.forget()
        finally:
            _debugger = outer
            with self._changed:
                self._changed.notify_all()

    def answer(self, command: str, wait: float) -> dict[str, Any]:
        """Run ``command`` at the prompt (from another thread); what pdb wrote, and
        whether the rank is stopped again (where) or went on."""
        with self._changed:
            if not self.waiting:
                return {"state": "running", "output": ""}
            del self._written[:]
            taken = self.taken
            self._commands.put(command)
            self._changed.wait_for(lambda: self.taken > taken, timeout=wait)
            leaves = bool(command.strip()) and command.split(maxsplit=1)[0] in _LEAVE
            # it leaves: the answer ends as it does; it steps: at the next prompt, or it
            # reads as running
            self._changed.wait_for(lambda: (self.waiting or _debugger is not self) if leaves
                                   else (self.waiting and _debugger is self), timeout=wait)
            output = short_paths("".join(self._written))
            del self._written[:]
            stopped = self.waiting and _debugger is self
            return {"state": "stopped" if stopped else "running", "output": output,
                    **({"where": where(self)} if stopped else {})}


def where(debugger: pdb.Pdb) -> dict[str, Any]:
    """The frame a stopped debugger is at: file, line, function and the line's code."""
    frame, line = debugger.stack[debugger.curindex]
    path = frame.f_code.co_filename
    return {"file": short_paths(f'File "{path}"').removeprefix('File "').strip('"'),
            "line": line, "function": frame.f_code.co_name,
            "code": linecache.getline(path, line, frame.f_globals).strip()}


def command(line: str, wait: float = STEP_WAIT) -> dict[str, Any]:
    """Probe "debug": give ``line`` to the debugger the main thread is in."""
    debugger = _debugger
    if debugger is None:
        return {"state": "running", "output": ""}
    return debugger.answer(line, wait)


def stopped() -> dict[str, Any] | None:
    """Where the main thread's debugger is waiting for a command; None when it is not."""
    debugger = _debugger
    return where(debugger) if debugger is not None and debugger.waiting else None


def breakpointhook(*args: Any, **kwargs: Any) -> None:
    """``breakpoint()`` on a rank: stop the cell's main thread for the notebook's debugger;
    anywhere else (a thread, between cells) there is no one to ask, so it says so and goes on."""
    from meshlab.rank import cell_exec

    if not cell_exec.running or threading.current_thread() is not threading.main_thread():
        print("breakpoint() skipped: meshlab's debugger stops a cell's main thread only",
              file=sys.stderr)
        return
    caller = sys._getframe(1)
    RankPdb().set_trace(caller)


def post_mortem() -> None:
    """pdb at the frame where the last failed cell raised (the notebook's ``--live``)."""
    error = getattr(sys, "last_value", None)
    if error is None or error.__traceback__ is None:
        raise RuntimeError("no cell has failed on this rank: nothing to debug post-mortem")
    debugger = RankPdb()
    debugger.reset()
    debugger.interaction(None, error.__traceback__)


def install() -> None:
    sys.breakpointhook = breakpointhook
