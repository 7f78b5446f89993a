"""Measure on the live ranks what the planner assumes, and write it as a hardware profile.

Every rank calls ``calibrate(mesh)`` at once. Matmuls and a large copy run on all ranks
together, so ranks that share cores or a memory bus slow each other as they do in training.
Then each collective is timed on every mesh axis (all of its groups at once) and on the whole
world over a sweep of message sizes, and fitted to the planner's alpha-beta model
(``meshlab.plan.formulas.collective_seconds``). ``Calibration.profile(name)`` is the
``meshlab.plan.hardware.Hardware`` the planner reads. Plain torch, so it runs under torchrun:

$ torchrun --standalone --nproc_per_node=4 -m meshlab.calibrate --mesh "dp=2 tp=2" -o cpu.toml
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import re
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshlab.calibrate.host_costs import LAYERS, layer_seconds, tiny_shape, wrapper_layouts
from meshlab.plan.estimate import estimate
from meshlab.plan.formulas import COLLECTIVES, bus_factor, ring_steps
from meshlab.plan.hardware import GIB, Hardware, Link, save
from meshlab.plan.layout import Layout

KIB, MIB = 2**10, 2**20
# Collective message sizes (bytes; the planner's nbytes). A CPU sweep stays cheap on gloo; a
# GPU one reaches the sizes where NCCL runs at full bus bandwidth.
SIZES = {"cpu": (4 * KIB, 32 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB),
         "cuda": (64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB)}
QUICK_SIZES = {"cpu": (4 * KIB, 64 * KIB, MIB, 4 * MIB), "cuda": (64 * KIB, 4 * MIB, 64 * MIB)}
# (m, n, k): squares and a tall-skinny one (tokens x hidden). The profile takes the largest.
MATMULS = {"cpu": ((256, 256, 256), (512, 512, 512), (2048, 256, 1024), (1024, 1024, 1024)),
           "cuda": ((2048, 2048, 2048), (4096, 4096, 4096), (16384, 2048, 8192),
                    (8192, 8192, 8192))}
QUICK_MATMULS = {"cpu": ((512, 512, 512), (1024, 1024, 1024)),
                 "cuda": ((4096, 4096, 4096), (8192, 8192, 8192))}
COPY_BYTES = {"cpu": 64 * MIB, "cuda": GIB}
REPS = {"cpu": 5, "cuda": 20}  # timed repetitions per point (the median is kept)
QUICK_REPS = {"cpu": 3, "cuda": 10}
# Messages below this size run this many times back to back per repetition: the barrier's
# skew between ranks is then shared among several calls instead of landing on one.
BATCH = {"cpu": (MIB, 4), "cuda": (16 * MIB, 10)}
# A CPU matmul's or a tiny layer's repetition lasts at least this long (several calls), far
# longer than the barrier's skew, so the ranks run at the same time and shared cores show.
WINDOW_SECONDS = 0.05


@dataclass(slots=True)
class MatmulPoint:
    """One (m, n, k) matmul in one dtype, timed on every rank at once."""

    dtype: str
    m: int
    n: int
    k: int
    seconds: float
    """Median over repetitions, on the slowest rank."""
    tflops: float
    """Achieved: 2mnk / seconds."""


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


@dataclass(slots=True)
class Calibration:
    """Everything ``calibrate`` measured; the same on every rank."""

    device: str
    """"cpu" or "cuda"."""
    device_name: str
    world_size: int
    hosts: dict[str, list[int]]
    """Host name -> its ranks."""
    mesh: str
    """The mesh's axes as "dp_shard=2 tp=2", or "" when only the world group was timed."""
    timer: str
    memory_gib: float
    """Memory per rank: the device's, or a CPU host's total shared by its ranks (smallest)."""
    reserved_gib: float
    """GPU memory already taken outside torch's allocator (CUDA context, NCCL buffers)."""
    memory_bandwidth_gbs: float
    """A large copy, read + write bytes per second, on the slowest rank."""
    layer_seconds: dict[str, float]
    """Forward + backward seconds per layer of a tiny model, plain and under each wrapper
    (fsdp, tp), on the slowest rank (``meshlab.calibrate.host_costs``)."""
    matmul: list[MatmulPoint]
    tflops: dict[str, float]
    """Achieved TFLOP/s per dtype at the largest matmul."""
    collectives: list[CollectiveFit]
    intra_axis: str | None
    """Axis whose fits became the profile's intra link and collectives."""
    inter_axis: str | None
    """Axis whose all_reduce became the inter link (None: no group spans hosts)."""
    seconds: float
    """How long the calibration took."""
    notes: list[str] = field(default_factory=list)

    def fit(self, axis: str, collective: str) -> CollectiveFit:
        """The fit of ``collective`` on ``axis``."""
        for f in self.collectives:
            if f.axis == axis and f.collective == collective:
                return f
        axes = sorted({f.axis for f in self.collectives})
        raise KeyError(f"no {collective} measured on {axis!r}; measured axes: {axes}")

    @property
    def gpus_per_node(self) -> int:
        return max(len(r) for r in self.hosts.values())

    def profile(self, name: str) -> Hardware:
        """The planner's hardware profile: achieved numbers, so matmul_efficiency is 1."""
        if self.intra_axis is None and self.inter_axis is None:
            raise ValueError(f"no collective was timed on {self.world_size} rank(s): calibrate "
                             "a cluster of at least 2 ranks")
        inter = self.fit(self.inter_axis or str(self.intra_axis), "all_reduce").link()
        intra_axis = self.intra_axis or str(self.inter_axis)
        collectives = {f.collective: f.link() for f in self.collectives if f.axis == intra_axis}
        hw = Hardware(name=name, tflops=dict(self.tflops), matmul_efficiency=1.0,
                      memory_gib=self.memory_gib, reserved_gib=self.reserved_gib,
                      memory_bandwidth_gbs=self.memory_bandwidth_gbs,
                      # a GPU computes while its host queues work and NCCL runs beside it;
                      # CPU ranks share their cores among dispatch, gloo and the math
                      asynchronous=self.device == "cuda",
                      gpus_per_node=self.gpus_per_node, intra=collectives["all_reduce"],
                      inter=inter, collectives=collectives)
        return self._with_host_costs(hw)

    def _with_host_costs(self, hw: Hardware) -> Hardware:
        """Each host cost is what the tiny model's measured time per layer leaves over once
        the planner has counted everything else it knows (math, memory, collectives, and for
        a wrapper the plain layer's host time): in the planner's own terms by construction."""
        layouts = wrapper_layouts(self.world_size)
        for wrapper, overhead in (("plain", "layer_overhead_us"), ("fsdp", "fsdp_overhead_us"),
                                  ("tp", "tp_overhead_us")):
            if wrapper not in self.layer_seconds:
                continue
            layout = Layout.parse(layouts[wrapper][2], precision="fp32")
            times = []
            for layers in LAYERS:
                e = estimate(tiny_shape(layers), layout, hw)
                times.append(e.step_s - e.optimizer_s)  # the measured steps have no optimizer
            predicted = (times[1] - times[0]) / (LAYERS[1] - LAYERS[0])
            left = max(0.0, self.layer_seconds[wrapper] - predicted)
            changes: dict[str, Any] = {overhead: left * 1e6}
            hw = dataclasses.replace(hw, **changes)
        return hw


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


