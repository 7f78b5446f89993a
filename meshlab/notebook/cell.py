"""One %%mesh cell in flight: stream its output, stop it at a deadline or on Ctrl-C, and say
what became of every rank.

Notebook side. It reads ipyparallel's AsyncResult and per-message metadata it is handed and
changes no cluster state: the cluster reads ``stuck`` and ``dist_failed`` afterwards.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshlab.notebook.output import CellResult, RankError, RankOutput

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster

GRACE = 2.0  # seconds an interrupted rank gets to leave Python code before we call it stuck
POLL = 0.05  # seconds between looks at streamed output, dead ranks and the deadline
DIST_ERRORS = ("DistBackendError", "DistError", "DistNetworkError", "DistStoreError")


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
        self._classify()
        return self.result

    def _done(self, r: int) -> bool:
        return bool(self.metadata[r]["status"])

    def _stream(self) -> None:
        changed = False
        for r, md in self.metadata.items():
            out = self.result.outputs[r]
            if (out.stdout, out.stderr) != (md["stdout"], md["stderr"]):
                out.stdout, out.stderr, changed = md["stdout"], md["stderr"], True
        if changed and self.on_output:
            self.on_output(self.result)

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
            elif err is not None and err.ename == "EngineError":  # the hub saw the engine go
                out.status = "died"
                out.error = RankError("RankDied", self.cluster.dead().get(r, "died"))
            elif err is not None:
                out.status = "error"
                out.error = RankError(err.ename, err.evalue, _traceback_chunks(err))
                self.dist_failed |= err.ename in DIST_ERRORS


def _traceback_chunks(err: Any) -> list[str]:
    """An engine's traceback as IPython's list of chunks (it arrives as one string)."""
    tb = getattr(err, "traceback", "") or ""
    return tb.split("\n\n") if isinstance(tb, str) else list(tb)
