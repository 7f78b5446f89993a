"""Every collective timed on each mesh axis over a sweep of sizes, and its alpha-beta fit.

Each axis's groups run at once, and the world group runs too; the times are fitted to the
planner's model t = alpha + beta * bytes (``meshlab.plan.formulas.collective_seconds``).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from meshlab.measure.timing import median_seconds, slowest
from meshlab.plan.formulas import COLLECTIVES, bus_factor, ring_steps
from meshlab.plan.hardware import Link

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

KIB, MIB = 2**10, 2**20
# Collective message sizes (bytes; the planner's nbytes). A CPU sweep stays cheap on gloo; a
# GPU one reaches the sizes where NCCL runs at full bus bandwidth.
SIZES = {"cpu": (4 * KIB, 32 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB),
         "cuda": (64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB)}
QUICK_SIZES = {"cpu": (4 * KIB, 64 * KIB, MIB, 4 * MIB), "cuda": (64 * KIB, 4 * MIB, 64 * MIB)}
# Messages below this size run this many times back to back per repetition: the barrier's
# skew between ranks is then shared among several calls instead of landing on one.
BATCH = {"cpu": (MIB, 4), "cuda": (16 * MIB, 10)}


@dataclass(slots=True)
class CollectiveFit:
    """One collective on one mesh axis: the measured points and their alpha-beta fit."""

    axis: str
    """A mesh axis name, or "world"."""
    ranks: int
    """Ranks in each group of the axis."""
    groups: list[list[int]]
    collective: str
    nbytes: list[int]
    """The planner's bytes per point: the full buffer (all_reduce, all_gather's output,
    reduce_scatter's input), what one rank holds (all_to_all), the message (send_recv)."""
    seconds: list[float]
    """Median over repetitions on the slowest rank; send_recv is half a ping-pong."""
    alpha_s: float
    beta_s_per_byte: float
    residual: float
    """Root-mean-square relative error of the fit over the points."""
    note: str = ""

    @property
    def latency_us(self) -> float:
        """alpha per ring step: the Link convention."""
        return self.alpha_s / max(1, ring_steps(self.collective, self.ranks)) * 1e6

    @property
    def bandwidth_gbs(self) -> float:
        """Bus bandwidth, GB/s: bytes one rank's link carries per second."""
        return bus_factor(self.collective, self.ranks) / self.beta_s_per_byte / 1e9

    def link(self) -> Link:
        return Link(bandwidth_gbs=self.bandwidth_gbs, latency_us=self.latency_us)

    def fitted(self) -> list[float]:
        """The fit's seconds at each measured size (to plot beside ``seconds``)."""
        return [self.alpha_s + self.beta_s_per_byte * b for b in self.nbytes]


# -- the fit -----------------------------------------------------------------------------------


