"""Questions the notebook asks the ranks through ipyparallel's control channel, which each
rank answers from a side thread (meshlab.rank.probe_server): so they are answered while a
cell runs or hangs. Mixed into Cluster."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pandas as pd


class RankProbes:
    """status, stacks, clocks, last collectives, optimizer steps, post-mortems and
    completion."""

    _client: Any
    cell_channel: Any
    _engines: list[int]
    _hosts: list[dict[str, Any]]
    _busy: dict[int, str]
    _dead: dict[int, str]
    _ranks: Callable[..., list[int]]

    def status(self) -> pd.DataFrame:
        """One row per rank: host, pid, device, alive, busy, memory."""
        replies = self._probe(range(len(self._engines)), "status")
        rows = []
        for r in range(len(self._engines)):
            row = {"rank": r, **{k: self._hosts[r][k] for k in ("host", "pid")}}
            reply = replies.get(r)
            row.update(reply or {"device": "?"})
            row["alive"] = reply is not None
            row["busy"] = reply is not None and (
                r in self._busy or r in self.cell_channel.running()
                or bool(self._client.queue_status(self._engines[r]).get("queue", 0)))
            rows.append(row)
        return pd.DataFrame(rows).set_index("rank")

    def stacks(self, ranks: str | list[int] | None = None, *, native: bool = False
               ) -> dict[int, str]:
        """The main-thread Python stack of each rank: where a running cell is right now;
        ``native``: py-spy's, C and C++ frames included (meshlab.rank.native_stacks), or why
        there is none."""
        chosen = self._ranks(ranks, check_dead=False)
        if native:  # py-spy pauses the rank a moment; the ranks answer side by side
            return self._probe(chosen, "native_stack", timeout=30.0)
        return self._probe(chosen, "stack")

    def stop_ignored(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        """Where each rank's cell is after SIGINTs did not end it; those that caught it and
        went on get meshlab's stop signal (meshlab.rank.probe_server.stop_ignored says how)."""
        return self._probe(self._ranks(ranks, check_dead=False), "stop")

    def collectives(self, ranks: str | list[int] | None = None, limit: int = 8
                    ) -> dict[int, list[dict[str, Any]]]:
        """The last collectives each rank issued (torch's flight recorder), oldest first."""
        return self._probe(self._ranks(ranks, check_dead=False), "collectives", limit=limit)

    def optimizer_steps(self, ranks: str | list[int] | None = None) -> int:
        """optimizer.step() calls so far, most on any of the ranks."""
        return max(self._probe(self._ranks(ranks), "optimizer_steps").values(), default=0)

    def postmortem(self, rank: int) -> dict[str, Any] | None:
        """The last failed cell on ``rank``: traceback, failing frame and its variables."""
        self._ranks([rank])
        return self._probe([rank], "postmortem", timeout=10.0).get(rank)

    def defined(self, names: list[str], rank: int = 0) -> list[str]:
        """Those of ``names`` defined in ``rank``'s namespace."""
        return self._probe([rank], "defined", names=names).get(rank, [])

    def complete(self, text: str) -> list[str]:
        """Completions of ``text`` in rank 0's namespace (for tab completion in cells)."""
        return self._probe([0], "complete", text=text, timeout=1.0).get(0) or []

    def clocks(self, ranks: list[int], samples: int = 6) -> dict[int, tuple[int, int]]:
        """Each rank's clock minus the notebook's, in ns, and the most that can be off by.

        The rank reads its clock between the request and the reply, so the midpoint of the
        shortest of ``samples`` round trips is off by at most half of it (as NTP reckons).
        One rank at a time: a round trip shared with other ranks would be longer."""
        best: dict[int, tuple[int, int]] = {}
        for r in ranks:
            for _ in range(samples):
                sent = time.time_ns()
                reply = self._probe([r], "clock").get(r)
                back = time.time_ns()
                if reply is not None and (r not in best or (back - sent) // 2 < best[r][1]):
                    best[r] = (int(reply) - (sent + back) // 2, (back - sent) // 2)
        return best

    def ask(self, ranks: Any, what: str, **content: Any) -> dict[int, Any]:
        """Send the probe ``what`` to ``ranks`` without waiting: {rank: future}; ``answer``
        reads one that is done. The dead are left out, and any the hub no longer knows."""
        futures = {}
        for r in ranks:
            if r in self._dead:
                continue
            try:
                futures[r] = self._client._send_control_request(  # ipyparallel: no public hook
                    targets=[self._engines[r]], msg_type="meshlab_probe_request",
                    content={"what": what, **content}, block=False)
            except Exception:  # its engine unregistered: it is dying, and cannot answer
                continue
        return futures

    @staticmethod
    def answer(future: Any, timeout: float = 0.0) -> tuple[bool, Any]:
        """(whether the rank answered, its answer) of a future ``ask`` gave, waiting at most
        ``timeout`` seconds; an error answer counts as none."""
        try:
            (msg,) = future.result(timeout=max(0.01, timeout))
        except Exception:
            return False, None  # a rank that cannot answer is simply missing from the reply
        ok = msg["content"].get("status") == "ok"
        return ok, msg["content"]["value"] if ok else None

    def _probe(self, ranks: Any, what: str, timeout: float = 2.0, **content: Any
               ) -> dict[int, Any]:
        futures = self.ask(ranks, what, **content)
        deadline = time.monotonic() + timeout
        replies = {}
        for r, future in futures.items():
            ok, value = self.answer(future, deadline - time.monotonic())
            if ok:
                replies[r] = value
        return replies
