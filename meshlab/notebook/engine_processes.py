"""The engine processes a notebook launched: are they alive, how did they end, what did they log.

Notebook side, but free of ipyparallel imports: it reads the launcher objects it is given.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import psutil

from meshlab.notebook import forkserver


class EngineProcesses:
    """Watches the engine processes of an ipyparallel cluster started from this process."""

    def __init__(self, ipp_cluster: Any | None = None) -> None:
        self._cluster = ipp_cluster

    def _engine_sets(self) -> list[Any]:
        return list(self._cluster.engines.values()) if self._cluster is not None else []

    def _launchers(self) -> list[Any]:
        return [launcher for engine_set in self._engine_sets()
                for launcher in getattr(engine_set, "launchers", {}).values()]

    def exit_codes(self) -> dict[int, int | None]:
        """pid -> exit code (minus the signal), None while running: the engines this process
        started, a forkserver's (or mpiexec's) own process, and the engines a forkserver on
        this host forked and reaped. Remote launchers report nothing here."""
        codes: dict[int, int | None] = {}
        for launcher in [*self._launchers(), *self._engine_sets()]:
            process = getattr(launcher, "process", None)  # a psutil.Process of our child
            if process is not None:
                try:
                    codes[process.pid] = process.wait(0)  # reaps it; psutil keeps the code
                except psutil.TimeoutExpired:
                    codes[process.pid] = None
            if getattr(launcher, "exits_file", None):
                codes.update(forkserver.exit_codes(launcher.exits_file))
            for (_, pid), (code, _) in getattr(launcher, "ended", {}).items():  # Ray's ranks
                codes[pid] = -1 if code is None else code
        return codes

    def reason(self, host: str, pid: int, wait: float = 0.0) -> str | None:
        """How a rank on another host ended, where its launcher knows (Ray's actors), given
        up to ``wait`` seconds to say."""
        for engine_set in self._engine_sets():
            said = getattr(engine_set, "reason", None)
            if callable(said) and (why := said(host, pid, wait)):
                return str(why)
        return None

    def cause_of_death(self, pid: int, wait: float = 2.0) -> str:
        """``killed by SIGKILL``, ``exited with status 1``, or what we can say from afar.

        The controller may see an engine go before its process is reaped: one of ours (a
        child of this process, or a rank a forkserver here forked, which it records once it
        has reaped it) gets up to ``wait`` seconds to show how it ended."""
        codes = self.exit_codes()
        ours = pid in codes or any(getattr(s, "exits_file", None) for s in self._engine_sets())
        code, deadline = codes.get(pid), time.monotonic() + wait
        while code is None and ours and time.monotonic() < deadline:
            time.sleep(0.05)
            code = self.exit_codes().get(pid)
        if code is None:
            return "its engine stopped responding"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def log_tail(self, lines: int = 30) -> str:
        """The last lines the engines wrote, for start-up failures."""
        text = []
        for engine_set in self._engine_sets():
            try:
                text.append(engine_set.get_output())
            except Exception as e:
                text.append(f"(no engine output: {e!r})")
        tail = "\n".join("".join(text).splitlines()[-lines:])
        return tail or "(the engines wrote nothing)"
