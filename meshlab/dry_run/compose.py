"""A pipeline rank's step composed from a shorter one, for a dry run (meshlab.dry_run.run).

A stage's micro-batches run the same program: the forward of micro-batch 5 allocates what
the forward of micro-batch 2 did, and its backward frees it again. What differs is the
first of each (FSDP gathers a stage's parameters, the gradients are allocated), the second
(the first to add into them) and the last (gradients reduced), and the order a schedule
interleaves them in, which decides how many are in flight. So a rank runs a probe step of a
few micro-batches (``probe_schedule``: the fewest that hold a first, a second, a middle and
a last one) under the memory tracker, which records each action's memory (``Window``:
where it started, its own peak, where it ended, by category) and its collectives;
``compose`` then walks the real schedule's actions for this rank, each taking the memory
and collectives its kind took in the probe. The peak, each category's peak and the bytes
per axis come out as the whole step gives them (``tests/rank/test_dryrun.py`` holds the two
equal), for a fraction of the work.

Plain torch, rank side.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

TOTAL = "Total"  # torch's tracker's key for a device's total

PROBE_LEAST = 4
"""A first, a second, a middle and a last micro-batch: the second differs from the rest
too (its backward is the first to add into gradients that are there)."""


def probe_schedule(schedule: str, microbatches: int, one_stage_each: bool,
                   builds: Callable[[str, int], bool]) -> tuple[str, int] | None:
    """The probe step: the fewest micro-batches (at least ``PROBE_LEAST``) the schedule
    ``builds`` with, when fewer than ``microbatches``, or GPipe with ``PROBE_LEAST`` where
    each rank holds one stage and the schedule needs more (1F1B takes no fewer than the pp
    ranks: an action's memory is its own, whatever order the schedule runs them in); None
    when the step is as short already."""
    own = next((m for m in range(PROBE_LEAST, microbatches) if builds(schedule, m)), None)
    if own is not None and (own == PROBE_LEAST or not one_stage_each):
        return schedule, own
    if one_stage_each and microbatches > PROBE_LEAST and builds("gpipe", PROBE_LEAST):
        return "gpipe", PROBE_LEAST
    return (schedule, own) if own is not None else None


def phase(microbatch: int, microbatches: int) -> str:
    if microbatch == microbatches - 1:
        return "last"
    return {0: "first", 1: "second"}.get(microbatch, "middle")


def flat(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """The tracker's categories on every device, by name (its total included)."""
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = str(getattr(key, "value", key))
            out[name] = out.get(name, 0) + value
    return out


@dataclass
class Window:
    """One action's memory as the tracker saw it: its start, its own peak of the total
    (the categories then), each group's own peak, its end."""

    start: dict[str, int]
    groups: dict[str, str]
    top: dict[str, int] = field(default_factory=dict)
    group_top: dict[str, int] = field(default_factory=dict)
    end: dict[str, int] = field(default_factory=dict)
    records: list[Any] = field(default_factory=list)
    """The collectives issued in it."""
    first: int = 0
    """Where its collectives begin in the tracer's records."""

    def __post_init__(self) -> None:
        self.top = dict(self.start)
        self.group_top = grouped(self.start, self.groups)

    def see_groups(self, summed: dict[str, int]) -> None:
        """The groups' values now (the tracker sums them on every update)."""
        for group, value in summed.items():
            if value > self.group_top.get(group, 0):
                self.group_top[group] = value

    def see_op(self, snapshot: dict[Any, dict[Any, int]]) -> None:
        # the categories only when the total is a new peak (an op is a few thousand)
        total = sum(per_device.get(TOTAL, 0) for per_device in snapshot.values())
        if total > self.top.get(TOTAL, 0):
            self.top = flat(snapshot)


def grouped(categories: dict[str, int], groups: dict[str, str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, value in categories.items():
        group = groups.get(name)
        if group is not None:
            out[group] = out.get(group, 0) + value
    return out


class Recorder:
    """The windows of a probe step, as a memory tracker (meshlab.dry_run.fake_world's) and a
    CommTracer see it: ``before`` the first action, the first action of each kind (kind,
    stage, phase), and ``after`` the last (the step's end, the optimizer)."""

    def __init__(self, tracker: Any, tracer: Any, microbatches: int) -> None:
        self.tracker, self.tracer, self.microbatches = tracker, tracer, microbatches
        self.kinds: dict[tuple[str, int, str], Window] = {}
        self.before = self.after = self._open()

    def wrap(self, perform: Callable[[Any], None]) -> Callable[[Any], None]:
        """``perform(action)`` (an executor's), each action in a window of its own."""
        def recorded(action: Any) -> None:
            self._close(self.after)  # before the first action, or between two
            window = self._open()
            perform(action)
            self._close(window)
            key = (action.kind, action.stage, phase(action.microbatch, self.microbatches))
            self.kinds.setdefault(key, window)
            self.after = self._open()

        return recorded

    def finish(self) -> None:
        """Once the tracker is done: the last window ends where the step did."""
        self._close(self.after)

    def _open(self) -> Window:
        window = Window(start=flat(self.tracker._curr_mem_snap), groups=self.tracker.groups)
        window.first = len(self.tracer.records)
        self.tracker.window = window
        return window

    def _close(self, window: Window) -> None:
        window.end = flat(self.tracker._curr_mem_snap)
        window.records = self.tracer.records[window.first:]
        self.tracker.window = None


@dataclass
class Composed:
    """The composed step: its peak's categories, each group's own peak, and the
    collectives its actions issued."""

    peak: dict[str, int]
    group_peaks: dict[str, int]
    records: list[Any]


def compose(probe: dict[tuple[str, int, str], Window], before: Window, after: Window,
            actions: list[Any], microbatches: int) -> Composed:
    """The step of ``actions`` (this rank's, of the real schedule with ``microbatches``):
    ``before`` (from the tracker's start to the first action), each action as its kind
    (kind, stage, phase) ran in the probe, then ``after`` (the step's end and the
    optimizer), each moved to where the step has got to."""
    peak, groups = dict(before.top), dict(before.group_top)
    records = list(before.records)
    windows = [probe[(a.kind, a.stage, phase(a.microbatch, microbatches))] for a in actions]
    level = dict(before.end)
    for window in [*windows, after]:
        top = _moved(window.top, window.start, level)
        if top.get(TOTAL, 0) > peak.get(TOTAL, 0):
            peak = top
        at = grouped(level, before.groups)
        for group, value in window.group_top.items():
            moved = at.get(group, 0) + value - grouped(window.start, before.groups).get(group, 0)
            groups[group] = max(groups.get(group, 0), moved)
        records += window.records
        level = _moved(window.end, window.start, level)
    return Composed(peak=peak, group_peaks=groups, records=records)


def _moved(values: dict[str, int], start: dict[str, int], level: dict[str, int]
           ) -> dict[str, int]:
    """``values`` (seen from ``start``) seen from ``level`` instead."""
    names = set(values) | set(start) | set(level)
    return {n: level.get(n, 0) + values.get(n, 0) - start.get(n, 0) for n in names}
