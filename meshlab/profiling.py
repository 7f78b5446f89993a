"""One rank's timeline of a cell: what torch.profiler saw it compute and copy, and every
collective with when this rank issued it and when it completed here.

Plain torch, for ``%%mesh --profile``: the cluster calls start() before the cell and stop()
after it; the notebook lines the ranks' profiles up on one clock (meshlab.notebook.
cell_profile). Times are ``time.time_ns()`` on this rank's clock, which torch.profiler's
trace shares (its events are unix time: ``baseTimeNanoseconds`` plus ``ts``).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from meshlab import comms
from meshlab.comms import CommRecord

COPIES = ("aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::clone")
_COMM_OPS = ("c10d::", "_c10d_functional::", "c10d_functional::")


@dataclass(slots=True)
class Span:
    """Work on a rank between two instants of its clock (nanoseconds)."""

    kind: str  # "compute" or "copy"
    name: str  # the op or kernel (aten::mm, a Triton kernel's name, Memcpy HtoD)
    start_ns: int
    end_ns: int


@dataclass(slots=True)
class RankProfile:
    """What one rank did during a profiled cell."""

    rank: int
    host: str
    boot_id: str  # processes of one machine share its clock: same host and boot id
    start_ns: int  # the cell's window on this rank's clock
    end_ns: int
    spans: list[Span]  # compute and copies, outermost ops only (GPU kernels on a GPU)
    collectives: list[CommRecord]  # timed: issued_ns, done_ns, seq
    device: str  # "cpu" or "cuda": which clock the spans' work ran on
    packed_trace: bytes = b""  # torch.profiler's Chrome trace: JSON, zlib-compressed

    @property
    def trace(self) -> dict[str, Any]:
        """torch.profiler's Chrome trace of the cell on this rank (traceEvents, ...)."""
        if not self.packed_trace:
            return {}
        loaded: dict[str, Any] = json.loads(zlib.decompress(self.packed_trace))
        return loaded


_active: tuple[Any, int] | None = None
_cell: list[int] = []  # when the cell began and ended here (cell_exec marks them)


def mark_cell() -> None:
    """Called by cell_exec as a cell begins and ends: the profile's window is the cell's
    own time, not the profiler's start or the wait for the cell to arrive."""
    if _active is not None:
        _cell.append(time.time_ns())


def start() -> None:
    """Profile this rank until stop(): torch.profiler (CPU, and CUDA on a GPU) and timed
    collectives."""
    global _active
    stop()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    with _quiet():
        profiler.__enter__()
    comms.start(timed=True)
    _cell.clear()
    _active = (profiler, time.time_ns())


def stop(rank: int = 0) -> RankProfile | None:
    """Stop profiling; what this rank did since start() (None if it was not profiling)."""
    global _active
    if _active is None:
        return None
    (profiler, started), _active = _active, None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    ended = time.time_ns()
    if len(_cell) >= 2:  # the cell ran: its own window
        started, ended = _cell[0], _cell[-1]
    collectives = comms.stop()
    with _quiet():
        profiler.__exit__(None, None, None)
    text = _chrome_trace(profiler)
    spans, device = spans_of(json.loads(text), threading.get_native_id())
    spans = [Span(s.kind, s.name, max(s.start_ns, started), min(s.end_ns, ended))
             for s in spans if s.end_ns > started and s.start_ns < ended]  # the cell's only
    return RankProfile(rank, socket.gethostname(), boot_id(), started, ended, spans,
                       collectives, device, zlib.compress(text, 1))  # ~10x smaller to send


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """torch 2.11 warns "Profiler clears events at the end of each cycle" once: a profile of
    one cell is one cycle by design, and the warning would land in the cell's stderr."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*clears events at the end of each cycle")
        yield


def boot_id() -> str:
    """This machine's boot id (Linux): ranks and notebook with the same one share a clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _chrome_trace(profiler: Any) -> bytes:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="meshlab-profile-")
    os.close(fd)
    try:
        profiler.export_chrome_trace(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def spans_of(trace: dict[str, Any], main_thread: int) -> tuple[list[Span], str]:
    """Compute and copies from a Chrome trace: GPU kernels and memcpys where there are any
    (host ops only launch them), else the outermost ops of the thread that ran the cell,
    with the collectives' own calls and waits cut out (they are communication)."""
    base = int(trace.get("baseTimeNanoseconds", 0))
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]

    def span(kind: str, e: dict[str, Any]) -> Span:
        start = base + round(float(e["ts"]) * 1000)
        return Span(kind, str(e["name"]), start, start + round(float(e["dur"]) * 1000))

    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if gpu:
        return [span("compute" if e["cat"] == "kernel" else "copy", e) for e in gpu
                if not str(e["name"]).lower().startswith("nccl")], "cuda"
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("tid") == main_thread),
                 key=lambda e: float(e["ts"]))
    outer, comm, end = [], [], -1.0
    for e in ops:
        if str(e["name"]).startswith(_COMM_OPS):
            comm.append(span("comm", e))
        if float(e["ts"]) >= end:
            outer.append(e)
            end = float(e["ts"]) + float(e["dur"])
    spans = [span("copy" if e["name"] in COPIES else "compute", e) for e in outer
             if not str(e["name"]).startswith(_COMM_OPS)]
    return _cut(spans, comm), "cpu"


def _cut(spans: list[Span], holes: list[Span]) -> list[Span]:
    """``spans`` less the instants any of ``holes`` covers (both sorted by start; spans do
    not overlap each other, so a hole that ended before one span began is behind us)."""
    out, first = [], 0
    for s in spans:
        while first < len(holes) and holes[first].end_ns <= s.start_ns:
            first += 1
        start, i = s.start_ns, first
        while i < len(holes) and holes[i].start_ns < s.end_ns:
            h = holes[i]
            if h.end_ns > start:
                if h.start_ns > start:
                    out.append(Span(s.kind, s.name, start, h.start_ns))
                start = max(start, h.end_ns)
            i += 1
        if start < s.end_ns:
            out.append(Span(s.kind, s.name, start, s.end_ns))
    return out
