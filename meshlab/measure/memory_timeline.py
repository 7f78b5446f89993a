"""One rank's memory over a cell: torch's MemTracker, by category and module, as a timeline.

For ``%%mesh --memory``: the cluster calls start() before the cell and stop() after it, both
on the main thread where the cell runs. Every change of the tracker's categories is kept as a
point (bytes by category, the innermost module running, the phase); the same changes, as
allocations and frees, make a snapshot that pytorch.org/memory_viz opens (the format of
``torch.cuda.memory._snapshot()``, as torch's own ``_profile_to_snapshot`` writes one for a
CPU profile). On a GPU the CUDA allocator's own history is recorded as well
(``torch.cuda.memory._record_memory_history``) and is the snapshot written.

Plain torch: rank side.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker, _UpdateType
from torch.distributed.fsdp import FSDPModule

from meshlab.measure.tracked_gradients import GradientsInGrad

# torch's categories (MemTracker's and FSDPMemTracker's) as the chart groups them
CATEGORIES = {
    "Parameter": "parameters", "Sharded Param": "parameters", "Unsharded Param": "parameters",
    "Buffer": "buffers",
    "Gradient": "gradients", "Sharded Grad": "gradients", "Unsharded Grad": "gradients",
    "Optstate": "optimizer states", "OptState": "optimizer states",
    "Activation": "activations", "Inputs": "activations",
    "Temp": "temporaries", "All Gather": "temporaries", "Reduce Scatter": "temporaries",
    "Other": "other",
}
ORDER = ("parameters", "buffers", "gradients", "optimizer states", "activations",
         "temporaries", "other")
MAX_POINTS = 20_000  # a long cell keeps every change up to here, then every other one
HISTORY_ENTRIES = 100_000  # the CUDA allocator's history, as torchtitan keeps it


@dataclass(slots=True)
class MemoryPoint:
    """Bytes by category just after one change, and what was running."""

    ns: int  # since the cell's start
    bytes: dict[str, int]
    module: str  # the innermost module running ("" outside every module)
    phase: str  # "forward", "backward", "optimizer" or "" (between them)


@dataclass(slots=True)
class MemoryTimeline:
    """One rank's memory over a cell."""

    rank: int
    device: str
    points: list[MemoryPoint]
    snapshot: dict[str, Any] = field(repr=False)  # memory_viz's format

    @property
    def peak(self) -> MemoryPoint | None:
        """The point of most bytes (the first, if several)."""
        return max(self.points, key=lambda p: sum(p.bytes.values()), default=None)

    def save(self, folder: str | Path) -> Path:
        """Write the snapshot as ``rank<N>.pickle`` in ``folder``: pytorch.org/memory_viz
        opens it (drag it onto the page)."""
        path = Path(folder) / f"rank{self.rank}.pickle"
        with open(path, "wb") as f:
            pickle.dump(self.snapshot, f)
        return path


class _Timeline:
    """Mixed into torch's trackers: each change of a category is kept."""

    _curr_mem_snap: dict[torch.device, dict[Any, int]]
    _mod_tracker: Any
    _in_opt: bool

    points: list[MemoryPoint]
    events: list[dict[str, Any]]
    _started: int

    def _start_timeline(self) -> None:
        self.points = []
        self.events = []  # memory_viz's device trace
        self._started = time.perf_counter_ns()
        self._step = 1  # keep every self._step-th point once MAX_POINTS is reached
        self._seen = 0

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                     old_reftype: Any = None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)  # type: ignore[misc]
        module, phase = self._running()
        category = CATEGORIES.get(winfo.reftype.value, "other")
        frames = [{"filename": module or "(no module)", "line": 0, "name": category}]
        now_us = (time.perf_counter_ns() - self._started) // 1000
        gone = {_UpdateType.DEL: winfo.mem_consumed,
                _UpdateType.SIZE: old_mem_consumed, _UpdateType.REF: winfo.mem_consumed}
        if u_type in gone:
            for action in ("free_requested", "free_completed"):
                self.events.append({"action": action, "addr": id(winfo), "size": gone[u_type],
                                    "stream": 0, "time_us": now_us, "frames": frames})
        if u_type != _UpdateType.DEL:
            self.events.append({"action": "alloc", "addr": id(winfo), "size":
                                winfo.mem_consumed, "stream": 0, "time_us": now_us,
                                "frames": frames, "category": category})
        self._seen += 1
        if self._seen % self._step == 0:
            self.record(module, phase, now_us * 1000)

    def record(self, module: str, phase: str, ns: int) -> None:
        """A point: the bytes by category now."""
        totals = dict.fromkeys(ORDER, 0)
        for snapshot in self._curr_mem_snap.values():
            for key, value in snapshot.items():
                name = CATEGORIES.get(getattr(key, "value", key))
                if name is not None:
                    totals[name] += value
        self.points.append(MemoryPoint(ns, totals, module, phase))
        if len(self.points) >= MAX_POINTS:  # thin out: every other point, and half as often
            self.points, self._step = self.points[::2], self._step * 2

    def _running(self) -> tuple[str, str]:
        parents = [p for p in self._mod_tracker.parents if p != "Global"]
        module = max(parents, key=lambda p: p.count("."), default="")
        phase = ("optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw
                 else "forward" if parents else "")
        return module, phase


