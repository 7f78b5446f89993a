"""One %%mesh cell in flight: stream its output, stop it at a deadline or on Ctrl-C, and say
what became of every rank.

Notebook side. It reads what the ranks send over the cell channel and changes no cluster
state: the cluster reads ``stuck``, ``group_failed`` and ``left_collective`` afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import pickle
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from meshlab.notebook.cell_channel import SentCell
from meshlab.notebook.cell_progress import CellProgress, ProgressPoll
from meshlab.notebook.debugger import Debugger, DebuggerTimeout, where_text
from meshlab.notebook.output import CellResult, RankError, RankOutput
from meshlab.rank import value_wire
from meshlab.rank.cell_exec import STOP_SIGNAL
from meshlab.rank.private_files import open_private, subfolder

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster

GRACE = 2.0  # seconds an interrupted rank gets to leave Python code before we call it stuck
POLL = 0.05  # the longest between looks at dead ranks and the deadline
_CELLS = itertools.count(1)  # names each cell's folder of cut output


class CellRun:
    """Waits for one cell on some ranks and turns what they sent into a CellResult."""

    def __init__(self, cluster: Cluster, sent: SentCell, timeout: float | None,
                 on_output: Callable[[CellResult], None] | None = None,
                 spent: float = 0.0,
                 on_breakpoint: Callable[[Debugger], None] | None = None,
                 on_progress: Callable[[CellProgress], None] | None = None) -> None:
        """``spent``: seconds of ``timeout`` used before the cell was sent (waiting for ranks
        an earlier cell left stuck). ``on_breakpoint`` is handed the Debugger when a rank
        stops at ``breakpoint()``; the ranks still stopped when it returns go on. Without
        it they go on at once, and the result says so. ``on_progress`` sees how far each
        rank is, every second once the cell has run a few (meshlab.notebook.cell_progress);
        without it the ranks are not asked."""
        self.cluster, self.sent, self.on_output = cluster, sent, on_output
        self.on_breakpoint = on_breakpoint
        self.debugger: Debugger | None = None  # once a rank stopped at a breakpoint
        self._stops = 0  # stop notices handed on
        ranks = sent.ranks
        self.result = CellResult(ranks, {r: RankOutput(r) for r in ranks}, timeout=timeout)
        # what is left of the limit once stuck ranks were waited for, but at least a grace
        left = max(timeout - spent, GRACE) if timeout and spent else timeout
        self.deadline = time.monotonic() + left if left else None
        self.stuck: dict[int, str] = {}  # rank -> id of the cell it is still running
        self.places: dict[int, str] = {}  # rank still running -> its innermost frame
        self.deaf: set[int] = set()  # still running after meshlab's stop signal too
        self._stopped: dict[int, str] = {}  # rank ended by the stop signal -> why, as shown
        self.group_failed: set[int] = set()  # raised from torch.distributed: re-form the group
        self.left_collective: set[int] = set()  # returned from one only as the cell was stopped
        self._in_collective: set[int] = set()  # found in torch.distributed while stopping
        self.max_lines = getattr(cluster, "max_output_lines", 5000)
        self.max_bytes = getattr(cluster, "max_output_bytes", 2**20)
        self.number = next(_CELLS)
        self._lines: dict[tuple[str, str], int] = {}  # (file stem, stream) -> lines kept
        self._files: dict[tuple[str, str], IO[str]] = {}  # the whole output, once cut
        self.progress = ProgressPoll(cluster, sent, on_progress)

    def wait(self) -> CellResult:
        """Block until every rank is done, dead, timed out or interrupted."""
        channel, looked = self.cluster.cell_channel, time.monotonic()
        try:
            while not self.sent.ready():
                channel.poll(POLL)
                self._stream()
                if sum(got.stops for got in self.sent.replies.values()) > self._stops:
                    self._debug()
                self.progress.look(self.result)
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
        except DebuggerTimeout:
            self._stop("timeout")
        self._stream()
        self._classify()
        self.result.progress = self.progress.finish(self.result)
        self._let_go()
        return self.result

    def _debug(self) -> None:
        """A rank stopped at a breakpoint: the handler drives the debugger, then the ranks
        still stopped go on. A stop noticed meanwhile brings the next call."""
        self._stops = sum(got.stops for got in self.sent.replies.values())
        if self.debugger is None:
            self.debugger = Debugger(self.cluster, self.sent, self.deadline, self._refresh)
        if not self.debugger.stopped():
            return  # the handler saw this one already
        if self.on_breakpoint is not None:
            self.on_breakpoint(self.debugger)
        else:
            note = ("breakpoint() reached and continued: this cell ran with no debugger "
                    "(a %%mesh cell or Session.run opens one)")
            if note not in self.result.notes:
                self.result.notes.append(note)
        self.debugger.cont()

    def _refresh(self) -> None:
        self.cluster.cell_channel.poll(0)
        self._stream()

    def values(self) -> tuple[dict[int, Any], dict[int, str]]:
        """``({rank: value of the last expression}, {rank: why it could not be sent})``, as
        each rank sent them with its reply (a cell run with keep_values)."""
        values, unsent = {}, {}
        for r, got in self.sent.replies.items():
            if got.reply and "unsent" in got.reply:
                unsent[r] = got.reply["unsent"]
            elif got.value is not None or got.pulled is not None:
                try:  # signed by a rank of this cluster
                    values[r] = (value_wire.loads(got.pulled) if got.pulled is not None
                                 else pickle.loads(got.value))  # type: ignore[arg-type]
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
        """Take what each rank printed since the last look, and what other threads printed
        (this cell's threads' is the cell's); hand on_output the result."""
        changed = False
        for r, got in self.sent.replies.items():
            for name in ("stdout", "stderr"):
                text = getattr(got, name)
                if text:  # taken, not copied: the cell holds only what its caps keep
                    setattr(got, name, "")
                    self._keep(self.result.outputs[r], f"rank{r}", name, text)
                    changed = True
        threads, dropped = self.cluster.cell_channel.take_threads()
        for r, thread, streams in threads:
            out = self.result.threads.setdefault(thread, {}).setdefault(r, RankOutput(r))
            for name, text in streams.items():
                self._keep(out, f"rank{r}.thread-{_file_safe(thread)}", name, text)
            changed = True
        for r, n in dropped.items():
            self.result.threads_dropped[r] = self.result.threads_dropped.get(r, 0) + n
        if changed and self.on_output:
            self.on_output(self.result)

    def _keep(self, out: RankOutput, stem: str, name: str, new: str) -> None:
        """Keep ``new`` up to the cell's cap of lines and bytes; past it, count the lines
        and write them (with everything before) to the file ``stem.name``."""
        kept, lines = getattr(out, name), self._lines.get((stem, name), 0)
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
            self._lines[stem, name] = lines
        rest = new[cut:]
        if not rest:
            return
        out.dropped[name] = out.dropped.get(name, 0) + rest.count("\n")  # whole lines
        out.dropped_bytes[name] = out.dropped_bytes.get(name, 0) + len(rest)
        file = self._files.get((stem, name))
        if file is None:  # in the cluster's private folder: no other user reads or redirects it
            folder = self._cut_folder()
            self.result.full_output = str(folder)
            file = self._files[stem, name] = open_private(folder / f"{stem}.{name}")
            file.write(kept + new[:cut])
        file.write(rest)

    def _cut_folder(self) -> Path:
        """This cell's folder of cut output, in the cluster's. A long session must not fill
        the disk: first the oldest cells' folders go while the rest hold more than the
        cluster's max_cut_output_bytes."""
        parent = self.cluster.cut_output_folder()
        budget = getattr(self.cluster, "max_cut_output_bytes", 2**30)
        older = sorted((p for p in parent.glob("cell-*") if p.name[5:].isdigit()),
                       key=lambda p: int(p.name[5:]))
        sizes = [sum(f.stat().st_size for f in p.iterdir()) for p in older]
        total = sum(sizes)
        for folder, size in zip(older, sizes, strict=True):
            if total <= budget:
                break
            shutil.rmtree(folder, ignore_errors=True)
            total -= size
        return subfolder(parent, f"cell-{self.number}")

    def _notice_deaths(self) -> bool:
        dead = self.cluster.dead()
        died = False
        for r, out in self.result.outputs.items():
            if r in dead and out.status == "running":
                out.status, out.error, died = "died", RankError("RankDied", dead[r]), True
        return died

    def _stop(self, why: str) -> None:
        """Timeout or Ctrl-C: note stacks, then the ladder (docs/guides/notebook-basics.md,
        "When a cell will not stop"): SIGINT; after GRACE, meshlab's stop signal to the ranks
        whose cell caught it and went on, SIGINT again to the rest; after GRACE, say what each
        rank still does."""
        running = [r for r in self.result.ranks
                   if not self._done(r) and self.result.outputs[r].status != "died"]
        if not running:  # the only rank still running just died
            return
        # ranks at a pdb prompt: Ctrl-C ends their debugger and cell like any other's
        debugging = self.debugger.stopped() if self.debugger is not None else {}
        stacks = self.cluster.stacks(running) if why == "timeout" else {}
        found: dict[int, dict[str, Any]] = {}  # rank -> meshlab.rank.probe_server.stop_ignored's
        self.cluster.interrupt(running)
        with contextlib.suppress(KeyboardInterrupt):
            self.cluster.cell_channel.wait(self.sent, GRACE)
            late = [r for r in running if not self._done(r)]
            for _ in range(2):
                if not late:
                    break
                found.update(self.cluster.stop_ignored(late))  # signals those that caught it
                # A rank still busy with something else (a probe, a push) when the SIGINT came
                # starts the cell after it, uninterrupted: once more. A rank stuck in native
                # code still holds the first, and the two count as one.
                again = [r for r in late if _state(found, r) != "ignored"]
                if again:
                    self.cluster.interrupt(again)
                self.cluster.cell_channel.wait(self.sent, GRACE)
                # one that was not in the cell yet may since have caught this SIGINT
                late = [r for r in again if not self._done(r) and _state(found, r) == "no cell"]
        self._in_collective = {r for r in running if _state(found, r) == "collective"}
        stuck = [r for r in running if not self._done(r)]
        if why == "interrupted" and stuck:
            stacks = self.cluster.stacks(stuck)
        limit = (f"still running after the {self.result.timeout:g} s time limit; "
                 if why == "timeout" else "")
        for r in running:
            if self._ok(r):
                continue
            out, place = self.result.outputs[r], found.get(r, {}).get("place", "")
            out.stack = stacks.get(r)
            ignored = _state(found, r) == "ignored"
            reply = self.sent.replies[r].reply
            if ignored and reply is not None and reply.get("ename") == "CellStopped":
                self._stopped[r] = (f"{limit}ignored Ctrl-C: its stack is in {place}; meshlab's "
                                    f"stop signal ({STOP_SIGNAL.name}) ended the cell")
                continue  # an error like any other: _classify takes it from the reply
            out.status = why
            if r in debugging:
                out.reason = (f"was stopped in the debugger at {where_text(debugging[r])} when "
                              + (f"the {self.result.timeout:g} s time limit passed"
                                 if why == "timeout" else "Ctrl-C came"))
            if not self._done(r):
                self.places[r] = place
                if ignored:
                    self.deaf.add(r)
                    out.reason = (f"{limit}ignored Ctrl-C and meshlab's stop signal "
                                  f"({STOP_SIGNAL.name}): its stack is in {place}; only "
                                  "`%mesh restart` frees it")
        if stacks and any(_state(found, r) != "ignored" for r in running if not self._ok(r)):
            # a hang: what each rank last asked of the process group, finished or not
            self.result.collectives = self.cluster.collectives(self.result.ranks)

    def _ok(self, r: int) -> bool:
        reply = self.sent.replies[r].reply
        return reply is not None and reply["status"] == "ok"

    def _classify(self) -> None:
        for r, got in self.sent.replies.items():
            out, reply = self.result.outputs[r], got.reply
            if reply is not None:
                out.drew = reply.get("drew")
            if out.status in ("timeout", "interrupted", "died"):
                if reply is None and out.status != "died":  # a dead rank waits for nothing
                    self.stuck[r] = self.sent.id
                elif reply is not None and (r in self._in_collective or (
                        reply["status"] == "error" and _error(reply).from_backend())):
                    # a collective that returned only as meshlab stopped the cell (at the
                    # process-group timeout, most likely): the ranks may no longer agree on
                    # the group's collectives, so it is re-formed all the same
                    self.left_collective.add(r)
            elif reply is None or reply.get("ename") == "RankDied":  # its engine went away
                out.status = "died"
                out.error = RankError("RankDied", self.cluster.dead().get(r, "died"))
            elif reply["status"] == "ok":
                out.status = "ok"
                out.result = reply.get("result")
                out.optimizer_steps = reply.get("optimizer_steps")
            else:
                out.status = "error"
                out.error = _error(reply, self._stopped.get(r))
                if out.error.from_backend():  # any class gloo/NCCL raise
                    self.group_failed.add(r)


def _error(reply: dict[str, Any], shown: str | None = None) -> RankError:
    """The error a rank's reply carries (``shown``: the text to show instead of its own)."""
    return RankError(reply.get("ename", "Error"), shown or reply.get("evalue", ""),
                     list(reply.get("traceback") or []))


def _state(found: dict[int, dict[str, Any]], r: int) -> str | None:
    """Where the rank's probe found its cell: collective, ignored, native, no cell."""
    return found.get(r, {}).get("state")


def _file_safe(thread: str) -> str:
    """A thread's name as part of a file name."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", thread)[:60] or "_"