def _fit(axis: str, n: int, groups: list[list[int]], collective: str, nbytes: list[int],
         seconds: list[float]) -> CollectiveFit:
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


def _median_seconds(op: Callable[[], Any], device: torch.device, reps: int, *, inner: int = 1,
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
    times = []
    for _ in range(reps):
        if before:
            before()
        started = time.perf_counter()
        for _ in range(inner):
            op()
        if cuda:
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) / inner)
    return statistics.median(times)


def _windowed_seconds(op: Callable[[], Any], device: torch.device, reps: int, *,
                      wall_clock: bool = False) -> float:
    """``_median_seconds`` with enough calls per repetition to fill ``WINDOW_SECONDS`` on
    every rank, so that ranks sharing cores run at the same time."""
    once = _median_seconds(op, device, 1, wall_clock=wall_clock)
    # the same number of calls on every rank: the most any of them needs
    (inner,) = _slowest([min(1000, math.ceil(WINDOW_SECONDS / max(once, 1e-7)))], device)
    return _median_seconds(op, device, reps, inner=int(inner), warmup=0, before=dist.barrier,
                           wall_clock=wall_clock)


def _slowest(values: list[float], device: torch.device) -> list[float]:
    """Each value's maximum over the ranks (one collective for the lot)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


# -- matmul and memory -------------------------------------------------------------------------


def dtypes_for(device: torch.device) -> list[str]:
    """Compute dtypes this device runs matmuls in (fp8 from compute capability 8.9)."""
    if device.type != "cuda":
        return ["fp32", "bf16"]
    return ["fp32", "tf32", "bf16", *(["fp8"] if _fp8_runs(device) else [])]


def _fp8_runs(device: torch.device) -> bool:
    """Whether torch._scaled_mm runs here (Hopper and Ada GPUs, a recent enough torch)."""
    if not hasattr(torch, "float8_e4m3fn") or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        _matmul("fp8", 16, 16, 16, device)()
        return True
    except (RuntimeError, TypeError):
        return False


def _matmul(dtype: str, m: int, n: int, k: int, device: torch.device) -> Callable[[], Any]:
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    if dtype == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
    if dtype == "fp8":
        # _scaled_mm wants the second operand column-major: the transpose of an (n, k) tensor
        a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                        out_dtype=torch.bfloat16)
    return lambda: torch.mm(a, b)


def _time_matmuls(shapes: Sequence[tuple[int, int, int]], dtypes: Sequence[str],
                  device: torch.device, reps: int) -> list[MatmulPoint]:
    before = torch.get_float32_matmul_precision()
    points, seconds = [], []
    try:
        for dtype in dtypes:
            # fp32 means IEEE fp32; tf32 is fp32 storage with TF32 tensor-core math
            torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
            for m, n, k in shapes:
                op = _matmul(dtype, m, n, k, device)
                dist.barrier()  # every rank multiplies at once: shared cores show
                points.append((dtype, m, n, k))
                if device.type == "cuda":
                    seconds.append(_median_seconds(op, device, reps, warmup=3))
                    continue
                seconds.append(_windowed_seconds(op, device, reps))
    finally:
        torch.set_float32_matmul_precision(before)
    return [MatmulPoint(dtype=d, m=m, n=n, k=k, seconds=s, tflops=2 * m * n * k / s / 1e12)
            for (d, m, n, k), s in zip(points, _slowest(seconds, device), strict=True)]


def _copy_seconds(nbytes: int, device: torch.device, reps: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return _median_seconds(lambda: dst.copy_(src), device, reps, before=dist.barrier)


# -- collectives -------------------------------------------------------------------------------


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


def _axes(mesh: Any) -> list[tuple[str, Any, list[list[int]]]]:
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


def _time_collectives(mesh: Any, sizes: Sequence[int], device: torch.device, reps: int
                      ) -> list[CollectiveFit]:
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
                medians.append(factor * _median_seconds(op, device, reps, inner=inner,
                                                        before=dist.barrier))
            plan.append((axis, n, groups, collective, measured))
    slowest = iter(_slowest(medians, device))
    return [_fit(axis, n, groups, c, nbytes, [next(slowest) for _ in nbytes])
            for axis, n, groups, c, nbytes in plan]


def _device() -> torch.device:
    """This rank's device: meshlab's runtime knows it; in a plain torchrun script, guess."""
    from meshlab import runtime

    try:
        return runtime.state().device
    except RuntimeError:
        return (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                else torch.device("cpu"))


# -- host facts --------------------------------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return models[0] if models else "cpu"
    except OSError:
        return "cpu"


def _memory(device: torch.device, ranks_here: int) -> tuple[float, float]:
    """(GiB per rank, GiB already taken outside torch) on this rank."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        taken = total - free - torch.cuda.memory_reserved(device)
        return total / GIB, max(0.0, taken / GIB)
    import psutil

    return psutil.virtual_memory().total / ranks_here / GIB, 0.0


