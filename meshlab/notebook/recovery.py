"""Whether the process group is usable after a cell, and making it so before the next:
ranks still stuck in a collective, a group a backend error broke, a destroyed default group,
groups made by some ranks only. Mixed into Cluster (the recovery model in
docs/guides/faults-and-recovery.md)."""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from meshlab.notebook import on_ranks
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import CellResult, group
from meshlab.notebook.ranks import format_ranks, label, ranks_are
from meshlab.rank.cell_exec import STOP_SIGNAL

if TYPE_CHECKING:
    from meshlab.notebook.cell import CellRun
    from meshlab.notebook.profiles import Profile

# cells that make process groups; with destroy_process_group, those after which meshlab
# checks every rank's groups (one round trip, only after such a cell)
GROUP_CREATION = re.compile(r"\b(new_group|new_subgroups\w*|split_group|init_device_mesh|"
                            r"DeviceMesh|init_process_group)\b")
GROUP_CALLS = re.compile(GROUP_CREATION.pattern + r"|\bdestroy_process_group\b")
CONSTRUCTOR_FRAMES = ("_new_process_group_helper", "ProcessGroupGloo(", "ProcessGroupNCCL(",
                      "init_process_group")
SLACK = 30.0  # seconds past the process-group timeout before a stuck collective is given up


@dataclass(slots=True)
class Stuck:
    """A rank an earlier cell left running, as that cell found it."""

    since: float  # time.monotonic() when found: its collective raises by since + pg_timeout
    place: str = ""  # its innermost frame then: "`time.sleep(.1)` (Cell In[5], line 3)"
    deaf: bool = False  # it ignored meshlab's stop signal too: only a restart frees it


