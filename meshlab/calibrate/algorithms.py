"""Each all-reduce algorithm of ``meshlab.measure.allreduce`` timed over message sizes beside the
backend's own ``dist.all_reduce``, where ring stops winning, and where the planner says it does.

The planner's prediction comes from what a calibration already fits and a ping-pong, not from
these points, so measured and modelled crossovers are two answers to compare: a round of these
algorithms is one point-to-point hop, so its latency is half a ping-pong (the send_recv fit on
the axis inside a host; across hosts, a ping-pong this sweep posts as the algorithms post a
round), and its bandwidths are the all-reduce fits' on those axes (``links``). Rank side:
every member of the group calls ``time_allreduce_algorithms`` at once.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from meshlab.calibrate.collectives import BATCH, CollectiveFit, fit_collective
from meshlab.measure.allreduce import ALGORITHMS, Round, Transfer, _run, all_reduce, host_of_ranks
from meshlab.measure.timing import median_seconds
from meshlab.plan.allreduce_formulas import allreduce_crossover, allreduce_seconds
from meshlab.plan.hardware import Link

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

KIB, MIB = 2**10, 2**20
# a sweep that crosses over on gloo CPU ranks and on a slowed link between test hosts
SWEEP = (4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, MIB, 4 * MIB, 16 * MIB)
# the cross-host ping-pong: small messages fix a hop's latency (the rounds near a crossover
# carry 1 KiB to a few tens of KiB); its bandwidth is not used
HOP_SIZES = (KIB, 4 * KIB, 16 * KIB, 64 * KIB)


@dataclass(slots=True)
class AllreduceSweep:
    """Each algorithm's all-reduce timed over message sizes on one group, and the model's."""

    ranks: int
    hosts: list[int]
    """A host index per member: the hosts the model puts ranks on."""
    backend: str
    """The process group's backend: the label of ``dist.all_reduce``'s row."""
    nbytes: list[int]
    seconds: dict[str, list[float]]
    """Per algorithm (and the backend), per size: median over repetitions, slowest rank."""
    model: dict[str, float] = field(default_factory=dict)
    """The planner's crossover per algorithm (``allreduce_crossover``): inf, beats ring at
    every size; 0, at none below some size. Empty until ``predict``."""
    model_seconds: dict[str, list[float]] = field(default_factory=dict)
    """The planner's seconds per algorithm at each measured size."""
    notes: list[str] = field(default_factory=list)
    hop: CollectiveFit | None = None
    """Half a ping-pong between members on different hosts, posted as a round of the
    algorithms is, fitted: the latency of a round that crosses hosts (None: not timed)."""
    hop_intra: CollectiveFit | None = None
    """The same between neighbours on one host: the latency of a round inside a host, by
    the same method as ``hop`` (a blocking send/recv fit reads a different overhead)."""

    @property
    def ranks_per_host(self) -> int:
        return max(Counter(self.hosts).values())

    @property
    def algorithms(self) -> list[str]:
        """The algorithms timed (hierarchical only where hosts hold equal shares)."""
        return [a for a in ALGORITHMS if a in self.seconds]

    def fastest(self) -> list[str]:
        """Per size, the quickest of the algorithms and the backend."""
        return [min(self.seconds, key=lambda a: self.seconds[a][i])
                for i in range(len(self.nbytes))]

    def measured(self) -> dict[str, float | None]:
        """Per algorithm other than ring, the measured size below which it beats ring (None:
        no such crossing within the sweep)."""
        ring = self.seconds["ring"]
        return {a: crossover_below(self.nbytes, ring, self.seconds[a])
                for a in self.algorithms if a != "ring"}

    def predict(self, intra: Link, inter: Link) -> None:
        """Fill the model's crossovers and times from the links of one round (``links``): a
        rank's link inside a host and a host's link to the others, latency per hop; where
        this sweep timed its own hop across hosts (``hop``), that is the inter latency."""
        if self.hop is not None:
            inter = Link(bandwidth_gbs=inter.bandwidth_gbs, latency_us=self.hop.alpha_s * 1e6)
        if self.hop_intra is not None:
            intra = Link(bandwidth_gbs=intra.bandwidth_gbs,
                         latency_us=self.hop_intra.alpha_s * 1e6)
        self.notes.append(f"model links per round: intra {intra.latency_us:.0f} us + "
                          f"{intra.bandwidth_gbs * 1e3:.4g} MB/s, inter {inter.latency_us:.0f} "
                          f"us + {inter.bandwidth_gbs * 1e3:.4g} MB/s")
        links = dict(latency_s=intra.latency_us * 1e-6, bandwidth_bytes_s=intra.bandwidth_gbs * 1e9,
                     ranks_per_host=self.ranks_per_host, inter_latency_s=inter.latency_us * 1e-6,
                     inter_bandwidth_bytes_s=inter.bandwidth_gbs * 1e9)
        self.model = allreduce_crossover(self.ranks, **links)  # type: ignore[arg-type]
        self.model_seconds = {a: [allreduce_seconds(a, self.ranks, b, **links)  # type: ignore[arg-type]
                                  for b in self.nbytes] for a in self.algorithms}
        if self.hosts != sorted(self.hosts):
            self.notes.append("the model puts each host's ranks next to each other; these "
                              f"are not ({self.hosts}): its crossovers are approximate")

    def lines(self) -> list[str]:
        """One sentence per algorithm: where it beats ring, measured and modelled."""
        out = []
        for a, x in self.measured().items():
            mine, ring = self.seconds[a], self.seconds["ring"]
            m = self.model.get(a)
            model = ("" if m is None else "at every size" if math.isinf(m)
                     else "not at small sizes" if m == 0 else f"below {_size(m)}")
            if x is not None:
                text = f"{a} beats ring below {_size(x)} (measured)" + (
                    f", {_size(m)} (model)" if m and math.isfinite(m) else
                    f"; model: {model}" if model else "")
            else:
                if all(t < r for t, r in zip(mine, ring, strict=True)):
                    text = (f"{a} beats ring at every size measured ({_size(self.nbytes[0])} "
                            f"to {_size(self.nbytes[-1])})")
                elif all(t >= r for t, r in zip(mine, ring, strict=True)):
                    text = f"ring beats {a} at every size measured"
                else:
                    text = f"{a} beats ring only above some size measured"
                text += f"; model: {a} beats ring {model}" if model else ""
            out.append(text)
        return out

    def profile_crossovers(self) -> dict[str, float]:
        """What a hardware profile records: each measured crossover, and for an algorithm that
        beat ring at every size measured, the largest size (the planner goes no further)."""
        out = {}
        ring = self.seconds["ring"]
        for a, x in self.measured().items():
            if x is not None:
                out[a] = x
            elif all(m < r for m, r in zip(self.seconds[a], ring, strict=True)):
                out[a] = float(self.nbytes[-1])
        return out