def _host_facts(device: torch.device) -> tuple[dict[str, list[int]], float, float]:
    hostnames: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hostnames, socket.gethostname())
    hosts: dict[str, list[int]] = {}
    for r, h in enumerate(hostnames):
        hosts.setdefault(h, []).append(r)
    memory, reserved = _memory(device, len(hosts[socket.gethostname()]))
    facts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(facts, (memory, reserved))
    return hosts, min(m for m, _ in facts), max(r for _, r in facts)


def _choose_axes(fits: list[CollectiveFit], hosts: dict[str, list[int]]
                 ) -> tuple[str | None, str | None, list[str]]:
    """The widest axis whose groups stay on one host, and the widest one that spans hosts."""
    host_of = {r: h for h, ranks in hosts.items() for r in ranks}
    axes: dict[str, tuple[int, bool]] = {}
    for f in fits:
        inside = all(len({host_of[r] for r in g}) == 1 for g in f.groups)
        axes.setdefault(f.axis, (f.ranks, inside))
    intra = max((a for a, (_, inside) in axes.items() if inside), key=lambda a: axes[a][0],
                default=None)
    inter = max((a for a, (_, inside) in axes.items() if not inside), key=lambda a: axes[a][0],
                default=None)
    notes = []
    if inter is None and intra is not None:
        notes.append(f"every group is inside one host: the inter link is the intra one "
                     f"({intra}); calibrate across nodes to measure the network")
    if intra is None and inter is not None:
        notes.append(f"no two ranks share a host: the intra link is the inter one ({inter})")
    return intra, inter, notes


