"""Running code on the ranks: a cell sent down the cell channel and waited for, its
collectives traced or every rank profiled meanwhile, and interrupting it. Mixed into Cluster.
"""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import meshlab.measure.comms
import meshlab.measure.profiling
import meshlab.notebook.on_ranks
from meshlab.notebook.cell import CellRun
from meshlab.notebook.output import CellResult, MeshError, group
from meshlab.notebook.ranks import label
from meshlab.notebook.recovery import GROUP_CREATION

if TYPE_CHECKING:
    from meshlab.mesh import MeshSpec
    from meshlab.notebook.cell_progress import CellProgress
    from meshlab.notebook.cluster import Cluster
    from meshlab.notebook.debugger import Debugger
    from meshlab.notebook.profiles import Profile


class CellRunning:
    """run, and what a cell's comms and profile options collect; interrupt."""

    _client: Any
    cell_channel: Any
    _engines: list[int]
    _hosts: list[dict[str, Any]]
    _dead: dict[int, str]
    _cells_run: int
    _tracking: set[int]
    mesh_spec: MeshSpec | None
    profile: Profile
    _ranks: Callable[..., list[int]]
    _recover: Callable[..., float]
    _after_cell: Callable[[CellRun, CellResult, str], None]
    clocks: Callable[[list[int]], dict[int, tuple[int, int]]]

    if TYPE_CHECKING:  # Cluster's
        @property
        def world_size(self) -> int: ...

    def run(
        self,
        code: str,
        ranks: str | list[int] | None = None,
        timeout: float | None = None,
        *,
        on_output: Callable[[CellResult], None] | None = None,
        keep_values: bool = False,
        comms: bool = False,
        profile: bool = False,
        trace: bool = False,
        memory: bool = False,
        number: int | None = None,
        on_breakpoint: Callable[[Debugger], None] | None = None,
        on_progress: Callable[[CellProgress], None] | None = None,
    ) -> CellResult:
        """Run ``code`` on every rank (or ``ranks``); raise MeshError if any rank fails.

        ``timeout`` (seconds; default from the profile) interrupts ranks still running and
        reports their stacks. ``on_output`` sees the partial result as output streams in.
        ``keep_values``: each rank sends its last expression's value with its reply, into
        ``result.values``.
        ``comms`` traces the collectives each rank issues into ``result.comms``.
        ``profile`` profiles every rank (torch.profiler and timed collectives) into
        ``result.profile``, a CellProfile on the notebook's clock; ``trace`` keeps torch's
        own trace of every rank in it too (what a Perfetto file shows: every op and thread).
        ``memory`` tracks every rank's memory over the cell, by category and module, into
        ``result.memory`` (rank -> meshlab.measure.memory_timeline.MemoryTimeline).
        ``number``: the ranks run the cell as In [number] (the notebook's), so tracebacks
        and stacks name it; without it, the count of cells this cluster ran.
        ``on_breakpoint`` drives the debugger when a rank stops at ``breakpoint()`` (see
        CellRun); without it the rank goes on.
        ``on_progress`` sees every second, once the cell has run a few, how long it has run
        and each rank's optimizer steps in it (a CellProgress); ``result.progress`` holds the
        final one either way.
        """
        ranks = self._ranks(ranks)
        timeout = timeout if timeout is not None else self.profile.cell_timeout
        # the cell's limit bounds the wait for ranks an earlier cell left stuck too
        spent = self._recover(creates_groups=bool(GROUP_CREATION.search(code)),
                              timeout=timeout or None)
        if comms or profile:  # before the cell is sent: the two travel apart
            view = self._client.direct_view([self._engines[r] for r in ranks])
            if profile:
                remote = [r for r in ranks if self._hosts[r]["host"] != socket.gethostname()]
                clocks_before = self.clocks(remote)
                view.apply_sync(meshlab.measure.profiling.start, trace)
            else:
                view.apply_sync(meshlab.measure.comms.start)
        self._stop_tracking([r for r in self._tracking if r not in self._dead])
        if memory:  # last before the cell: the tracker sees the cell's ops only
            self._client.direct_view([self._engines[r] for r in ranks]).apply_sync(
                meshlab.notebook.on_ranks.start_memory)
        self._cells_run += 1
        number = self._cells_run if number is None else number
        cell = CellRun(cast("Cluster", self),  # the Cluster this is mixed into
                       self.cell_channel.send(ranks, code, number, keep_values),
                       timeout, on_output, spent=spent, on_breakpoint=on_breakpoint,
                       on_progress=on_progress)
        result = cell.wait()
        if profile:
            result.profile = self._collect_profiles([r for r in ranks if r not in cell.stuck],
                                                    clocks_before)
            if comms and result.profile is not None:
                result.comms = {r: p.collectives for r, p in result.profile.ranks.items()}
        elif comms:
            result.comms = self._collect_traces([r for r in ranks if r not in cell.stuck])
        if memory:
            result.memory = self._collect_memory([r for r in ranks if r not in cell.stuck])
            self._tracking |= set(cell.stuck)  # stopped when they are free, before a cell
        self._after_cell(cell, result, code)
        if keep_values:
            result.values, unsent = cell.values()
            result.notes += [f"{label(rs)} value not kept: {why}" for rs, why in group(unsent)]
        if on_output:
            on_output(result)
        if not result.ok:
            raise MeshError(result)
        return result

    def _wait_for(self, pending: list[str], timeout: float) -> bool:
        """Wait until the cells and calls ``pending`` (ids) have ended; whether they did."""
        deadline = time.monotonic() + timeout
        for cell in filter(None, map(self.cell_channel.cell, pending)):
            if not self.cell_channel.wait(cell, deadline - time.monotonic()):
                return False
            self.cell_channel.forget(cell)
        calls = [i for i in pending if not self.cell_channel.owns(i)]
        return self._client.wait(calls, timeout=max(0.0, deadline - time.monotonic()))

    def _collect_traces(self, ranks: list[int]) -> dict[int, list[Any]]:
        alive = [r for r in ranks if r not in self._dead]
        if not alive:
            return {}
        ar = self._client.direct_view([self._engines[r] for r in alive]).apply_async(
            meshlab.measure.comms.stop)
        return dict(zip(alive, ar.get(timeout=30), strict=True))

    def _stop_tracking(self, ranks: list[int]) -> None:
        """End the memory tracking a stuck --memory cell left on ``ranks`` (freed since)."""
        if not ranks:
            return
        from meshlab.measure.memory_timeline import stop_tracking

        self._client.direct_view([self._engines[r] for r in ranks]).apply_sync(stop_tracking)
        self._tracking -= set(ranks)

    def _collect_memory(self, ranks: list[int]) -> dict[int, Any]:
        from meshlab.measure.memory_timeline import stop  # torch's trackers: when asked for

        pending = {r: self._client[self._engines[r]].apply_async(stop, rank=r)
                   for r in ranks if r not in self._dead}
        return {r: t for r, ar in pending.items() if (t := ar.get(timeout=60)) is not None}

    def _collect_profiles(self, ranks: list[int], clocks_before: dict[int, tuple[int, int]]
                          ) -> Any:
        from meshlab.notebook.cell_profile import CellProfile, clocks_from

        alive = [r for r in ranks if r not in self._dead]
        stop = meshlab.measure.profiling.stop
        pending = {r: self._client[self._engines[r]].apply_async(stop, rank=r)
                   for r in alive}
        profiles = {r: p for r, ar in pending.items() if (p := ar.get(timeout=60)) is not None}
        if not profiles:
            return None
        clocks = clocks_from(profiles, clocks_before, self.clocks(list(clocks_before)))
        return CellProfile(profiles, clocks, self.mesh_spec, self.world_size)

    def interrupt(self, ranks: str | list[int] | None = None) -> None:
        """Send SIGINT to ranks (a KeyboardInterrupt in the cell they are running)."""
        targets = [self._engines[r] for r in self._ranks(ranks, check_dead=False)
                   if r not in self._dead]
        if targets:
            self._client.send_signal(signal.SIGINT, targets=targets, block=False)
