"""Timing loops shared by calibration, the kernel bench and the benchmarks.

Rank side (plain torch): a step loop on the wall clock (warm-up dropped, a barrier or a
synchronize around each step), ways of doing one thing timed in shuffled rounds, CUDA-event
medians, and the slowest rank's figure, so every time meshlab prints is taken the same way.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

Way = TypeVar("Way", bound=Hashable)

WINDOW_SECONDS = 0.05
"""A windowed repetition lasts at least this long (several calls), far longer than a
barrier's skew, so ranks that share cores run at the same time and slow each other."""


def step_times(step: Callable[[], object], steps: int, *, warmup: int = 0,
               before: Callable[[], object] | None = None,
               after: Callable[[], object] | None = None) -> list[float]:
    """Wall-clock seconds of each of ``steps`` calls of ``step``, after ``warmup`` calls run
    the same way and dropped. ``before`` runs untimed ahead of each call (a barrier, so the
    ranks start together); ``after`` is timed with it (a barrier or a synchronize: a step
    ends when every rank, or the GPU, is done)."""
    times = []
    for i in range(warmup + steps):
        if before is not None:
            before()
        start = time.perf_counter()
        step()
        if after is not None:
            after()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def interleaved_times(ways: Mapping[Way, Callable[[], object]], rounds: int, *,
                      warmup: int = 0) -> dict[Way, list[float]]:
    """Seconds of one call of each way per round, after ``warmup`` rounds dropped. Each round
    runs the ways in a fresh random order, so drift and queueing hit them all alike."""
    samples: dict[Way, list[float]] = {way: [] for way in ways}
    order = list(ways)
    for i in range(warmup + rounds):
        random.shuffle(order)  # no way always runs right after another
        for way in order:
            seconds = step_times(ways[way], 1)
            if i >= warmup:
                samples[way] += seconds
    return samples


def median_seconds(op: Callable[[], Any], device: torch.device, reps: int, *, inner: int = 1,
                   warmup: int = 1, before: Callable[[], Any] | None = None,
                   wall_clock: bool = False) -> float:
    """Median over ``reps`` of the mean time of ``inner`` back-to-back calls of ``op``:
    CUDA events on a GPU (unless ``wall_clock``: the host's time up to a synchronize), the
    wall clock on a CPU. ``before`` runs untimed before each rep."""
    for _ in range(warmup):
        op()
    cuda = device.type == "cuda"
    if cuda and not wall_clock:
        torch.cuda.synchronize(device)
        events = []
        for _ in range(reps):
            if before:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                op()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) / 1e3 / inner for s, e in events)

    def calls() -> None:
        for _ in range(inner):
            op()

    times = step_times(calls, reps, before=before,
                       after=(lambda: torch.cuda.synchronize(device)) if cuda else None)
    return statistics.median(t / inner for t in times)


def windowed_seconds(op: Callable[[], Any], device: torch.device, reps: int, *,
                     wall_clock: bool = False) -> float:
    """``median_seconds`` with enough calls per repetition to fill ``WINDOW_SECONDS`` on
    every rank, so that ranks sharing cores run at the same time. Every rank calls it."""
    once = median_seconds(op, device, 1, wall_clock=wall_clock)
    # the same number of calls on every rank: the most any of them needs
    (inner,) = slowest([min(1000, math.ceil(WINDOW_SECONDS / max(once, 1e-7)))], device)
    return median_seconds(op, device, reps, inner=int(inner), warmup=0, before=dist.barrier,
                          wall_clock=wall_clock)


def slowest(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks (one collective for the lot)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()