def crossover_below(nbytes: Sequence[float], ring: Sequence[float], other: Sequence[float]
                    ) -> float | None:
    """The size where ring's time drops below ``other``'s, interpolated in log size and log
    time between the two measured points around the first such change; None if none."""
    gaps = [math.log(r / o) for r, o in zip(ring, other, strict=True)]  # > 0: other faster
    for i in range(len(gaps) - 1):
        if gaps[i] > 0 >= gaps[i + 1]:
            lo, hi = math.log(nbytes[i]), math.log(nbytes[i + 1])
            return math.exp(lo + (hi - lo) * gaps[i] / (gaps[i] - gaps[i + 1]))
    return None


def _size(nbytes: float) -> str:
    """Bytes as KiB below a MiB, else MiB, three significant figures."""
    unit, scale = ("KiB", KIB) if nbytes < MIB else ("MiB", MIB)
    return f"{nbytes / scale:.3g} {unit}"


def links(fits: list[CollectiveFit], intra_axis: str | None, inter_axis: str | None
          ) -> tuple[Link, Link]:
    """The intra and inter links of one round of the algorithms (each axis the other where
    one is missing): latency the send_recv fit's alpha on the axis (half a ping-pong, one
    hop: what a round waits for, where the all-reduce fit's alpha is one step of the
    backend's native ring), bandwidth the all-reduce fit's bus bandwidth on the axis."""
    def fit(axis: str, collective: str) -> CollectiveFit:
        return next(f for f in fits if f.axis == axis and f.collective == collective)

    def link(axis: str) -> Link:
        # the all-reduce's bus bandwidth, not the ping-pong's: round_seconds charges a
        # round's bytes to each rank's link and to the host's link all ranks share, the
        # load a ring all-reduce puts on them and fits up to the sweep's large sizes, where
        # one pair's ping-pong has the links to itself
        return Link(bandwidth_gbs=fit(axis, "all_reduce").bandwidth_gbs,
                    latency_us=fit(axis, "send_recv").alpha_s * 1e6)
    if intra_axis is None and inter_axis is None:
        raise ValueError("no all-reduce was fitted: calibrate a cluster of at least 2 ranks")
    return link(str(intra_axis or inter_axis)), link(str(inter_axis or intra_axis))


