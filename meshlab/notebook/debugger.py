"""The notebook's handle on ranks stopped at ``breakpoint()`` in a running cell.

A rank's pdb (meshlab.rank.debugger) runs on its main thread; its commands travel as probes
on the control channel, answered from the rank's side thread. A cell's wait (CellRun) hands a
Debugger to its ``on_breakpoint`` when a rank stops; the handler drives it (the notebook's
prompt, meshlab.notebook.debug_prompt, or a test or script) and the cell goes on when it
returns: ranks still stopped then are continued.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import pandas as pd

from meshlab.notebook.ranks import label, ranks_are
from meshlab.rank.debugger import STEP_WAIT

if TYPE_CHECKING:
    from meshlab.notebook.cell_channel import SentCell
    from meshlab.notebook.cluster import Cluster


class DebuggerTimeout(Exception):
    """The cell's time limit passed while a rank was stopped in the debugger."""


class Debugger:
    """Ranks of one running cell stopped in pdb: list them, attach to one, send it pdb
    commands, cast one command to several, continue or quit them."""

    def __init__(self, cluster: Cluster, cell: SentCell, deadline: float | None,
                 refresh: Callable[[], None]) -> None:
        """``deadline``: the cell's (time.monotonic()); ``refresh``: files what the ranks
        sent since (notices, output) and shows the output."""
        self.cluster, self.cell, self.deadline = cluster, cell, deadline
        self._refresh = refresh
        self.rank: int | None = None  # the attached rank: where send() goes
        self._where: dict[int, dict[str, Any]] = {}  # rank -> where it stopped
        self._seen = {r: 0 for r in cell.ranks}  # stop notices taken, by rank
        self.was_stopped: dict[int, dict[str, Any]] = {}  # every rank that stopped, last place
        self._news: set[int] = set()  # stopped since news() was last asked
        self.take_notices()

    def take_notices(self) -> None:
        """File the ranks' new stops (notices on the cell channel)."""
        self._refresh()
        for r, got in self.cell.replies.items():
            if got.stops > self._seen[r] and got.stop is not None and got.reply is None:
                self._seen[r] = got.stops
                self._where[r] = self.was_stopped[r] = got.stop
                self._news.add(r)
            elif got.reply is not None:  # its cell ended
                self._where.pop(r, None)
        if self.rank is None or self.rank not in self._where:
            self.rank = min(self._where, default=None)

    def has_news(self) -> bool:
        """Has a rank stopped since news() was last asked?"""
        self.take_notices()
        return bool(self._news)

    def news(self) -> list[int]:
        """The ranks that stopped since the last call (a step's stop is not news)."""
        self.take_notices()
        news, self._news = sorted(self._news), set()
        return news

    def stopped(self) -> dict[int, dict[str, Any]]:
        """Rank -> where it is stopped: file, line, function, code."""
        self.take_notices()
        return dict(self._where)

    def list(self) -> pd.DataFrame:
        """One row per stopped rank: mesh coordinates, host and where."""
        rows = []
        spec = self.cluster.mesh_spec
        for r, at in sorted(self.stopped().items()):
            coords = spec.coordinates_of(r) if spec is not None else {}
            rows.append({"rank": r, "coordinates": " ".join(f"{k}={v}" for k, v in coords.items()),
                         "host": self.cluster._hosts[r]["host"], "where": where_text(at),
                         "function": at["function"], "attached": r == self.rank})
        columns = ["rank", "coordinates", "host", "where", "function", "attached"]
        return pd.DataFrame(rows, columns=columns).set_index("rank")

    def others(self) -> dict[int, str]:
        """What the ranks not stopped are doing: "running `code` (place)", "waiting in
        `dist.all_reduce(t)` (place)" or "done"."""
        self.take_notices()
        rest = [r for r in self.cell.ranks if r not in self._where]
        done = {r for r in rest if self.cell.replies[r].reply is not None}
        found = self.cluster._probe([r for r in rest if r not in done], "where")
        late = {r for r, at in found.items() if at["state"] == "debugger"}
        deadline = time.monotonic() + 2.0  # stopped, its notice on the way: stopped, not other
        while late - set(self._where) and time.monotonic() < deadline:
            time.sleep(0.02)
            self.take_notices()
        rest = [r for r in rest if r not in self._where]
        words = {"collective": "waiting in", "running": "running", "debugger": "stopped at"}
        answer = {r: "done" for r in done}
        for r in rest:
            if r in found:
                state = found[r]["state"]
                answer[r] = (f"{words[state]} {found[r]['place']}" if state in words
                             else "done")
            elif r not in done:
                answer[r] = "not answering"
        return answer

    def attach(self, rank: int) -> dict[str, Any]:
        """Make ``rank`` the one send() talks to; where it is stopped."""
        stopped = self.stopped()
        if rank not in stopped:
            raise ValueError(f"rank {rank} is not stopped in the debugger: "
                             f"{self._stopped_text(stopped)}")
        self.rank = rank
        return stopped[rank]

    def send(self, command: str, rank: int | None = None) -> str:
        """One pdb command to ``rank`` (the attached one by default); what pdb answered."""
        target = self.rank if rank is None else rank
        if target is None:
            raise ValueError(f"no rank to send {command!r} to: {self._stopped_text({})}")
        return self.cast([target], command)[target]

    def cast(self, ranks: Iterable[int] | str, command: str) -> dict[int, str]:
        """One pdb command to each of ``ranks`` that is stopped, side by side; each one's
        answer. A rank that does not stop again within the wait reads as running."""
        chosen = self.cluster._ranks(ranks, check_dead=False) if isinstance(ranks, str) \
            else list(ranks)
        stopped = self.stopped()
        missing = [r for r in chosen if r not in stopped]
        if missing:
            raise ValueError(f"{ranks_are(missing)} not stopped in the debugger: "
                             f"{self._stopped_text(stopped)}")
        wait = STEP_WAIT
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise DebuggerTimeout(f"the cell's time limit passed with "
                                      f"{label(sorted(stopped))} in the debugger")
            wait = min(wait, left)
        replies = self.cluster._probe(chosen, "debug", timeout=wait + 5.0, command=command,
                                      wait=wait)
        answers = {}
        for r in chosen:
            reply = replies.get(r)
            if reply is None:
                answers[r] = "(no answer: the rank did not reply to the debugger)"
                continue
            answers[r] = reply["output"]
            if reply["state"] == "stopped":
                self._where[r] = self.was_stopped[r] = reply["where"]
            else:
                self._where.pop(r, None)
        for r in chosen:  # a step's stop comes as a notice too: it is not news
            self._refresh()
            self._seen[r] = self.cell.replies[r].stops
        if self.rank not in self._where:
            self.rank = min(self._where, default=None)
        self._refresh()
        return answers

    def cont(self, ranks: Iterable[int] | None = None) -> None:
        """Continue the stopped ranks (or ``ranks``): their cell goes on."""
        chosen = sorted(self.stopped() if ranks is None else ranks)
        if chosen:
            self.cast(chosen, "continue")

    def quit(self, ranks: Iterable[int] | None = None) -> None:
        """Quit pdb on the stopped ranks (or ``ranks``): their cell ends there (BdbQuit)."""
        chosen = sorted(self.stopped() if ranks is None else ranks)
        if chosen:
            self.cast(chosen, "quit")

    def _stopped_text(self, stopped: dict[int, Any]) -> str:
        return (f"stopped: {label(sorted(stopped))}" if stopped
                else "no rank is stopped (breakpoint() in a %%mesh cell stops one)")


def where_text(at: dict[str, Any]) -> str:
    """Where a rank stopped, as stacks say it: "Cell In[5], line 3"."""
    return f"{at['file']}, line {at['line']}"

