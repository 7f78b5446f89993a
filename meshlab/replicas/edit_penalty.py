"""EDiT's pseudo-gradient penalty, per block and replica, as the authors' released code
computes it (dlrover atorch ``local_sgd``: OnlineDynamicEWMA, the softmax-of-negative-norm
reducer, ``clip_pseudo_grad``): anomaly elimination against each replica's running
statistics, weighted averaging, clipping. Plain arithmetic on norms: meshlab.replicas.edit
applies it to the blocks' pseudo-gradients, meshlab.replicas.edit_replay in one process.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class Penalty:
    """EDiT's pseudo-gradient penalty; the defaults are the authors' released code's."""

    alpha: float = 0.02
    """α: weight of a new norm in the running (EMA) mean and variance."""
    threshold: float = 3.0
    """δ: a replica whose norm's z-score exceeds it is left out of the sync."""
    warmup: int = 120
    """Syncs of a block a replica's statistics gather before its z-test runs."""
    temperature: float = 1.0
    """T: the weights are softmax(-G / T) over the replicas kept."""
    clip: float | None = None
    """φ: each block's averaged pseudo-gradient is clipped to this norm (None: never)."""


@dataclass(slots=True)
class Running:
    """One replica's detector on one block, as the authors' released code keeps it (atorch's
    OnlineDynamicEWMA): the EMA mean (from 0) and variance of its pseudo-gradient norms, and
    the z-scores of the last ``warmup`` norms it took in."""

    mean: float = 0.0
    var: float = 0.0
    count: int = 0
    recent: deque[float] = field(default_factory=deque)

    def z(self, norm: float, penalty: Penalty) -> float:
        """``norm``'s z-score: 0 during the warm-up or with no spread yet."""
        std = math.sqrt(self.var) if self.count >= 2 else 0.0
        return 0.0 if std == 0 or self.count < penalty.warmup else (norm - self.mean) / std

    def anomalous(self, norm: float, penalty: Penalty) -> bool:
        """Not finite, or (warmed up) a z-score above δ times the spread of the recent
        z-scores (at least 1: the dynamic threshold)."""
        if not math.isfinite(norm):
            return True
        if self.count < penalty.warmup:
            return False
        spread = statistics.stdev(self.recent) if len(self.recent) > 1 else 0.0
        return self.z(norm, penalty) > penalty.threshold * max(1.0, spread)

    def add(self, norm: float, penalty: Penalty) -> None:
        """Take ``norm`` into the statistics (Welford's update on the EMA), then its z-score
        into the recent ones."""
        self.count += 1
        d = norm - self.mean
        self.mean += penalty.alpha * d
        self.var = (1 - penalty.alpha) * (self.var + penalty.alpha * d * (norm - self.mean))
        self.recent.append(self.z(norm, penalty))
        while len(self.recent) > penalty.warmup:
            self.recent.popleft()


def weigh(norms: Sequence[float], running: Sequence[Running], penalty: Penalty) -> list[float]:
    """Each replica's weight: 0 for an anomaly, else softmax(-G / T) over the others (all 0:
    every one left out); the kept norms join the statistics."""
    kept = [not r.anomalous(g, penalty) for g, r in zip(norms, running, strict=True)]
    for g, r, keep in zip(norms, running, kept, strict=True):
        if keep:
            r.add(g, penalty)
    if not any(kept):
        return [0.0] * len(norms)
    low = min(g for g, keep in zip(norms, kept, strict=True) if keep)  # exp() cannot overflow
    e = [math.exp((low - g) / penalty.temperature) if keep else 0.0
         for g, keep in zip(norms, kept, strict=True)]
    return [x / sum(e) for x in e]


def clip_coefficient(norm: float, penalty: Penalty | None) -> float:
    """What the averaged pseudo-gradient is multiplied by: min(1, φ / (||Δ|| + 1e-6))."""
    if penalty is None or penalty.clip is None:
        return 1.0
    return min(1.0, penalty.clip / (norm + 1e-6))