# -- timing ------------------------------------------------------------------------------------


def time_allreduce_algorithms(group: ProcessGroup | None, sizes: Sequence[int],
                              device: torch.device, reps: int,
                              hosts: Sequence[int] | None = None) -> AllreduceSweep:
    """Every algorithm of ``meshlab.measure.allreduce`` and ``dist.all_reduce`` at each size (bytes)
    on ``group`` (None: the world), each checked equal to ``dist.all_reduce`` first; median
    seconds on the slowest rank. ``hosts``: a host index per member (default: hostnames)."""
    p = dist.get_world_size(group)
    if p < 2:
        raise ValueError(f"timing all-reduce algorithms needs a group of 2 or more ranks, got {p}")
    hosts = list(hosts) if hosts is not None else host_of_ranks(group)
    backend = str(dist.get_backend(group))
    notes = []
    algorithms = list(ALGORITHMS)
    per_host = Counter(hosts)
    if len(per_host) == 1 or max(per_host.values()) == 1:
        algorithms.remove("hierarchical")
        notes.append("hierarchical not timed: with " + ("one host" if len(per_host) == 1 else
                                                         "one rank per host") + " it is ring")
    elif len(set(per_host.values())) > 1:
        algorithms.remove("hierarchical")
        notes.append(f"hierarchical not timed: the hosts hold unequal shares of the ranks "
                     f"({dict(per_host)})")
    below, batch = BATCH["cuda" if device.type == "cuda" else "cpu"]
    p = dist.get_world_size(group)
    hop = time_hop(group, [(i, i + p // 2) for i in range(p // 2)
                           if hosts[i] != hosts[i + p // 2]], device, reps)
    hop_intra = time_hop(group, [(i, i + 1) for i in range(0, p - 1, 2)
                                 if hosts[i] == hosts[i + 1]], device, reps)
    medians = []
    for size in sizes:
        elems = max(p, size // 4)
        _check(algorithms, elems, group, hosts, device)
        buffer = torch.zeros(elems, device=device)  # zeros: repeated sums stay finite
        ways = [_one(a, buffer, group, hosts) for a in algorithms]
        ways.append(partial(dist.all_reduce, buffer, group=group))
        inner = batch if size < below else 1
        samples: list[list[float]] = [[] for _ in ways]
        for op in ways:  # warm-up
            op()
        for rep in range(reps):
            # the ways take turns (the same order on every rank, rotated each repetition), so
            # a burst of load elsewhere on the machine hits them alike
            for i in [(rep + j) % len(ways) for j in range(len(ways))]:
                samples[i].append(median_seconds(ways[i], device, 1, inner=inner, warmup=0,
                                                 before=lambda: dist.barrier(group=group)))
        medians += [statistics.median(s) for s in samples]
    maxima = iter(_most(medians, group, device))
    seconds: dict[str, list[float]] = {a: [] for a in [*algorithms, backend]}
    for _ in sizes:
        for name in seconds:
            seconds[name].append(next(maxima))
    return AllreduceSweep(ranks=p, hosts=hosts, backend=backend,
                          nbytes=[max(p, s // 4) * 4 for s in sizes], seconds=seconds,
                          notes=notes, hop=hop, hop_intra=hop_intra)


def time_hop(group: ProcessGroup | None, pairs: Sequence[tuple[int, int]],
             device: torch.device, reps: int, sizes: Sequence[int] = HOP_SIZES
             ) -> CollectiveFit | None:
    """Half a ping-pong between the members of each pair (group-local, the pairs at once),
    each way one round as ``meshlab.measure.allreduce`` posts it, fitted; None for no pairs. Every
    member calls it."""
    p = dist.get_world_size(group)
    if not pairs:
        return None
    me = dist.get_rank(group)
    peers = [dist.get_global_rank(group, i) if group is not None else i for i in range(p)]
    below, batch = BATCH["cuda" if device.type == "cuda" else "cpu"]
    there = Round(tuple(Transfer(a, b, 0, 1, 1, False) for a, b in pairs))
    back = Round(tuple(Transfer(b, a, 0, 1, 1, False) for a, b in pairs))
    medians = []
    for size in sizes:
        flat = torch.zeros(size // 4, device=device)
        bounds = [0, flat.numel()]

        def ping_pong(flat: torch.Tensor = flat, bounds: list[int] = bounds) -> None:
            # allreduce's own round runner: the hop costs what an algorithm's round costs
            _run(there, flat, me, peers, group, bounds)
            _run(back, flat, me, peers, group, bounds)

        inner = batch if size < below else 1
        medians.append(median_seconds(ping_pong, device, reps, inner=inner,
                                      before=lambda: dist.barrier(group=group)) / 2)
    seconds = _most(medians, group, device)
    return fit_collective("hosts", 2, [[peers[a], peers[b]] for a, b in pairs], "send_recv",
                          [s // 4 * 4 for s in sizes], seconds)


def _one(algorithm: str, buffer: torch.Tensor, group: ProcessGroup | None,
         hosts: list[int]) -> Callable[[], object]:
    return partial(all_reduce, buffer, group, algorithm=algorithm, hosts=hosts)


def _check(algorithms: list[str], elems: int, group: ProcessGroup | None, hosts: list[int],
           device: torch.device) -> None:
    """Refuse to time an algorithm whose sum differs from ``dist.all_reduce``'s: on
    integer-valued float32 (small integers, so every partial sum is exact) they must agree."""
    me = dist.get_rank(group)
    values = torch.randint(-64, 65, (elems,), generator=torch.Generator().manual_seed(me + 1))
    x = values.to(device=device, dtype=torch.float32)
    want = x.clone()
    dist.all_reduce(want, group=group)
    errors = [float((all_reduce(x.clone(), group, algorithm=a, hosts=hosts) - want).abs().max())
              for a in algorithms]
    worst = _most(errors, group, device)
    wrong = [f"{a} (off by up to {e:g})" for a, e in zip(algorithms, worst, strict=True) if e]
    if wrong:
        raise RuntimeError(f"all-reduce of {elems * 4} bytes on {len(hosts)} ranks (hosts "
                           f"{hosts}): {', '.join(wrong)} differ from dist.all_reduce on exact "
                           "integer sums, so they were not timed; this is a bug in "
                           "meshlab.measure.allreduce, please report it with this message")


def _most(values: list[float], group: ProcessGroup | None, device: torch.device) -> list[float]:
    """Each value's maximum over the group's ranks (``meshlab.measure.timing.slowest``
    for a group)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def compare_allreduce(mesh: DeviceMesh | None, sizes: Sequence[int] = SWEEP, *,
                      reps: int = 3, fit_sizes: Sequence[int] | None = None) -> AllreduceSweep:
    """The algorithms timed on the world group, and the planner's crossovers from the links
    fitted on ``mesh``'s axes (as ``%mesh calibrate`` fits them, at ``fit_sizes``): what a
    calibration reports, without its matmuls and host costs. Every rank calls it."""
    from meshlab import runtime
    from meshlab.calibrate.collectives import QUICK_SIZES, time_collectives
    from meshlab.calibrate.hosts import choose_axes

    device = runtime.device()
    kind = "cuda" if device.type == "cuda" else "cpu"
    fits = time_collectives(mesh, fit_sizes or QUICK_SIZES[kind], device, reps)
    hosts = host_of_ranks(None)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(str(h), []).append(r)
    intra_axis, inter_axis, notes = choose_axes(fits, by_host)
    sweep = time_allreduce_algorithms(None, sizes, device, reps, hosts)
    sweep.predict(*links(fits, intra_axis, inter_axis))
    across = ("the sweep's cross-host ping-pong" if sweep.hop else
              f"the send_recv fit on {inter_axis or intra_axis}")
    inside = ("the sweep's ping-pong inside a host" if sweep.hop_intra else
              f"the send_recv fit on {intra_axis or inter_axis}")
    sweep.notes += [*notes, f"the model's round latency is {inside} (intra) and {across} "
                            f"(inter); its "
                            f"bandwidths the all_reduce fits on {intra_axis or inter_axis} and "
                            f"{inter_axis or intra_axis}"]
    return sweep
