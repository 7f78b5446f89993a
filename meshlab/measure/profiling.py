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
import shutil
import socket
import tempfile
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.profiler import record_function

from meshlab.measure import comms
from meshlab.measure.comms import CommRecord

_HERE = "meshlab: the cell's thread"
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
    marks: list[Span]  # record_function regions of the cell's thread (Optimizer.step#..., 0F1)
    packed_trace: bytes = b""  # torch.profiler's Chrome trace (JSON, zlib), when asked for

    @property
    def trace(self) -> dict[str, Any]:
        """torch.profiler's Chrome trace of the cell on this rank (traceEvents, ...)."""
        if not self.packed_trace:
            return {}
        loaded: dict[str, Any] = json.loads(zlib.decompress(self.packed_trace))
        return loaded


_active: tuple[Any, int, bool] | None = None
_cell: list[int] = []  # when the cell began and ended here (cell_exec marks them)


def mark_cell() -> None:
    """Called by cell_exec as a cell begins and ends: the profile's window is the cell's
    own time, not the profiler's start or the wait for the cell to arrive."""
    if _active is not None:
        _cell.append(time.time_ns())


def start(trace: bool = False) -> None:
    """Profile this rank until stop(): torch.profiler (CPU, and CUDA on a GPU) and timed
    collectives; ``trace``: also keep torch's Chrome trace (for a Perfetto file)."""
    global _active
    stop()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        activities.append(ProfilerActivity.CUDA)
    profiler = profile(activities=activities)
    with _quiet():
        profiler.__enter__()
    with record_function(_HERE):  # names this thread in the profiler's own numbering
        pass
    comms.start(timed=True)
    _cell.clear()
    _active = (profiler, time.time_ns(), trace)


def stop(rank: int = 0) -> RankProfile | None:
    """Stop profiling; what this rank did since start() (None if it was not profiling)."""
    global _active
    if _active is None:
        return None
    (profiler, started, keep), _active = _active, None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    ended = time.time_ns()
    if len(_cell) >= 2:  # the cell ran: its own window
        started, ended = _cell[0], _cell[-1]
    collectives = comms.stop()
    with _quiet():
        profiler.__exit__(None, None, None)
    # the events themselves: torch's Chrome trace costs a JSON round trip per event
    spans, marks, device = spans_of(profiler.profiler.kineto_results.events())
    window = [Span(s.kind, s.name, max(s.start_ns, started), min(s.end_ns, ended))
              for s in spans if s.end_ns > started and s.start_ns < ended]  # the cell's only
    packed = zlib.compress(_chrome_trace(profiler), 1) if keep else b""  # ~10x smaller
    return RankProfile(rank, socket.gethostname(), boot_id(), started, ended, window,
                       collectives, device, marks, packed)


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
    # in a folder only we can enter (0700): torch writes "<path>.tmp" without O_NOFOLLOW, and
    # in /tmp another user who saw the name planted that as a link to a file of ours
    folder = tempfile.mkdtemp(prefix="meshlab-profile-")
    try:
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path, "rb") as f:
            return f.read()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def spans_of(events: list[Any]) -> tuple[list[Span], list[Span], str]:
    """Compute and copies from torch.profiler's events: GPU kernels and memcpys where there
    are any (host ops only launch them), else the outermost ops of the thread that ran the
    cell, with the collectives' own calls and waits cut out (they are communication); and
    that thread's record_function regions."""
    def span(kind: str, e: Any) -> Span:
        return Span(kind, e.name(), e.start_ns(), e.start_ns() + e.duration_ns())

    cuda = torch.autograd.DeviceType.CUDA
    gpu = [e for e in events if e.device_type() == cuda and e.duration_ns() > 0]
    here = next((e.start_thread_id() for e in events if e.name() == _HERE), None)
    mine = sorted((e for e in events if e.device_type() != cuda and e.start_thread_id() == here
                   and e.name() != _HERE), key=lambda e: e.start_ns())
    marks = [span("mark", e) for e in mine if e.is_user_annotation()]
    if gpu:
        kernels = [span("copy" if e.name().startswith(("Memcpy", "Memset")) else "compute", e)
                   for e in gpu if not e.name().lower().startswith("nccl")]
        return sorted(kernels, key=lambda s: s.start_ns), marks, "cuda"
    ops = [e for e in mine if not e.is_user_annotation()]
    outer, comm, end = [], [], -1
    for e in ops:
        if e.name().startswith(_COMM_OPS):
            comm.append(span("comm", e))
        if e.start_ns() >= end:
            outer.append(e)
            end = e.start_ns() + e.duration_ns()
    spans = [span("copy" if e.name() in COPIES else "compute", e) for e in outer
             if not e.name().startswith(_COMM_OPS)]
    return _cut(spans, comm), marks, "cpu"


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
