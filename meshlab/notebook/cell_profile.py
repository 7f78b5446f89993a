"""Every rank's profile of one cell on one time axis: what each rank computed, copied and
communicated, how much communication hid behind work, and who made whom wait.

Notebook side. The ranks send meshlab.measure.profiling.RankProfile; this module moves each onto the
notebook's clock, matches each collective across the ranks of its group (the k-th call on a
group is the same collective on every member: torch requires that order), and answers in
DataFrames that meshlab.notebook.charts and tables draw. ``chrome_trace`` writes one file
that Perfetto and chrome://tracing open unchanged.

Why not Holistic Trace Analysis: its breakdowns (temporal, overlap, idle) read GPU kernels
on CUDA streams, and CPU ranks have none; torch's profiler gives the events, and the
arithmetic on them is unions of intervals, done here.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from meshlab.measure.comms import P2P, CommRecord, call_key, op_label
from meshlab.measure.profiling import RankProfile, Span, boot_id
from meshlab.mesh import MeshSpec
from meshlab.notebook.ranks import format_ranks
from meshlab.notebook.tables.comms import axis_of
from meshlab.rank.private_files import write_private

Interval = tuple[int, int]


@dataclass(slots=True)
class Clock:
    """How a rank's clock maps onto the notebook's."""

    offset_ns: int  # rank clock minus notebook clock
    error_ns: int  # the most the offset can be off by
    how: str  # "same machine" (one clock, nothing to measure) or "measured"
    drift_ns: int = 0  # how much the offset moved between the measures before and after


def same_machine(profile: RankProfile) -> bool:
    """Whether a rank runs on the notebook's machine (same host name and boot: one clock)."""
    return profile.host == socket.gethostname() and profile.boot_id == boot_id() != ""