class Tracker(_Timeline, GradientsInGrad, MemTracker):
    """torch's MemTracker over the namespace's models and optimizers."""

    def __init__(self, modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]
                 ) -> None:
        super().__init__()
        self._start_timeline()
        self.track_external(*modules, *optimizers)
        self.watch_gradients([p for m in modules for p in m.parameters() if p.requires_grad])


class FSDPTracker(_Timeline, FSDPMemTracker):
    """torch's FSDP2 tracker, for a namespace whose model is one FSDP2 root."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        super().__init__(module, optimizer)
        self._start_timeline()


_active: tuple[Tracker | FSDPTracker, str] | None = None  # the tracker, and the device it watches


def start(namespace: dict[str, Any]) -> str:
    """Track memory from now on this thread, for the models and optimizers ``namespace``
    holds; what is tracked, in words."""
    global _active
    stop_tracking()
    modules = _roots([v for v in namespace.values() if isinstance(v, nn.Module)])
    optimizers = [v for v in namespace.values() if isinstance(v, torch.optim.Optimizer)]
    device = next((str(p.device.type) for m in modules for p in m.parameters()), "cpu")
    if device == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
    fsdp = [m for m in modules if isinstance(m, FSDPModule)]
    tracker: Tracker | FSDPTracker
    if len(fsdp) == 1 and len(modules) == 1 and len(optimizers) <= 1:
        tracker = FSDPTracker(fsdp[0], optimizers[0] if optimizers else None)
    else:
        tracker = Tracker(modules, optimizers)
    tracker.__enter__()
    # what the names held before the cell, as one point at its start (not one per tensor)
    tracker.points = []
    tracker.record("", "", 0)
    _active = tracker, device
    return f"{len(modules)} model(s), {len(optimizers)} optimizer(s)"


def stop(rank: int) -> MemoryTimeline | None:
    """The timeline since start() (None if nothing was tracked); ends the tracking."""
    global _active
    if _active is None:
        return None
    tracker, device = _active
    _active = None
    tracker.__exit__(None, None, None)
    # the end as it is, whatever thinning left out
    tracker.record("", "", time.perf_counter_ns() - tracker._started)
    snapshot: dict[str, Any] = {"segments": [], "device_traces": [tracker.events]}
    if device == "cuda":  # the allocator's own history: what memory_viz is made for
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    return MemoryTimeline(rank, device, tracker.points, snapshot)


def stop_tracking() -> None:
    """End a tracking left on (a cell stopped before stop() ran)."""
    global _active
    if _active is not None:
        _active[0].__exit__(None, None, None)
        _active = None


def _roots(modules: list[nn.Module]) -> list[nn.Module]:
    """The modules that are no other's submodule (a model, not also its layers)."""
    inner = {id(sub) for m in modules for sub in m.modules() if sub is not m}
    seen: set[int] = set()
    roots = []
    for m in modules:
        if id(m) not in inner and id(m) not in seen:
            seen.add(id(m))
            roots.append(m)
    return roots

