"""Calling a function on every rank at once, and which ranks are there to call: a rank
selection checked against the dead ones, how each died, which failed a call. Mixed into
Cluster.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipyparallel as ipp

from meshlab.notebook.engine_processes import EngineProcesses
from meshlab.notebook.errors import ClusterError
from meshlab.notebook.output import group, strip_ansi
from meshlab.notebook.ranks import label, parse_ranks, ranks_are

if TYPE_CHECKING:
    from meshlab.notebook.profiles import Profile

PEERS_AFTER_A_FAILURE = 5.0  # seconds the other ranks get to finish once one has failed
LAUNCHER_REASON_WAIT = 5.0  # seconds a launcher that knows why a rank ended (Ray) gets to say


class RankCalls:
    """_apply_each, _ranks, dead and the failures and deaths they report."""

    _client: Any
    _processes: EngineProcesses
    _engines: list[int]
    _hosts: list[dict[str, Any]]
    _busy: dict[int, str]
    _dead: dict[int, str]
    _needs_regroup: bool
    profile: Profile
    interrupt: Callable[..., None]

    if TYPE_CHECKING:  # Cluster's
        @property
        def running(self) -> bool: ...

        @property
        def world_size(self) -> int: ...

    def _ranks(self, spec: str | list[int] | Any, check_dead: bool = True) -> list[int]:
        if not self.running:
            raise ClusterError("no cluster is running: start one with `%mesh start N` "
                               "(or meshlab.Cluster(N).start())")
        ranks, gone = parse_ranks(spec, self.world_size), self.dead()
        dead = [r for r in ranks if r in gone]
        if check_dead and dead:
            raise ClusterError(
                "; ".join(f"rank {r} died: {self._dead[r]}" for r in dead)
                + ". `%mesh restart` starts fresh engines and replays the session's cells.")
        return ranks

    def _failures(self, error: Any, ranks: list[int]) -> list[tuple[int, str, str]]:
        """(rank, exception name, message) for each engine an ipyparallel call failed on."""
        rank_of = {self._engines[r]: r for r in ranks}
        return [(rank_of[info["engine_id"]], ename, evalue)
                for ename, evalue, _, info in error.elist]

    def _apply_each(self, fn: Callable[..., Any], kwargs: Callable[[int], dict[str, Any]] | None
                    = None, timeout: float = 60.0) -> dict[int, Any]:
        """Call ``fn(**kwargs(rank))`` on every rank at once; wait for all. Once one has
        failed, the others get PEERS_AFTER_A_FAILURE seconds more: in a set-up step they wait
        for it in the store or a collective, until the process-group timeout."""
        pending = {r: self._client[eid].apply_async(fn, **(kwargs(r) if kwargs else {}))
                   for r, eid in enumerate(self._engines)}
        out: dict[int, Any] = {}
        failed: dict[int, str] = {}
        tracebacks: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(failed) < len(pending):
                for r, ar in pending.items():
                    if r in out or r in failed or not ar.ready():
                        continue
                    try:
                        out[r] = ar.get()
                    except ipp.RemoteError as e:
                        failed[r], tracebacks[r] = f"{e.ename}: {e.evalue}", e.traceback
                        deadline = min(deadline, time.monotonic() + PEERS_AFTER_A_FAILURE)
                if time.monotonic() > deadline:
                    raise TimeoutError
                time.sleep(0.01)
        except (KeyboardInterrupt, TimeoutError) as stop:
            # meshlab must know the ranks still in it: the next cell waits for them, then
            # re-forms the group (a Ctrl-C'd `%mesh init` would otherwise hang the next cell)
            stuck = {r: ar.msg_ids[0] for r, ar in pending.items() if not ar.ready()}
            self.interrupt(list(stuck))
            self._busy.update(stuck)
            self._needs_regroup = True
            why = ("was interrupted" if isinstance(stop, KeyboardInterrupt) else
                   f"did not finish within {timeout:g} s" if not failed else
                   "failed")
            # the ranks that failed are usually why the others wait: say what they said
            said = "".join(f"; {label(ranks)} failed: {text}" for ranks, text in group(failed))
            raise ClusterError(
                f"{fn.__name__} {why}; {ranks_are(stuck)} still in it{said}. The next cell "
                f"waits up to {self.profile.pg_timeout + 30:g} s for them, then re-forms the "
                "process group; `%mesh restart` replaces the engines now.") from None
        if failed:  # one line per group of ranks; the lowest rank's traceback at debug level
            logging.getLogger("meshlab").debug("rank %d: %s", min(failed),
                                               strip_ansi(tracebacks[min(failed)]))
            raise ClusterError("\n".join(f"{label(ranks)} {why}" for ranks, why in group(failed)))
        return out

    def dead(self) -> dict[int, str]:
        """Ranks whose process has ended, with how: ``{2: "killed by SIGKILL"}``."""
        codes = self._processes.exit_codes() if self._hosts else {}
        here = socket.gethostname()  # pids are this machine's: a remote rank's may coincide
        deadline = time.monotonic() + LAUNCHER_REASON_WAIT  # shared by the ranks found gone
        for r, h in enumerate(self._hosts):
            if r not in self._dead and ((h["host"] == here and codes.get(h["pid"]) is not None)
                                        or self._engines[r] not in self._client.ids):
                self._dead[r] = self._processes.reason(
                    h["host"], h["pid"], wait=max(0.0, deadline - time.monotonic())) or (
                    self._processes.cause_of_death(h["pid"]) if h["host"] == here
                    else self._silent_host(h["host"]))
            elif said := self._processes.reason(h["host"], h["pid"]):
                self._dead[r] = said  # its launcher's word (Ray's) once it has one
            elif h["host"] != here and self._dead.get(r, "").startswith("its engine on "):
                # a host falls silent one heartbeat at a time: once its last rank goes too,
                # the ones seen first are told as what they were, the host
                self._dead[r] = self._silent_host(h["host"])
        return dict(self._dead)

    def _silent_host(self, host: str) -> str:
        """Why a rank on another host is gone: the controller stopped hearing its engine
        (its heartbeats), alone or with every rank of that host."""
        on_host = [r for r, h in enumerate(self._hosts) if h["host"] == host]
        if all(self._engines[r] not in self._client.ids for r in on_host):
            return (f"its host {host} stopped answering: no heartbeat from any of its "
                    f"{len(on_host)} ranks (a network link, or the machine)")
        return f"its engine on {host} stopped responding"
