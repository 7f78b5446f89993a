"""A long cell's progress: how long it has run and how far each rank is, asked while it runs.

Each rank counts its optimizer.step() calls (meshlab.runtime), so a training loop reports
its steps with no code of its own; a rank answers the ``progress`` probe from its side
thread (meshlab.rank.probe_server.cell_progress) with the calls the running cell made.
Nothing is asked in a cell's first seconds: a short cell costs nothing and shows nothing.
Then each rank is asked at most once a second, never twice at once, and never waited for:
one whose answer is late is shown as not answering. Plain data and its text here;
meshlab.notebook.progress_line shows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from meshlab.notebook.ranks import label

if TYPE_CHECKING:
    from meshlab.notebook.cell_channel import SentCell
    from meshlab.notebook.output import CellResult

SHOW_AFTER = 3.0  # seconds a cell runs before its progress shows: a shorter one shows none
EVERY = 1.0  # seconds between two rounds of questions to the ranks (and of redraws)
WAIT = 0.25  # seconds a round's answers are waited for before they are shown, late or not
LATE = 3.0  # seconds an unanswered question takes to show the rank as not answering
ENDED = {"ok": "", "error": "failed", "timeout": "stopped at the time limit",
         "interrupted": "interrupted", "died": "died"}  # RankOutput.status -> what is said


@dataclass(slots=True)
class RankProgress:
    """How far one rank is in the cell."""

    steps: int | None = None  # optimizer.step() calls in this cell so far; None: not known
    seen: float | None = None  # seconds into the cell when it last answered (or replied)
    status: str = "running"  # running, then as RankOutput.status once it replied or died
    seconds: float | None = None  # how long it ran the cell, by its own clock, once replied
    waiting: float = 0.0  # seconds its last question has gone unanswered
    replied: bool = False  # its reply is in: steps and seconds are exact

    def said(self, counted: bool, ended: bool) -> str:
        """What the line says of this rank (``counted``: some rank has optimizer steps)."""
        step = f"step {self.steps}" if counted and self.steps is not None else ""
        if not ended and self.status == "running":
            if self.waiting >= LATE:
                return (f"not answering for {self.waiting:.0f} s"
                        + (f", last at {step} ({self.seen:.0f} s in)" if step else ""))
            return step or "running"
        word = ENDED.get(self.status, self.status)
        if self.replied:
            took = f" after {self.seconds:.1f} s" if not ended and self.seconds else ""
            done = "done" if not ended and not word else word
            return " ".join(filter(None, [done + took, f"at {step}" if step and done else step]))
        if step:  # what its last answer said: it never replied
            return f"{word}, last seen at {step} ({self.seen:.0f} s in)"
        return word or "running"


@dataclass(slots=True)
class CellProgress:
    """Every rank's progress through one cell, and the cell's time so far (or in all)."""

    ranks: dict[int, RankProgress]
    elapsed: float = 0.0
    ended: bool = False  # the cell is over: what it says is final
    shown: bool = False  # it ran long enough for its progress to be shown while it ran

    def text(self) -> str:
        """``running 12.0 s on 4 ranks: [ranks 0-1,3] step 12; [rank 2] step 11``, or once
        ended ``ran 53.1 s on 4 ranks: [ranks 0-3] step 40``."""
        n = len(self.ranks)
        head = (f"{'ran' if self.ended else 'running'} {self.elapsed:.1f} s on {n} "
                f"rank{'s' * (n != 1)}")
        counted = any(p.steps for p in self.ranks.values())
        said: dict[str, list[int]] = {}  # ranks that say the same, by their lowest rank
        for r in sorted(self.ranks):
            said.setdefault(self.ranks[r].said(counted, self.ended), []).append(r)
        said.pop("", None)
        if list(said) == ["running"]:
            said = {}  # every rank running and none counts steps: the head says it all
        return head + "".join(f"{': ' if i == 0 else '; '}{label(ranks)} {text}"
                              for i, (text, ranks) in enumerate(said.items()))

    def __repr__(self) -> str:
        return self.text()


@dataclass
class ProgressPoll:
    """Asks the ranks of one cell in flight how far they are, from its wait loop."""

    cluster: Any  # a Cluster: its ask() and answer() (meshlab.notebook.probes)
    sent: SentCell
    on_progress: Callable[[CellProgress], None] | None
    started: float = field(default_factory=time.monotonic)
    progress: CellProgress = field(init=False)
    _asked: dict[int, tuple[float, Any]] = field(default_factory=dict)  # rank -> (when, future)
    _ask_at: float = field(init=False)  # when the next round of questions goes out
    _draw_at: float | None = None  # when this round's answers are shown, all in or not
    _round: set[int] = field(default_factory=set)  # the ranks this round asked

    def __post_init__(self) -> None:
        self.progress = CellProgress({r: RankProgress() for r in self.sent.ranks})
        self._ask_at = self.started + SHOW_AFTER

    def look(self, result: CellResult) -> None:
        """Called as often as the wait loop turns. Once SHOW_AFTER has passed, a round of
        questions every EVERY seconds (none to a rank whose last is unanswered), its answers
        handed to ``on_progress`` once all are in or WAIT has passed; nothing in between."""
        now = time.monotonic()
        if self.on_progress is None or (now < self._ask_at and self._draw_at is None):
            return
        self._update(result, now)
        if now >= self._ask_at:
            ask = [r for r, p in self.progress.ranks.items()
                   if p.status == "running" and r not in self._asked]
            self._asked.update({r: (now, future) for r, future in self.cluster.ask(
                ask, "progress").items()})
            self._round = set(ask)
            self._ask_at, self._draw_at = now + EVERY, now + WAIT
        if self._draw_at is not None and (now >= self._draw_at
                                          or self._round.isdisjoint(self._asked)):
            self._draw_at = None
            self.progress.elapsed, self.progress.shown = now - self.started, True
            self.on_progress(self.progress)

    def finish(self, result: CellResult) -> CellProgress:
        """The cell is over: each rank's count from its reply (exact) or, where none came,
        its last answer, and the cell's whole time."""
        now = time.monotonic()
        self._update(result, now)
        for r, p in self.progress.ranks.items():
            p.status, p.waiting = result.outputs[r].status, 0.0
        self.progress.elapsed, self.progress.ended = now - self.started, True
        return self.progress

    def _update(self, result: CellResult, now: float) -> None:
        for r, p in self.progress.ranks.items():
            reply = self.sent.replies[r].reply
            if reply is not None and "cell_steps" in reply and not p.replied:
                p.steps, p.seconds, p.replied = reply["cell_steps"], reply["seconds"], True
                p.status, p.seen = reply["status"], now - self.started
            elif result.outputs[r].status == "died":
                p.status = "died"
            asked = self._asked.get(r)
            if asked is None:
                continue
            when, future = asked
            if not future.done():
                p.waiting = now - when
                continue
            del self._asked[r]
            p.waiting = 0.0
            ok, answer = self.cluster.answer(future)
            # an answer about no cell, or another, came after this one ended: its reply says
            if ok and answer["cell"] == self.sent.id and not p.replied:
                p.steps, p.seen = answer["steps"], when - self.started
