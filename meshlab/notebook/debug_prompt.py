"""The debugger's prompt: a rank stopped at ``breakpoint()`` is debugged from where ``input()``
reads, the kernel's stdin in JupyterLab, the classic notebook and IPython (a terminal for a
script using Session).

Each line is a pdb command for the attached rank, or one of the mesh's own:
``%mesh debug list``, ``%mesh debug attach N``, ``%mesh debug cast RANKS CMD``.
``continue`` and ``quit`` end it for every stopped rank, and the cell goes on. The cell's
time limit still holds at the prompt, and Ctrl-C still stops the cell.
"""

from __future__ import annotations

import builtins
import contextlib
import shlex
import signal
import threading
import time
from collections.abc import Callable, Iterator

from meshlab.notebook.debugger import Debugger, DebuggerTimeout, where_text
from meshlab.notebook.output import group, render_groups
from meshlab.notebook.ranks import label

HELP = ("pdb commands go to the attached rank; `%mesh debug list` shows the stopped ranks, "
        "`%mesh debug attach N` picks one, `%mesh debug cast RANKS CMD` sends one command to "
        "several; `continue` or `quit` ends it for every stopped rank")
_ENDS = {"c": "continue", "cont": "continue", "continue": "continue",
         "q": "quit", "quit": "quit", "exit": "quit"}


class Prompt:
    """Reads lines for a Debugger until no rank is stopped; ``transcript`` keeps what it
    showed (the cell's live output is replaced when it ends)."""

    def __init__(self, read: Callable[[str], str] | None = None,
                 write: Callable[[str], None] = print) -> None:
        """``read``: by default ``input``, looked up as it reads (the kernel puts its own
        there while a cell runs)."""
        self._read = read or (lambda prompt: builtins.input(prompt))
        self._write = write
        self.transcript: list[str] = []
        self._helped = False

    def __call__(self, debugger: Debugger) -> None:
        self._show_stops(debugger)
        while (stopped := debugger.stopped()) and debugger.rank is not None:
            try:
                with _deadline(debugger.deadline, sorted(stopped)):
                    line = self._read(self._prompt(debugger))
            except EOFError:  # nothing more to read (a script's closed stdin): they go on
                self._show("stdin closed: the stopped ranks continue")
                return
            except Exception as e:  # IPython's StdinNotImplementedError: nbclient, nbconvert
                if type(e).__name__ != "StdinNotImplementedError":
                    raise
                self._show("this front end cannot answer a prompt (no stdin): the stopped "
                           "ranks continue. JupyterLab, the notebook and IPython give one; "
                           "from code: Session.run(code, on_breakpoint=...)")
                return
            self.transcript.append(self._prompt(debugger) + line)
            self._run(debugger, line.strip())
            self._show_stops(debugger)

    def _run(self, debugger: Debugger, line: str) -> None:
        words = shlex.split(line) if line.startswith("%mesh") else []
        try:
            if words[:2] == ["%mesh", "debug"]:
                self._mesh_command(debugger, words[2:], line)
            elif line.split(maxsplit=1)[:1] and line.split()[0] in _ENDS:
                getattr(debugger, "cont" if _ENDS[line.split()[0]] == "continue" else "quit")()
            else:
                self._show(debugger.send(line).rstrip("\n"))
        except ValueError as e:  # a rank not stopped, a bad rank list: said, then go on
            self._show(str(e))

    def _mesh_command(self, debugger: Debugger, words: list[str], line: str) -> None:
        if words == ["list"]:
            self._show(debugger.list().to_string())
        elif len(words) == 2 and words[0] == "attach" and words[1].isdigit():
            at = debugger.attach(int(words[1]))
            self._show(f"attached to rank {words[1]}: {where_text(at)}, `{at['code']}`")
        elif len(words) >= 3 and words[0] == "cast":
            command = line.split(maxsplit=4)[4]  # as typed: pdb's own quoting left alone
            self._show(render_groups({r: text or "(no output)\n" for r, text in
                                      debugger.cast(words[1], command).items()}))
        else:
            raise ValueError(f"not a debugger command: {line!r}. {HELP}")

    def _show_stops(self, debugger: Debugger) -> None:
        """Ranks newly stopped, where, and what the others do."""
        if not debugger.has_news():
            return
        others = debugger.others()  # first: it waits for the stops on their way
        stops = {r: debugger.was_stopped[r] for r in debugger.news()}
        for rs, text in group({r: f"{where_text(at)}, in {at['function']}: `{at['code']}`"
                               for r, at in stops.items()}):
            self._show(f"{label(rs)} stopped at {text}")
        for rs, text in group(others):
            self._show(f"{label(rs)} {text}")
        if any(text.startswith("waiting in") for text in others.values()):
            timeout = debugger.cluster.profile.pg_timeout
            self._show(f"(a collective waits at most the process group's timeout, {timeout:g} s "
                       "in this profile: continue before it, or its ranks fail)")
        if not self._helped:
            self._helped = True
            self._show(HELP)

    def _prompt(self, debugger: Debugger) -> str:
        rank = debugger.rank
        spec = debugger.cluster.mesh_spec
        coords = spec.coordinates_of(rank) if spec is not None and rank is not None else {}
        where = " ".join(f"{k}={v}" for k, v in coords.items())
        return f"(Pdb rank {rank}{' ' + where if where else ''}) "

    def _show(self, text: str) -> None:
        if text:
            self.transcript.append(text)
            self._write(text)


@contextlib.contextmanager
def _deadline(deadline: float | None, stopped: list[int]) -> Iterator[None]:
    """Raise DebuggerTimeout in a read that outlives the cell's time limit (SIGALRM: the
    prompt waits in the kernel's stdin, which nothing else wakes)."""
    if deadline is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise DebuggerTimeout(f"the cell's time limit passed with {label(stopped)} in the debugger")

    def expire(signum: int, frame: object) -> None:
        raise DebuggerTimeout(f"the cell's time limit passed with {label(stopped)} at the "
                              "debugger's prompt")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, left)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