# -- the entry point ---------------------------------------------------------------------------


def calibrate(mesh: Any = None, *, sizes: Sequence[int] | None = None,
              matmuls: Sequence[tuple[int, int, int]] | None = None,
              dtypes: Sequence[str] | None = None, reps: int | None = None,
              quick: bool = False) -> Calibration:
    """Measure matmul throughput, memory bandwidth and every collective on each axis of
    ``mesh`` (a DeviceMesh; None: the world group only). Call it on every rank at once."""
    started = time.perf_counter()
    device = _device()
    kind = "cuda" if device.type == "cuda" else "cpu"
    runs = dtypes_for(device)
    dtypes = list(dtypes or runs)
    unknown = [d for d in dtypes if d not in runs]
    if unknown:
        raise ValueError(f"dtypes {unknown} do not run on {kind}: choose from {runs}")
    sizes = sorted(set(sizes or (QUICK_SIZES if quick else SIZES)[kind]))
    if len(sizes) < 2 or min(sizes) < 1:
        raise ValueError(f"sizes {sizes}: give at least two distinct positive byte counts")
    reps = reps or (QUICK_REPS if quick else REPS)[kind]
    hosts, memory, reserved = _host_facts(device)
    matmul = _time_matmuls(matmuls or (QUICK_MATMULS if quick else MATMULS)[kind], dtypes,
                           device, reps)
    largest = max(matmul, key=lambda p: p.m * p.n * p.k)
    tflops = {p.dtype: p.tflops for p in matmul if (p.m, p.n, p.k) == (largest.m, largest.n,
                                                                         largest.k)}
    copy_bytes = COPY_BYTES[kind] // (4 if quick else 1)
    (copy_s,) = _slowest([_copy_seconds(copy_bytes, device, reps)], device)
    here = layer_seconds(device, reps, _windowed_seconds)
    per_layer = dict(zip(here, _slowest(list(here.values()), device), strict=True))
    fits = _time_collectives(mesh, sizes, device, reps)
    intra, inter, notes = _choose_axes(fits, hosts)
    if mesh is None:
        notes.insert(0, "no mesh: only the world group was timed (%mesh init to time each axis)")
    axes = [] if mesh is None else [f"{n}={s}" for n, s in zip(
        mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True)]
    dist.barrier()
    return Calibration(
        device=kind, device_name=_device_name(device), world_size=dist.get_world_size(),
        hosts=hosts, mesh=" ".join(axes), timer="cuda events" if kind == "cuda" else
        "cpu wall clock", memory_gib=memory, reserved_gib=reserved,
        memory_bandwidth_gbs=2 * copy_bytes / copy_s / 1e9, layer_seconds=per_layer,
        matmul=matmul, tflops=tflops,
        collectives=fits, intra_axis=intra, inter_axis=inter,
        seconds=time.perf_counter() - started, notes=notes)