def clocks_from(profiles: dict[int, RankProfile], before: dict[int, Interval],
                after: dict[int, Interval]) -> dict[int, Clock]:
    """Each rank's Clock: none to measure on the notebook's machine; else the mean of the
    offsets measured before and after the cell, off by the larger bound plus half the drift."""
    out = {}
    for r, p in profiles.items():
        if same_machine(p) or r not in before or r not in after:
            out[r] = Clock(0, 0, "same machine" if same_machine(p) else "not measured")
            continue
        (b, eb), (a, ea) = before[r], after[r]
        out[r] = Clock((a + b) // 2, max(eb, ea) + abs(a - b) // 2, "measured", a - b)
    return out


# -- intervals ---------------------------------------------------------------------------------

def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same instants."""
    out: list[Interval] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> int:
    return sum(end - start for start, end in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Instants in both (each sorted and disjoint)."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


# -- the merged profile ------------------------------------------------------------------------

@dataclass
class CellProfile:
    """A profiled cell: every rank's work on the notebook's clock."""

    ranks: dict[int, RankProfile]
    clocks: dict[int, Clock]
    spec: MeshSpec | None
    world_size: int
    saved: Path | None = None  # where save() last wrote the trace
    _calls: pd.DataFrame | None = field(default=None, repr=False)  # collectives(), matched once

    @property
    def origin_ns(self) -> int:
        """The earliest start of the cell on any rank (the notebook's clock): time 0."""
        return min(self._at(r, p.start_ns) for r, p in self.ranks.items())

    def _at(self, rank: int, ns: int) -> int:
        """A rank's instant on the notebook's clock."""
        return ns - self.clocks[rank].offset_ns

    def _ms(self, rank: int, ns: int) -> float:
        return (self._at(rank, ns) - self.origin_ns) / 1e6

    @property
    def clock_error_ms(self) -> float:
        """The most any two ranks' instants can be off on the merged axis."""
        errors = sorted((c.error_ns for c in self.clocks.values()), reverse=True)
        return (errors[0] + (errors[1] if len(errors) > 1 else 0)) / 1e6

    def axis(self, record: CommRecord) -> str:
        return axis_of(record.group, self.spec, self.world_size)

    def _busy(self, p: RankProfile) -> list[Interval]:
        return union((s.start_ns, s.end_ns) for s in p.spans)

    def _comm(self, p: RankProfile, axis: str | None = None) -> list[Interval]:
        return union((c.issued_ns, c.done_ns or c.issued_ns) for c in p.collectives
                     if axis is None or self.axis(c) == axis)

    def summary(self) -> pd.DataFrame:
        """Per rank, in ms: the cell's window, compute, copies, communication hidden behind
        them and exposed (in total and per mesh axis), idle (no work and no communication:
        Python between ops on a CPU rank, a bubble), and time spent waiting for later ranks at
        collectives, with how many collectives the rank reached last."""
        waited: dict[int, float] = {}
        last: dict[int, int] = {}
        for call in self.collectives().to_dict("records"):
            for r, ms in call["waits"].items():
                waited[r] = waited.get(r, 0.0) + ms
            if len(call["ranks"]) > 1:
                last[call["last"]] = last.get(call["last"], 0) + 1
        axes = sorted({self.axis(c) for p in self.ranks.values() for c in p.collectives})
        rows = []
        for r, p in sorted(self.ranks.items()):
            busy, comm = self._busy(p), self._comm(p)
            hidden = length(overlap(comm, busy))
            ns = {"window": p.end_ns - p.start_ns,
                  "compute": length(union((s.start_ns, s.end_ns) for s in p.spans
                                          if s.kind == "compute")),
                  "copy": length(union((s.start_ns, s.end_ns) for s in p.spans
                                       if s.kind == "copy")),
                  "comm hidden": hidden, "comm exposed": length(comm) - hidden}
            for axis in axes:
                mine = self._comm(p, axis)
                ns[f"exposed {axis}"] = length(mine) - length(overlap(mine, busy))
            ns["idle"] = max(0, ns["window"] - length(union(busy + comm)))
            rows.append({"rank": r, **{k: v / 1e6 for k, v in ns.items()},
                         "waited for others": waited.get(r, 0.0),
                         "last to arrive": last.get(r, 0)})
        return pd.DataFrame(rows).set_index("rank")

    def collectives(self) -> pd.DataFrame:
        """One row per collective, matched across its group: op, axis, bytes, when the first
        and last member arrived (ms), who was last, how long each other member waited for it
        (``waits``: rank -> ms) and when the last member had its result.
        Matched once: the summary, stragglers, spans and trace all ask."""
        if self._calls is None:
            self._calls = self._match()
        return self._calls.copy()

    def _match(self) -> pd.DataFrame:
        calls: dict[tuple[tuple[int, ...], int], dict[int, CommRecord]] = {}
        for r, p in self.ranks.items():
            for c in p.collectives:
                calls.setdefault((call_key(r, c), c.seq), {})[r] = c
        rows = []
        for (group, seq), members in calls.items():
            arrived = {r: self._ms(r, c.issued_ns) for r, c in members.items()}
            last = max(arrived, key=lambda r: arrived[r])
            first = next(iter(members.values()))
            done = [self._ms(r, c.done_ns) for r, c in members.items() if c.done_ns]
            p2p = first.op in ("send", "recv")
            rows.append({
                "op": op_label("send/recv" if p2p else first.op, first.algorithm),
                "axis": self.axis(first),
                "group": _label(group),
                "seq": seq, "bytes": first.bytes, "first": min(arrived.values()),
                "last": last, "arrived": arrived[last],
                "done": max(done) if done else float("nan"),
                "waits": {r: arrived[last] - t for r, t in arrived.items() if r != last},
                "ranks": sorted(members), "complete": set(members) == _members(group)})
        columns = ["op", "axis", "group", "seq", "bytes", "first", "last", "arrived", "done",
                   "waits", "ranks", "complete"]
        frame = pd.DataFrame(rows, columns=columns)
        return frame.sort_values("first", ignore_index=True) if len(frame) else frame

    def stragglers(self, share: float = 0.6) -> list[str]:
        """Sentences naming ranks the others waited for: a rank that arrived last at more than
        3/4 of the (at least 8) collectives it shared, or at 8 or more and 1.5 times as many
        as any other rank while the most waited for, or that ``share`` or more of all the
        waiting at collectives was for while it arrived last at more than half of them, or
        that arrived last most often (8 or more) while it waited less than half as long as
        any other rank. (In a pair chance alone makes a rank last at half; on a mesh a slow
        rank's lateness spreads along the other axes, so its share of all waiting alone can
        hide it; on a loaded machine noise in the collectives blurs the counts, but the
        slow rank still waits for nobody while everyone waits for it.)"""
        frame = self.collectives()
        if not len(frame):
            return []
        shared = frame[frame["ranks"].apply(len) > 1]
        caused: dict[int, float] = {}
        for call in shared.to_dict("records"):
            caused[call["last"]] = caused.get(call["last"], 0.0) + sum(call["waits"].values())
        members = {r for ranks in shared["ranks"] for r in ranks}
        waiting: dict[int, float] = {}  # what each rank itself waited for others
        for waits in shared["waits"]:
            for r, w in waits.items():
                waiting[r] = waiting.get(r, 0.0) + w
        total = sum(caused.values())
        lasts = shared["last"].value_counts().to_dict()
        out = []
        for rank, waited in sorted(caused.items(), key=lambda item: -item[1]):
            calls = len(shared[shared["ranks"].apply(lambda rs, r=rank: r in rs)])
            last = int(lasts.get(rank, 0))
            mostly_last = calls >= 8 and last > 0.75 * calls
            most_waiting = total > 0 and waited >= share * total and last > calls / 2 >= 1.5
            # last far more often than any other rank: where its lateness spreads along the
            # other axes, the ranks it delays are last at their own groups' calls in turn
            next_most = max((n for r, n in lasts.items() if r != rank), default=0)
            far_most_last = (last >= 8 and last >= 1.5 * next_most
                             and waited == max(caused.values()))  # and the most waited for
            waits_least = (last >= 8 and last == max(lasts.values())
                           and all(waiting.get(rank, 0.0) < 0.5 * waiting.get(r, 0.0)
                                   for r in members if r != rank))
            if waited > 0 and (mostly_last or most_waiting or far_most_last or waits_least):
                out.append(f"rank {rank} arrived last at {last} of {calls} collectives; "
                           f"the others waited {waited:,.1f} ms for it in all "
                           f"({waited / total:.0%} of all waiting)")
        return out

    def spans(self, merge_ms: float = 0.0) -> pd.DataFrame:
        """Everything on the merged axis, one row per span (ms from the cell's start): compute
        and copies (neighbours less than ``merge_ms`` apart joined, for drawing), every
        collective (its axis and bytes; the part before its group's last member arrived is
        a "wait" row naming that rank) and idle gaps."""
        waits = self.collectives()
        by_call = {(g, s): row for g, s, row in zip(
            waits["group"], waits["seq"], waits.to_dict("records"), strict=True)}
        rows = []
        for r, p in sorted(self.ranks.items()):
            for s in _joined(p.spans, int(merge_ms * 1e6)):
                rows.append({"rank": r, "kind": s.kind, "name": s.name, "axis": "",
                             "start": self._ms(r, s.start_ns), "end": self._ms(r, s.end_ns),
                             "bytes": 0, "waited on": ""})
            for c in p.collectives:
                call = by_call.get((_label(call_key(r, c)), c.seq))
                start, end = self._ms(r, c.issued_ns), self._ms(r, c.done_ns or c.issued_ns)
                row = {"rank": r, "kind": "comm", "name": op_label(c.op, c.algorithm),
                       "axis": self.axis(c),
                       "bytes": c.bytes, "waited on": ""}
                if call is not None and call["last"] != r and call["arrived"] > start:
                    # arrived before the last member: waiting for it, then moving data
                    late = min(call["arrived"], end)
                    rows.append(row | {"kind": "wait", "start": start, "end": late,
                                       "waited on": f"rank {call['last']}"})
                    start = late
                rows.append(row | {"start": start, "end": end})
            covered = union((self._at(r, s.start_ns), self._at(r, s.end_ns)) for s in p.spans)
            covered = union(covered + [(self._at(r, c.issued_ns), self._at(r, c.done_ns or
                                        c.issued_ns)) for c in p.collectives])
            edges = [self._at(r, p.start_ns)] + [x for i in covered for x in i] + \
                [self._at(r, p.end_ns)]
            for start, end in zip(edges[::2], edges[1::2], strict=False):
                if end - start > merge_ms * 1e6 and end > start:
                    rows.append({"rank": r, "kind": "idle", "name": "idle", "axis": "",
                                 "start": (start - self.origin_ns) / 1e6,
                                 "end": (end - self.origin_ns) / 1e6, "bytes": 0,
                                 "waited on": ""})
        frame = pd.DataFrame(rows, columns=["rank", "kind", "name", "axis", "start", "end",
                                            "bytes", "waited on"])
        frame["duration"] = frame["end"] - frame["start"]
        return frame

    def chrome_trace(self) -> dict[str, Any]:
        """One Chrome/Perfetto trace of every rank: each rank a process (its threads and, on a
        GPU, its streams as torch.profiler recorded them, where the profile kept torch's trace;
        else meshlab's spans) on the notebook's clock, microseconds from the cell's start, plus
        a "collectives" row per rank with axis, bytes and waits."""
        events: list[dict[str, Any]] = []
        waits = self.collectives()
        by_call = {(g, s): row for g, s, row in zip(
            waits["group"], waits["seq"], waits.to_dict("records"), strict=True)}
        for r, p in sorted(self.ranks.items()):
            trace = p.trace
            base = int(trace.get("baseTimeNanoseconds", 0)) - self.clocks[r].offset_ns \
                - self.origin_ns
            events += [{"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                        "args": {"name": f"rank {r} ({p.host})"}},
                       {"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0,
                        "args": {"sort_index": r}},
                       {"ph": "M", "name": "thread_name", "pid": r, "tid": 0,
                        "args": {"name": "collectives (meshlab)"}}]
            for e in trace.get("traceEvents", []):
                if e.get("ph") == "M" and e.get("name") in ("process_name", "process_labels",
                                                             "process_sort_index"):
                    continue  # the rank names the process
                e = dict(e, pid=r)
                if isinstance(e.get("ts"), (int, float)):
                    e["ts"] = (base + float(e["ts"]) * 1000) / 1000
                events.append(e)
            if not trace:  # torch's own trace not kept: meshlab's spans, on a row of their own
                events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1,
                               "args": {"name": "work (meshlab)"}})
                for s in [*p.spans, *p.marks]:
                    start = self._ms(r, s.start_ns) * 1000
                    events.append({"ph": "X", "pid": r, "tid": 1, "cat": s.kind, "name": s.name,
                                   "ts": start, "dur": self._ms(r, s.end_ns) * 1000 - start})
            for c in p.collectives:
                call = by_call.get((_label(call_key(r, c)), c.seq), {})
                start = self._ms(r, c.issued_ns) * 1000
                events.append({
                    "ph": "X", "pid": r, "tid": 0, "cat": "collective",
                    "name": f"{op_label(c.op, c.algorithm)} {self.axis(c)}", "ts": start,
                    "dur": max(0.0, self._ms(r, c.done_ns or c.issued_ns) * 1000 - start),
                    "args": {"bytes": c.bytes, "group": c.group, "seq": c.seq,
                             "last to arrive": call.get("last"),
                             "waited ms": call.get("waits", {}).get(r, 0.0)}})
        return {"traceEvents": events, "displayTimeUnit": "ms",
                "otherData": {"meshlab": {"clock error ms": self.clock_error_ms,
                                          "clocks": {r: c.how for r, c in self.clocks.items()}}}}

    def save(self, folder: str | Path, name: str = "profile") -> Path:
        """Write the Chrome/Perfetto trace of every rank to ``folder/name.json``: 0600 (it
        names the model's modules and shapes), never through a link."""
        path = Path(folder).expanduser() / f"{name}.json"
        write_private(path, json.dumps(self.chrome_trace()))
        self.saved = path
        return path


def _label(key: tuple[int, ...]) -> str:
    """A call's group as shown: ``[0-3]``; a send/recv ``0->1``."""
    return f"{key[1]}->{key[2]}" if key[0] == P2P else f"[{format_ranks(key)}]"


def _members(key: tuple[int, ...]) -> set[int]:
    return set(key[1:]) if key[0] == P2P else set(key)


def _joined(spans: list[Span], gap_ns: int) -> list[Span]:
    """Neighbouring spans of one kind less than ``gap_ns`` apart as one, named for the op
    that took most of it (for drawing: a step is thousands of ops)."""
    blocks: list[tuple[Span, dict[str, int]]] = []
    for s in sorted(spans, key=lambda s: s.start_ns):
        if blocks and blocks[-1][0].kind == s.kind and s.start_ns - blocks[-1][0].end_ns < gap_ns:
            block, names = blocks[-1]
            block.end_ns = max(block.end_ns, s.end_ns)
        else:
            block, names = Span(s.kind, s.name, s.start_ns, s.end_ns), {}
            blocks.append((block, names))
        names[s.name] = names.get(s.name, 0) + s.end_ns - s.start_ns
    for block, names in blocks:
        top = max(names, key=lambda n: names[n])
        block.name = top if len(names) == 1 else f"{top} and {len(names) - 1} other ops"
    return [block for block, _ in blocks]
