"""One %%mesh cell in flight: stream its output, stop it at a deadline or on Ctrl-C, and say
what became of every rank.

Notebook side. It reads what the ranks send over the cell channel and changes no cluster
state: the cluster reads ``stuck`` and ``dist_failed`` afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

from meshlab.notebook.cell_channel import SentCell
from meshlab.notebook.output import CellResult, RankError, RankOutput
from meshlab.notebook.private_files import open_private, subfolder

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster

GRACE = 2.0  # seconds an interrupted rank gets to leave Python code before we call it stuck
POLL = 0.05  # the longest between looks at dead ranks and the deadline
_CELLS = itertools.count(1)  # names each cell's folder of cut output


class CellRun:
    """Waits for one cell on some ranks and turns what they sent into a CellResult."""

    def __init__(self, cluster: Cluster, sent: SentCell, timeout: float | None,
                 on_output: Callable[[CellResult], None] | None = None) -> None:
        self.cluster, self.sent, self.on_output = cluster, sent, on_output
        ranks = sent.ranks
        self.result = CellResult(ranks, {r: RankOutput(r) for r in ranks}, timeout=timeout)
        self.deadline = time.monotonic() + timeout if timeout else None
        self.stuck: dict[int, str] = {}  # rank -> id of the cell it is still running
        self.dist_failed = False  # a rank raised from torch.distributed: re-form the group
        self.max_lines = getattr(cluster, "max_output_lines", 5000)
        self.max_bytes = getattr(cluster, "max_output_bytes", 2**20)
        self.number = next(_CELLS)
        self._lines: dict[tuple[int, str], int] = {}  # lines kept
        self._files: dict[tuple[int, str], IO[str]] = {}  # the whole output, once cut

    def wait(self) -> CellResult:
        """Block until every rank is done, dead, timed out or interrupted."""
        channel, looked = self.cluster.cell_channel, time.monotonic()
        try:
            while not self.sent.ready():
                channel.poll(POLL)
                self._stream()
                if self.sent.ready() or time.monotonic() - looked < POLL:
                    continue  # a look at the processes costs more than a no-op cell
                looked = time.monotonic()
                if self._notice_deaths():
                    # Peers of a dead rank would wait for it in their next collective.
                    self._stop("interrupted")
                    break
                if self.deadline and time.monotonic() > self.deadline:
                    self._stop("timeout")
                    break
        except KeyboardInterrupt:
            self._stop("interrupted")
        self._stream()
        self._classify()
        self._let_go()
        return self.result

    def values(self) -> tuple[dict[int, Any], dict[int, str]]:
        """``({rank: value of the last expression}, {rank: why it could not be sent})``, as
        each rank sent them with its reply (a cell run with keep_values)."""
        values, unsent = {}, {}
        for r, got in self.sent.replies.items():
            if got.reply and "unsent" in got.reply:
                unsent[r] = got.reply["unsent"]
            elif got.value is not None:
                try:
                    values[r] = pickle.loads(got.value)  # signed by a rank of this cluster
                except Exception as e:  # it arrived but cannot be unpickled here
                    unsent[r] = f"{type(e).__name__}: {e}"
        return values, unsent

    def _let_go(self) -> None:
        """Close the full-output files; the channel forgets a cell no rank still runs."""
        for file in self._files.values():
            file.close()
        if not self.stuck:
            self.cluster.cell_channel.forget(self.sent)

    def _done(self, r: int) -> bool:
        return self.sent.done(r)

    def _stream(self) -> None:
        """Take what each rank printed since the last look; hand on_output the result."""
        changed = False
        for r, got in self.sent.replies.items():
            for name in ("stdout", "stderr"):
                text = getattr(got, name)
                if text:  # taken, not copied: the cell holds only what its caps keep
                    setattr(got, name, "")
                    self._keep(r, name, text)
                    changed = True
        if changed and self.on_output:
            self.on_output(self.result)

    def _keep(self, r: int, name: str, new: str) -> None:
        """Keep ``new`` up to the cell's cap of lines and bytes; past it, count the lines
        and write them (with everything before) to the rank's file."""
        out = self.result.outputs[r]
        kept, lines = getattr(out, name), self._lines.get((r, name), 0)
        cut = 0 if name in out.dropped else len(new)
        if cut:
            cut = 0
            while lines < self.max_lines:
                nl = new.find("\n", cut)
                end = len(new) if nl < 0 else nl + 1
                if len(kept) + end > self.max_bytes:
                    # a line past the byte cap: its start is shown, the rest announced
                    cut = max(cut, self.max_bytes - len(kept))
                    break
                cut = end
                if nl < 0:
                    break
                lines += 1
            setattr(out, name, kept + new[:cut])
            self._lines[r, name] = lines
        rest = new[cut:]
        if not rest:
            return
        out.dropped[name] = out.dropped.get(name, 0) + rest.count("\n")  # whole lines
        out.dropped_bytes[name] = out.dropped_bytes.get(name, 0) + len(rest)
        file = self._files.get((r, name))
        if file is None:  # in the cluster's private folder: no other user reads or redirects it
            folder = subfolder(self.cluster.cut_output_folder(), f"cell-{self.number}")
            self.result.full_output = str(folder)
            file = self._files[r, name] = open_private(folder / f"rank{r}.{name}")
            file.write(kept + new[:cut])
        file.write(rest)

    def _notice_deaths(self) -> bool:
        dead = self.cluster.dead()
        died = False
        for r, out in self.result.outputs.items():
            if r in dead and out.status == "running":
                out.status, out.error, died = "died", RankError("RankDied", dead[r]), True
        return died

    def _stop(self, why: str) -> None:
        """Timeout or Ctrl-C: note stacks, SIGINT the ranks still running, give them a moment."""
        running = [r for r in self.result.ranks
                   if not self._done(r) and self.result.outputs[r].status != "died"]
        if not running:  # the only rank still running just died
            return
        stacks = self.cluster.stacks(running) if why == "timeout" else {}
        self.cluster.interrupt(running)
        with contextlib.suppress(KeyboardInterrupt):
            self.cluster.cell_channel.wait(self.sent, GRACE)
            # A rank still busy with something else (a probe, a push) when the SIGINT came
            # starts the cell after it, uninterrupted: once more. A rank stuck in native
            # code still holds the first, and the two count as one.
            late = [r for r in running if not self._done(r)]
            if late:
                self.cluster.interrupt(late)
                self.cluster.cell_channel.wait(self.sent, GRACE)
        stuck = [r for r in running if not self._done(r)]
        if why == "interrupted" and stuck:
            stacks = self.cluster.stacks(stuck)
        for r in running:
            if not self._ok(r):  # not finished within the grace period
                self.result.outputs[r].status = why
                self.result.outputs[r].stack = stacks.get(r)
        if stacks:  # a hang: what each rank last asked of the process group, finished or not
            self.result.collectives = self.cluster.collectives(self.result.ranks)

    def _ok(self, r: int) -> bool:
        reply = self.sent.replies[r].reply
        return reply is not None and reply["status"] == "ok"

    def _classify(self) -> None:
        for r, got in self.sent.replies.items():
            out, reply = self.result.outputs[r], got.reply
            if out.status in ("timeout", "interrupted", "died"):
                if reply is None and out.status != "died":  # a dead rank waits for nothing
                    self.stuck[r] = self.sent.id
            elif reply is None or reply.get("ename") == "RankDied":  # its engine went away
                out.status = "died"
                out.error = RankError("RankDied", self.cluster.dead().get(r, "died"))
            elif reply["status"] == "ok":
                out.status = "ok"
                out.result = reply.get("result")
                out.optimizer_steps = reply.get("optimizer_steps")
            else:
                out.status = "error"
                out.error = RankError(reply.get("ename", "Error"), reply.get("evalue", ""),
                                      list(reply.get("traceback") or []))
                self.dist_failed |= out.error.from_backend()  # any class gloo/NCCL raise
