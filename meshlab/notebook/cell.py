"""One %%mesh cell in flight: stream its output, stop it at a deadline or on Ctrl-C, and say
what became of every rank.

Notebook side. It reads ipyparallel's AsyncResult and per-message metadata it is handed and
changes no cluster state: the cluster reads ``stuck`` and ``dist_failed`` afterwards.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from meshlab.notebook.on_ranks import CELL_REPORT
from meshlab.notebook.output import CellResult, RankError, RankOutput

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster

GRACE = 2.0  # seconds an interrupted rank gets to leave Python code before we call it stuck
POLL = 0.05  # seconds between looks at streamed output, dead ranks and the deadline
_CELLS = itertools.count(1)  # names each cell's folder of cut output


class CellRun:
    """Waits for one cell on some ranks and turns what they sent into a CellResult."""

    def __init__(self, cluster: Cluster, ar: Any, ranks: list[int], timeout: float | None,
                 on_output: Callable[[CellResult], None] | None = None) -> None:
        self.cluster, self.ar, self.on_output = cluster, ar, on_output
        self.result = CellResult(ranks, {r: RankOutput(r) for r in ranks}, timeout=timeout)
        self.metadata: dict[int, dict[str, Any]] = dict(zip(ranks, ar.metadata, strict=True))
        self.msg_ids: dict[int, str] = dict(zip(ranks, ar.msg_ids, strict=True))
        self.deadline = time.monotonic() + timeout if timeout else None
        self.stuck: dict[int, str] = {}  # rank -> msg id of the cell it is still running
        self.dist_failed = False  # a rank raised from torch.distributed: re-form the group
        self.max_lines = getattr(cluster, "max_output_lines", 5000)
        self.max_bytes = getattr(cluster, "max_output_bytes", 2**20)
        self.number = next(_CELLS)
        self._seen: dict[tuple[int, str], int] = {}  # characters of ipyparallel's text read
        self._lines: dict[tuple[int, str], int] = {}  # lines kept
        self._files: dict[tuple[int, str], IO[str]] = {}  # the whole output, once cut

    def wait(self) -> CellResult:
        """Block until every rank is done, dead, timed out or interrupted."""
        try:
            while not self.ar.ready():
                self.ar.wait(POLL)
                self._stream()
                if self._notice_deaths():
                    # Peers of a dead rank would wait for it in their next collective.
                    self._stop("interrupted")
                    break
                if self.deadline and time.monotonic() > self.deadline:
                    self._stop("timeout")
                    break
            if self.ar.ready():
                self.ar.wait_for_output(5)  # stdout and results travel apart from the reply
        except KeyboardInterrupt:
            self._stop("interrupted")
        self._stream()
        self._let_go()
        self._errors_from_replies()
        self._classify()
        return self.result

    def values(self) -> tuple[dict[int, Any], dict[int, str]]:
        """``({rank: value of the last expression}, {rank: why it could not be sent})``, as
        each rank sent them with its end-of-cell report (a cell run with keep_values)."""
        values, unsent = {}, {}
        for r, md in self.metadata.items():
            said = md["data"].get(CELL_REPORT, {})
            if "unsent" in said:
                unsent[r] = said["unsent"]
            elif "value" in said:
                try:
                    values[r] = pickle.loads(said["value"])
                except Exception as e:  # it arrived but cannot be unpickled here
                    unsent[r] = f"{type(e).__name__}: {e}"
        return values, unsent

    def _let_go(self) -> None:
        """Close the full-output files; drop ipyparallel's copy of finished ranks' output
        (it keeps all of it, for ever): the cell's memory stays within its cap."""
        for file in self._files.values():
            file.close()
        for r, md in self.metadata.items():
            if md["status"] and r not in self.stuck:
                md["stdout"] = md["stderr"] = ""

    def _errors_from_replies(self) -> None:
        """A UsageError (``%nosuchmagic`` on the ranks) fails the cell without an error
        message on iopub: take the exception from the execute reply instead."""
        for md, child in zip(self.metadata.values(), self.ar._children, strict=True):
            if md["status"] == "error" and md["error"] is None and child.done():
                reply = child.exception() or child.result()  # the reply's RemoteError
                if isinstance(reply, BaseException) and hasattr(reply, "ename"):
                    md["error"] = reply

    def _done(self, r: int) -> bool:
        return bool(self.metadata[r]["status"])

    def _stream(self) -> None:
        """Take what each rank printed since the last look; hand on_output the result."""
        changed = False
        for r, md in self.metadata.items():
            for name in ("stdout", "stderr"):
                text, seen = md[name] or "", self._seen.get((r, name), 0)
                if len(text) < seen:  # a carriage return rewrote it: start over
                    self._reset(r, name)
                    seen = 0
                if len(text) > seen:
                    self._keep(r, name, text[seen:])
                    self._seen[r, name], changed = len(text), True
        if changed and self.on_output:
            self.on_output(self.result)

    def _reset(self, r: int, name: str) -> None:
        out = self.result.outputs[r]
        setattr(out, name, "")
        out.dropped.pop(name, None)
        self._lines[r, name] = 0
        if (r, name) in self._files:
            self._files.pop((r, name)).close()

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
        file = self._files.get((r, name))
        if file is None:
            folder = Path(self.cluster.output_dir or tempfile.gettempdir()) / (
                f"meshlab-{os.getpid()}") / f"cell-{self.number}"
            folder.mkdir(parents=True, exist_ok=True)
            self.result.full_output = str(folder)
            file = self._files[r, name] = open(folder / f"rank{r}.{name}", "w")  # noqa: SIM115
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
            self.ar.wait(GRACE)
        stuck = [r for r in running if not self._done(r)]
        if why == "interrupted" and stuck:
            stacks = self.cluster.stacks(stuck)
        for r in running:
            if self.metadata[r]["status"] != "ok":  # not finished within the grace period
                self.result.outputs[r].status = why
                self.result.outputs[r].stack = stacks.get(r)
        if stacks:  # a hang: what each rank last asked of the process group, finished or not
            self.result.collectives = self.cluster.collectives(self.result.ranks)

    def _classify(self) -> None:
        for r, md in self.metadata.items():
            out, err = self.result.outputs[r], md["error"]
            if out.status in ("timeout", "interrupted", "died"):
                if not md["status"] and out.status != "died":  # a dead rank waits for nothing
                    self.stuck[r] = self.msg_ids[r]
            elif md["status"] == "ok":
                out.status = "ok"
                out.result = (md["execute_result"] or {}).get("data", {}).get("text/plain")
                out.optimizer_steps = md["data"].get(CELL_REPORT, {}).get("optimizer_steps")
            elif err is not None and err.ename == "EngineError":  # the hub saw the engine go
                out.status = "died"
                out.error = RankError("RankDied", self.cluster.dead().get(r, "died"))
            elif err is not None:
                out.status = "error"
                out.error = RankError(err.ename, err.evalue, _traceback_chunks(err))
                self.dist_failed |= out.error.from_backend()  # any class gloo/NCCL raise


def _traceback_chunks(err: Any) -> list[str]:
    """An engine's traceback as IPython's list of chunks (it arrives as one string)."""
    tb = getattr(err, "traceback", "") or ""
    return tb.split("\n\n") if isinstance(tb, str) else list(tb)
