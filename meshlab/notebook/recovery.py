"""Whether the process group is usable after a cell, and making it so before the next:
ranks still stuck in a collective, a group a backend error broke, a destroyed default group,
groups made by some ranks only. Mixed into Cluster (the recovery model in the README)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshlab.notebook import on_ranks
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import CellResult, group
from meshlab.notebook.ranks import format_ranks, label, ranks_are

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
    _recovered: list[str]
    profile: Profile
    regroup: Callable[..., None]
    _wait_for: Callable[[list[str], float], bool]

    def _after_cell(self, cell: CellRun, result: CellResult, code: str) -> None:
        """What a finished cell leaves the group in, noted on ``result``: ranks still stuck,
        a failed or destroyed group (re-formed before the next cell), dead ranks."""
        self._busy.update(cell.stuck)
        self._needs_regroup |= cell.dist_failed or bool(self._busy)
        result.notes += self._recovered
        self._recovered = []
        constructing = [r for r in cell.stuck if any(
            f in (result.outputs[r].stack or "") for f in CONSTRUCTOR_FRAMES)]
        if constructing:
            self._wedged = True  # the next cell fails at once instead of waiting for them
            result.notes.append(
                f"{ranks_are(constructing)} stuck creating a process group (usually because "
                "the ranks did not all create the same groups before): that wait has no "
                "timeout, so only `%mesh restart` frees them.")
        elif self._busy:
            result.notes.append(
                f"{ranks_are(self._busy)} stuck in native code (usually a collective), "
                f"deaf to interrupts until the process-group timeout "
                f"({self.profile.pg_timeout:g} s) makes it raise. The next cell waits for "
                f"{'it' if len(self._busy) == 1 else 'them'}, then re-forms the process "
                "group; `%mesh restart` replaces the engines now.")
        if self._dead:
            result.notes.append(
                "the process group cannot survive a dead rank: `%mesh restart` starts fresh "
                "engines and replays this session's successful %%mesh cells (or `%mesh restart "
                "--from-checkpoint DIR` from a saved checkpoint).")
        elif cell.dist_failed and not self._busy:
            failed = [r for r, o in result.outputs.items() if o.error and o.error.from_backend()]
            result.notes.append(
                f"the process group failed on {label(failed)[1:-1]} in this cell: meshlab "
                "re-forms it before the next cell (and rebuilds the mesh).")
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

    def _recover(self, creates_groups: bool = False) -> None:
        """Before a cell: wait for ranks a previous cell left stuck, then re-form the group
        if it failed (or, before a group is made, if the ranks made different groups)."""
        if self._busy:
            pending = list(self._busy.values())
            ranks = format_ranks(self._busy)
            subject = ranks_are(self._busy)
            # ranks that already outlived the process-group timeout get a last look only
            limit = 1.0 if self._wedged else self.profile.pg_timeout + 30
            logging.getLogger("meshlab").warning(
                "waiting up to %g s for %s to leave the stuck collective", limit,
                f"rank{'s' if len(self._busy) > 1 else ''} {ranks}")
            try:
                done = self._wait_for(pending, limit)
            except KeyboardInterrupt:
                raise ClusterError(f"{subject} still stuck from an earlier cell (the wait for "
                                   "them was interrupted): `%mesh restart` replaces the "
                                   "engines") from None
            if not done:
                self._wedged = True
                raise ClusterError(
                    f"{subject} still stuck from an earlier cell, past the process-group "
                    "timeout (a wait in native code that does not time out): `%mesh restart` "
                    "replaces the engines")
            self._busy.clear()
            self._wedged = False
        if self._diverged and creates_groups:
            self._needs_regroup = True
            self._recovered.append(f"{self._diverged}: meshlab re-formed the process group "
                                   "first, so that the new group does not deadlock.")
        if self._needs_regroup:
            self.regroup(self._members)
            if not self._recovered:
                self._recovered.append(f"the process group was re-formed after the failure "
                                       f"(generation {self._generation}).")
            logging.getLogger("meshlab").warning("%s", self._recovered[-1])