def fit_alpha_beta(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float, float]:
    """(alpha s, beta s/byte, rms relative residual) of t = alpha + beta*bytes, both >= 0.

    Weighted by 1/t^2, so each point counts by its relative error: the small messages fix
    the latency and the large ones the bandwidth, where plain least squares would let the
    largest message decide both.
    """
    if len(nbytes) != len(seconds) or len(set(nbytes)) < 2:
        raise ValueError(f"fitting needs at least two distinct sizes, got {list(nbytes)}")
    if min(seconds) <= 0:
        raise ValueError(f"times must be positive, got {list(seconds)}")
    scale = max(nbytes)  # bytes in units of the largest: the sums stay well conditioned
    xs = [x / scale for x in nbytes]
    w = [1 / t**2 for t in seconds]
    sw = sum(w)
    sx = sum(wi * x for wi, x in zip(w, xs, strict=True))
    sy = sum(wi * y for wi, y in zip(w, seconds, strict=True))
    sxx = sum(wi * x * x for wi, x in zip(w, xs, strict=True))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, seconds, strict=True))

    def cost(a: float, b: float) -> float:
        return sum(wi * (a + b * x - y) ** 2 for wi, x, y in zip(w, xs, seconds, strict=True))

    # The non-negative optimum is the free one, or lies on the a = 0 or b = 0 edge.
    det = sw * sxx - sx * sx
    candidates = [(0.0, sxy / sxx), (sy / sw, 0.0)]
    if det > 0:
        candidates.append(((sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det))
    a, b = min(((a, b) for a, b in candidates if a >= 0 and b >= 0), key=lambda p: cost(*p))
    b /= scale
    residual = math.sqrt(sum(((a + b * x - y) / y) ** 2 for x, y in zip(nbytes, seconds,
                                                                          strict=True))
                         / len(seconds))
    return a, b, residual


def fit_collective(axis: str, n: int, groups: list[list[int]], collective: str,
                   nbytes: list[int], seconds: list[float]) -> CollectiveFit:
    """The fit of one collective's measured points on one axis (groups of ``n`` ranks)."""
    a, b, residual = fit_alpha_beta(nbytes, seconds)
    note = ""
    if b <= 0:  # flat in size: the bandwidth is beyond what the sweep resolves
        b = max(residual * statistics.mean(seconds), 1e-9) / max(nbytes)
        note = f"time did not grow with size up to {max(nbytes)} bytes: bandwidth is a floor"
    return CollectiveFit(axis=axis, ranks=n, groups=groups, collective=collective,
                         nbytes=nbytes, seconds=seconds, alpha_s=a, beta_s_per_byte=b,
                         residual=residual, note=note)


def parse_sizes(text: str) -> list[int]:
    """``"4K,64K,1M"`` (bytes; K, M, G are powers of 1024) -> sorted distinct sizes."""
    sizes = set()
    for item in filter(None, re.split(r"[\s,]+", text.strip())):
        m = re.fullmatch(r"(\d+)([KMG]?)(i?B)?", item, re.IGNORECASE)
        if not m or int(m[1]) == 0:
            raise ValueError(f"size {item!r}: give bytes like 4096, 64K or 4M")
        sizes.add(int(m[1]) * 1024 ** " KMG".index((m[2] or " ").upper()))
    if len(sizes) < 2:
        raise ValueError(f"sizes {text!r}: give at least two distinct message sizes to fit "
                         "latency and bandwidth, e.g. 4K,64K,1M,4M")
    return sorted(sizes)


# -- timing ------------------------------------------------------------------------------------


def _collective(collective: str, nbytes: int, group: Any, groups: list[list[int]],
                device: torch.device) -> tuple[Callable[[], Any], int, float]:
    """(op, the planner's nbytes, factor from the op's time to the collective's time)."""
    me = dist.get_rank()
    members = next(g for g in groups if me in g)
    n = len(members)
    elems = max(n, nbytes // 4 // n * n)  # float32, divisible among the group
    full = torch.zeros(elems, device=device)
    part = torch.zeros(elems // n, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    if collective == "all_reduce":
        return (lambda: dist.all_reduce(full, group=group)), elems * 4, 1.0
    if collective == "all_gather":
        return (lambda: gather(full, part, group=group)), elems * 4, 1.0
    if collective == "reduce_scatter":
        return (lambda: scatter(part, full, group=group)), elems * 4, 1.0
    if collective == "all_to_all":
        out = torch.empty_like(full)
        return (lambda: dist.all_to_all_single(out, full, group=group)), elems * 4, 1.0
    # send_recv: neighbours along the axis pair up (0-1, 2-3, ...) and ping-pong; one
    # message is half the round trip. An odd one out waits at the barriers only.
    i = members.index(me)
    partner = members[i ^ 1] if (i ^ 1) < n else None

    def ping_pong() -> None:
        if partner is None:
            return
        first, second = (dist.send, dist.recv) if i % 2 == 0 else (dist.recv, dist.send)
        first(full, partner)
        second(full, partner)

    return ping_pong, elems * 4, 0.5


def _axes(mesh: DeviceMesh | None) -> list[tuple[str, Any, list[list[int]]]]:
    """(name, process group, every group's global ranks) for the world and each mesh axis."""
    world = list(range(dist.get_world_size()))
    out: list[tuple[str, Any, list[list[int]]]] = [("world", dist.group.WORLD, [world])]
    if mesh is None:
        return out
    for i, name in enumerate(mesh.mesh_dim_names or ()):
        size = mesh.mesh.shape[i]
        if size > 1:
            groups = mesh.mesh.movedim(i, -1).reshape(-1, size).tolist()
            out.append((name, mesh.get_group(name), sorted(groups)))
    return out


def time_collectives(mesh: DeviceMesh | None, sizes: Sequence[int], device: torch.device, reps: int
                     ) -> list[CollectiveFit]:
    """Every collective at every size on the world and each axis of ``mesh`` (a DeviceMesh
    or None), fitted; every rank calls it."""
    plan, medians = [], []
    below, batch = BATCH[device.type if device.type == "cuda" else "cpu"]
    for axis, group, groups in _axes(mesh):
        n = len(groups[0])
        if n < 2:
            continue
        for collective in COLLECTIVES:
            measured = []
            for size in sizes:
                op, nbytes, factor = _collective(collective, size, group, groups, device)
                measured.append(nbytes)
                inner = batch if size < below else 1
                # a world barrier before each repetition: ranks start it together, and no
                # group's collective overlaps another axis's previous one
                medians.append(factor * median_seconds(op, device, reps, inner=inner,
                                                       before=dist.barrier))
            plan.append((axis, n, groups, collective, measured))
    maxima = iter(slowest(medians, device))
    return [fit_collective(axis, n, groups, c, nbytes, [next(maxima) for _ in nbytes])
            for axis, n, groups, c, nbytes in plan]