class GroupRecovery:
    """The group checks and re-forming around each cell."""

    _client: Any
    _engines: list[int]
    _busy: dict[int, str]
    _dead: dict[int, str]
    _members: list[int] | None
    _generation: int
    _needs_regroup: bool
    _diverged: str | None
    _wedged: bool
    _stuck: dict[int, Stuck]  # ranks in _busy, as their cell found them
    _recovered: list[str]
    profile: Profile
    regroup: Callable[..., None]
    _wait_for: Callable[[list[str], float], bool]

    def _after_cell(self, cell: CellRun, result: CellResult, code: str) -> None:
        """What a finished cell leaves the group in, noted on ``result``: ranks still stuck,
        a failed or destroyed group (re-formed before the next cell), dead ranks."""
        self._busy.update(cell.stuck)
        found = time.monotonic()
        self._stuck.update({r: Stuck(found, cell.places.get(r, ""), r in cell.deaf)
                            for r in cell.stuck})
        self._needs_regroup |= bool(cell.group_failed or cell.left_collective or self._busy)
        result.notes += self._recovered
        self._recovered = []
        deaf = sorted(cell.deaf & set(cell.stuck))
        waiting = [r for r in self._busy if r not in deaf]
        constructing = [r for r in cell.stuck if any(
            f in (result.outputs[r].stack or "") for f in CONSTRUCTOR_FRAMES)]
        if deaf:
            self._wedged = True  # the next cell fails at once instead of waiting for them
            them = "it" if len(deaf) == 1 else "them"
            result.notes.append(
                f"{ranks_are(deaf)} still running this cell: it caught meshlab's CellStopped "
                f"({STOP_SIGNAL.name}) as well as KeyboardInterrupt (a bare `except:` or "
                f"`except BaseException:`), so only `%mesh restart` frees {them}; until then "
                "the next cell fails at once.")
        if constructing:
            self._wedged = True  # the next cell fails at once instead of waiting for them
            result.notes.append(
                f"{ranks_are(constructing)} stuck creating a process group (usually because "
                "the ranks did not all create the same groups before): that wait has no "
                "timeout, so only `%mesh restart` frees them.")
        elif waiting:
            then = "" if deaf else (  # with a deaf rank, only a restart helps
                f" The next cell waits for {'it' if len(waiting) == 1 else 'them'} (within its "
                "own --timeout), then re-forms the process group; `%mesh restart` replaces "
                "the engines now.")
            result.notes.append(
                f"{ranks_are(waiting)} stuck in native code (usually a collective), "
                f"deaf to interrupts until the process-group timeout "
                f"({self.profile.pg_timeout:g} s) makes it raise.{then}")
        if self._dead:
            result.notes.append(
                "the process group cannot survive a dead rank: `%mesh restart` starts fresh "
                "engines and replays this session's successful %%mesh cells (or `%mesh restart "
                "--from-checkpoint DIR` from a saved checkpoint).")
        elif cell.group_failed and not self._busy:
            result.notes.append(
                f"the process group failed on {label(sorted(cell.group_failed))[1:-1]} in this "
                "cell: meshlab re-forms it before the next cell (and rebuilds the mesh).")
        elif cell.left_collective and not self._busy:
            result.notes.append(
                f"meshlab stopped {label(sorted(cell.left_collective))[1:-1]} inside a "
                "collective that returned only as the cell ended (at the process-group "
                "timeout, most likely): it re-forms the process group before the next cell (and "
                "rebuilds the mesh).")
        elif not self._busy and GROUP_CALLS.search(code):
            result.notes += self._check_groups()

    def _check_groups(self) -> list[str]:
        """After a cell that made or destroyed process groups (one round trip): re-form a
        destroyed default group now; note groups some ranks made and others did not (the
        next group creation would deadlock) so that it is preceded by a regroup."""
        live = [r for r in range(len(self._engines)) if r not in self._dead]
        view = self._client.direct_view([self._engines[r] for r in live])
        states = dict(zip(live, view.apply_async(on_ranks.group_state).get(timeout=60),
                          strict=True))
        members = self._members if self._members is not None else list(range(len(self._engines)))
        gone = [r for r in members if r in states and not states[r][0]]
        if gone:
            self.regroup(self._members)
            return [f"the default process group was destroyed on {label(gone)[1:-1]} "
                    f"(dist.destroy_process_group()): meshlab re-formed it."]
        counts = {r: states[r][1] for r in members if r in states}
        if len(set(counts.values())) > 1:
            by_count = " · ".join(f"{label(rs)} {n}" for rs, n in group(
                {r: str(n) for r, n in counts.items()}))
            self._diverged = f"the ranks made different numbers of process groups ({by_count})"
            return [f"{self._diverged}: dist.new_group must be called by every rank, members "
                    "or not, or the next group creation deadlocks. meshlab re-forms the process "
                    "group (dropping these groups) before the next `%mesh init` or cell that "
                    "makes a group."]
        return []

    def _recover(self, creates_groups: bool = False, timeout: float | None = None) -> float:
        """Before a cell: wait for ranks a previous cell left stuck (within ``timeout``, the
        next cell's own, when it has one), then re-form the group if it failed (or, before a
        group is made, if the ranks made different groups). Returns the seconds it took."""
        start, waited = time.monotonic(), ""
        if not self._busy:
            self._stuck.clear()
        if self._busy:
            pending = list(self._busy.values())
            ranks = f"rank{'s' if len(self._busy) > 1 else ''} {format_ranks(self._busy)}"
            stuck = {r: self._stuck.setdefault(r, Stuck(start)) for r in self._busy}
            # a stuck collective raises by the process-group timeout after meshlab found it
            due = max(s.since for s in stuck.values()) + self.profile.pg_timeout - start
            left = max(0.0, due + SLACK)
            # ranks that already outlived that, or ignore every signal, get a last look only
            limit = 1.0 if self._wedged else left if timeout is None else min(timeout, left)
            logging.getLogger("meshlab").warning(
                "waiting up to %g s for %s to finish the earlier cell", limit, ranks)
            try:
                done = self._wait_for(pending, limit)
            except KeyboardInterrupt:
                raise ClusterError(f"{ranks_are(self._busy)} still stuck from an earlier cell "
                                   "(the wait for them was interrupted): `%mesh restart` "
                                   "replaces the engines") from None
            if not done:  # cut short by this cell's limit, or past the process-group one
                raise self._still_stuck(stuck, timeout if limit < left else None,
                                        due - (time.monotonic() - start))
            self._busy.clear()
            self._stuck.clear()
            self._wedged = False
            if time.monotonic() - start >= 1:  # part of this cell's time limit went to it
                waited = (f", after {time.monotonic() - start:.1f} s waiting for {ranks} to "
                          "finish the earlier cell")
        if self._diverged and creates_groups:
            self._needs_regroup = True
            self._recovered.append(f"{self._diverged}: meshlab re-formed the process group "
                                   "first, so that the new group does not deadlock.")
        if self._needs_regroup:
            self.regroup(self._members)
            if not self._recovered:
                self._recovered.append(f"the process group was re-formed after the failure "
                                       f"(generation {self._generation}){waited}.")
            logging.getLogger("meshlab").warning("%s", self._recovered[-1])
        return time.monotonic() - start

    def _still_stuck(self, stuck: dict[int, Stuck], timeout: float | None, due: float
                     ) -> ClusterError:
        """Why the next cell cannot run yet, and the ways on. ``timeout``: the cell's own
        limit, where that ended the wait; ``due``: seconds until the process-group timeout
        should end a stuck collective."""
        deaf = [r for r, s in stuck.items() if s.deaf]
        if deaf:
            others = [r for r in stuck if r not in deaf]
            also = f"; {ranks_are(others)} also still stuck{_where(stuck, others)}" \
                if others else ""
            stack = _where(stuck, deaf, ": its stack is in ")
            return ClusterError(
                f"{ranks_are(deaf)} still running an earlier cell that ignored Ctrl-C and "
                f"meshlab's stop signal ({STOP_SIGNAL.name}){stack}{also}; only `%mesh "
                f"restart` frees {'it' if len(stuck) == 1 else 'them'}")
        where = _where(stuck, list(stuck))
        if self._wedged or timeout is None:
            self._wedged = True
            return ClusterError(
                f"{ranks_are(stuck)} still stuck from an earlier cell{where}, past the "
                "process-group timeout (a wait in native code that does not time out): "
                "`%mesh restart` replaces the engines")
        return ClusterError(
            f"{ranks_are(stuck)} still stuck in native code (usually a collective) from an "
            f"earlier cell{where}, and this cell's {timeout:g} s time limit ran out waiting for "
            f"{'it' if len(stuck) == 1 else 'them'}. The process-group timeout "
            f"({self.profile.pg_timeout:g} s) should end that wait in about "
            f"{max(1, math.ceil(due))} s: run the cell with a `--timeout` longer than that to "
            "wait for it, or `%mesh restart` to replace the engines now")


def _where(stuck: dict[int, Stuck], ranks: list[int], lead: str = ", at ") -> str:
    """Where ``ranks`` were found: ", at `time.sleep(.1)` (Cell In[5], line 3)", by rank
    where they differ; "" where not known."""
    places = {r: stuck[r].place for r in ranks if stuck[r].place}
    if not places:
        return ""
    if len(set(places.values())) == 1:
        return lead + next(iter(places.values()))
    return lead + " · ".join(f"{label(rs)[1:-1]} at {place}" for rs, place in group(places))