def write_profile(calibration: Calibration, path: str | Path, name: str | None = None
                  ) -> Hardware:
    """Save ``calibration.profile(name)`` as TOML (``meshlab.plan.hardware.load`` reads it)
    with where and how it was measured as comments."""
    path = Path(path)
    hw = calibration.profile(name or path.stem)
    save(hw, path)
    c = calibration
    when = datetime.datetime.now().isoformat(timespec="seconds")
    lines = [f"# measured by %mesh calibrate on {when}: {c.world_size} ranks on "
             f"{len(c.hosts)} host(s), {c.device_name} ({c.device}, {c.timer})",
             f"# mesh {c.mesh or '(none: world group only)'}; intra = {c.intra_axis}, "
             f"inter = {c.inter_axis or c.intra_axis}; tflops at the largest matmul"]
    lines += [f"# note: {n}" for n in c.notes]
    with path.open("a") as f:
        f.write("\n".join(lines) + "\n")
    return hw


def summary(calibration: Calibration) -> str:
    """Plain-text tables of a calibration (what the torchrun entry point prints)."""
    c = calibration
    out = [f"{c.world_size} ranks, {c.device_name}, mesh {c.mesh or '(world only)'}, "
           f"{c.seconds:.1f} s",
           "matmul TFLOP/s (largest size): " + ", ".join(f"{d} {t:.4g}"
                                                         for d, t in c.tflops.items()),
           f"memory {c.memory_gib:.1f} GiB/rank, copy {c.memory_bandwidth_gbs:.3g} GB/s, "
           "tiny layer, forward + backward: " + ", ".join(
               f"{w} {t * 1e6:.0f} us" for w, t in c.layer_seconds.items()),
           f"{'axis':<14}{'ranks':>5}  {'collective':<15}{'latency_us':>11}"
           f"{'bandwidth_gbs':>14}{'residual':>9}"]
    out += [f"{f.axis:<14}{f.ranks:>5}  {f.collective:<15}{f.latency_us:>11.1f}"
            f"{f.bandwidth_gbs:>14.4g}{f.residual:>9.2f}" for f in c.collectives]
    return "\n".join(out + [f"note: {n}" for n in c.notes])


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m meshlab.calibrate`` under torchrun: rank 0 writes the profile."""
    from meshlab import runtime
    from meshlab.mesh import build

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-o", dest="path", default="calibrated.toml", help="profile to write")
    parser.add_argument("--name", help="profile name (default: the file's stem)")
    parser.add_argument("--mesh", help='axes to time, e.g. "dp=2 tp=2" (default: world only)')
    parser.add_argument("--sizes", type=parse_sizes, help="message sizes, e.g. 4K,64K,1M,4M")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    args = parser.parse_args(argv)
    runtime.init_from_env()
    try:
        cal = calibrate(build(args.mesh) if args.mesh else None, sizes=args.sizes,
                        quick=args.quick)
        if dist.get_rank() == 0:
            write_profile(cal, args.path, args.name)
            print(summary(cal) + f"\nwrote {os.path.abspath(args.path)}")
    finally:
        dist.destroy_process_group()

