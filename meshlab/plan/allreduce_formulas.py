"""The alpha-beta cost of each all-reduce algorithm of ``meshlab.measure.allreduce`` on hosts that
share a link (Thakur, Rabenseifner and Gropp 2005), round by round: what ``%mesh calibrate``
compares with its measurements and the planner costs small all-reduces with.

Plain Python, like ``meshlab.plan.formulas``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

ALLREDUCE_ALGORITHMS = ("ring", "halving_doubling", "tree", "hierarchical")
"""The all-reduce algorithms of ``meshlab.measure.allreduce``, costed here round by round."""


@dataclass(frozen=True, slots=True)
class AllreduceRound:
    """``count`` rounds of one kind in an all-reduce: whether a transfer leaves its host, and
    the share of the buffer on the busiest link of each kind."""

    count: int
    crosses: bool
    """Some transfer goes to another host: the round waits for the inter-host latency."""
    rank_share: float
    """The most one rank sends (or receives) to ranks of its own host, over its own link."""
    host_share: float
    """The most that leaves (or enters) one host; the transfers that do share its link."""


def round_seconds(crosses: bool, rank_bytes: float, host_bytes: float, *, latency_s: float,
                  bandwidth_bytes_s: float, inter_latency_s: float,
                  inter_bandwidth_bytes_s: float) -> float:
    """One round of transfers that run at once: the latency of the slowest link it uses, then
    the bytes on its busiest resource at that resource's bandwidth (a rank's own link inside a
    host, or a host's link to the others, shared by every transfer that leaves the host)."""
    return ((inter_latency_s if crosses else latency_s)
            + max(rank_bytes / bandwidth_bytes_s, host_bytes / inter_bandwidth_bytes_s))


@lru_cache(maxsize=1024)
def allreduce_rounds(algorithm: str, ranks: int, ranks_per_host: int | None = None
                     ) -> tuple[AllreduceRound, ...]:
    """The rounds of ``meshlab.measure.allreduce.rounds(algorithm, ranks)`` on hosts of
    ``ranks_per_host`` consecutive ranks (None: one host), summarised by kind.

    Closed forms where the hosts align with the algorithm (ring and hierarchical always;
    halving-doubling and tree when ``ranks_per_host`` is a power of two, and ``ranks`` too for
    halving-doubling); otherwise the exchange pairs are walked, O(ranks) per round.
    """
    if algorithm not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: use one of "
                         f"{', '.join(ALLREDUCE_ALGORITHMS)}")
    if ranks < 1 or (ranks_per_host is not None and ranks_per_host < 1):
        raise ValueError(f"ranks and ranks_per_host must be >= 1, got {ranks}, {ranks_per_host}")
    p = ranks
    k = min(ranks_per_host or p, p)
    hosts = -(-p // k)
    if p == 1:
        return ()
    if algorithm == "ring":  # every rank sends 1/p to the next; one transfer leaves each host
        return (AllreduceRound(2 * (p - 1), hosts > 1, 1 / p if k > 1 else 0.0,
                               1 / p if hosts > 1 else 0.0),)
    if algorithm == "hierarchical":
        if p % k:
            raise ValueError(f"hierarchical all-reduce needs the same ranks on every host: "
                             f"{p} ranks in hosts of {k} leave one short; choose another "
                             "algorithm or a group with as many ranks from each host")
        # a ring inside each host over pieces of 1/k, then k rings across the hosts at once,
        # each of 1/p a round: 1/H leaves every host per round
        return tuple(r for r in (AllreduceRound(2 * (k - 1), False, 1 / k, 0.0),
                                 AllreduceRound(2 * (hosts - 1), True, 0.0, 1 / hosts))
                     if r.count)
    power_of_two = k & (k - 1) == 0
    if algorithm == "tree":  # reduce to rank 0 over distance 1, 2, 4..., then back down
        out = []
        for level in range((p - 1).bit_length()):
            d = 1 << level
            if power_of_two or hosts == 1:  # aligned: a pair d apart crosses iff d >= k
                cross = d >= k and hosts > 1
                out.append(AllreduceRound(2, cross, 0.0 if cross else 1.0, float(cross)))
            else:
                out.append(_walked([(r, r - d) for r in range(d, p, 2 * d)], 1.0, k, 2))
        return tuple(out)
    # halving-doubling: the largest power of two q of the ranks run Rabenseifner's
    # algorithm; the other r fold their buffer into a neighbour first and get it back last
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    runs = [2 * i + 1 for i in range(extra)] + list(range(2 * extra, p))
    out = [_walked([(2 * i, 2 * i + 1) for i in range(extra)], 1.0, k, 2)] if extra else []
    m = 1
    while m < q:  # a halving round and, mirrored, a doubling round of 1/(2m) at distance m
        if hosts == 1:
            out.append(AllreduceRound(2, False, 1 / (2 * m), 0.0))
        elif not extra and power_of_two:  # aligned: all cross iff m >= k, all k leave a host
            out.append(AllreduceRound(2, True, 0.0, k / (2 * m)) if m >= k
                       else AllreduceRound(2, False, 1 / (2 * m), 0.0))
        else:
            out.append(_walked([(runs[i], runs[i ^ m]) for i in range(q)], 1 / (2 * m), k, 2))
        m *= 2
    return tuple(out)


def _walked(pairs: list[tuple[int, int]], share: float, k: int, count: int) -> AllreduceRound:
    """A round of ``share``-sized transfers (src, dst) on hosts of ``k``, summarised."""
    rank_out: dict[int, float] = {}
    rank_in: dict[int, float] = {}
    host_out: dict[int, float] = {}
    host_in: dict[int, float] = {}
    for src, dst in pairs:
        if src // k == dst // k:
            rank_out[src] = rank_out.get(src, 0.0) + share
            rank_in[dst] = rank_in.get(dst, 0.0) + share
        else:
            host_out[src // k] = host_out.get(src // k, 0.0) + share
            host_in[dst // k] = host_in.get(dst // k, 0.0) + share
    busiest = max([0.0, *rank_out.values(), *rank_in.values()])
    host = max([0.0, *host_out.values(), *host_in.values()])
    return AllreduceRound(count, bool(host_out), busiest, host)


def allreduce_terms(algorithm: str, ranks: int, *, latency_s: float, bandwidth_bytes_s: float,
                    ranks_per_host: int | None = None, inter_latency_s: float | None = None,
                    inter_bandwidth_bytes_s: float | None = None) -> tuple[float, float]:
    """(seconds at zero bytes, seconds per byte) of one all-reduce: its time is affine in the
    message, the latency terms plus the busiest links' bytes round by round.

    The links: ``latency_s`` / ``bandwidth_bytes_s`` of one rank's own link inside a host,
    ``inter_*`` of a host's link to the others (default: the same), which every transfer
    leaving the host in a round shares: a ring across the hosts measures it (one transfer
    leaves each host at a time), as ``%mesh calibrate`` does.
    """
    inter_latency = latency_s if inter_latency_s is None else inter_latency_s
    inter_bw = bandwidth_bytes_s if inter_bandwidth_bytes_s is None else inter_bandwidth_bytes_s
    if min(bandwidth_bytes_s, inter_bw) <= 0 or min(latency_s, inter_latency) < 0:
        raise ValueError(f"bandwidths must be > 0 and latencies >= 0, got {bandwidth_bytes_s}, "
                         f"{inter_bw} bytes/s and {latency_s}, {inter_latency} s")
    fixed = per_byte = 0.0
    for r in allreduce_rounds(algorithm, ranks, ranks_per_host):
        fixed += r.count * (inter_latency if r.crosses else latency_s)
        per_byte += r.count * max(r.rank_share / bandwidth_bytes_s, r.host_share / inter_bw)
    return fixed, per_byte


def allreduce_seconds(algorithm: str, ranks: int, nbytes: float, *, latency_s: float,
                      bandwidth_bytes_s: float, ranks_per_host: int | None = None,
                      inter_latency_s: float | None = None,
                      inter_bandwidth_bytes_s: float | None = None) -> float:
    """Alpha-beta time of an all-reduce of ``nbytes`` among ``ranks`` ranks, hosts of
    ``ranks_per_host`` consecutive ranks, with one of ``ALLREDUCE_ALGORITHMS``.

    Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations
    in MPICH", IJHPCA 19(1), 49-66: their cost model (a message costs alpha + n beta; a
    rank sends one and receives one message at a time), per algorithm on one host:

    - ring (reduce-scatter then all-gather, the ring of their allgather):
      2(p-1) alpha + 2 (p-1)/p n beta;
    - halving_doubling (Rabenseifner's: reduce-scatter by recursive vector halving and distance
      doubling, all-gather by vector doubling and distance halving):
      2 log2 p alpha + 2 (p-1)/p n beta; for p not a power of two the fold into the largest
      power of two q adds 2 rounds of the whole buffer (meshlab's fold sends it whole and back
      where theirs halves it): (2 log2 q + 2) alpha + (2 + 2 (q-1)/q) n beta;
    - tree (binomial reduce, then binomial broadcast, MPICH's old all-reduce):
      2 ceil(log2 p) (alpha + n beta);
    - hierarchical (ring reduce-scatter inside each host, ring all-reduce of each rank's
      piece across the H hosts, ring all-gather inside): 2(k-1) intra rounds of n/k, then
      2(H-1) rounds in which the host's k ranks each send n/p over its link.

    Across hosts each round costs ``round_seconds``: the inter latency if any transfer
    crosses, and the busiest of the ranks' own links and the hosts' shared links. Chan,
    Heimlich, Purkayastha and van de Geijn 2007, "Collective communication: theory, practice,
    and experience", CCPE 19(13), bound every all-reduce below by
    ceil(log2 p) alpha + 2 (p-1)/p n beta: ring meets the bandwidth term, the others trade it
    for fewer latency terms (log p against p).
    """
    fixed, per_byte = allreduce_terms(
        algorithm, ranks, latency_s=latency_s, bandwidth_bytes_s=bandwidth_bytes_s,
        ranks_per_host=ranks_per_host, inter_latency_s=inter_latency_s,
        inter_bandwidth_bytes_s=inter_bandwidth_bytes_s)
    return fixed + per_byte * nbytes


def allreduce_crossover(ranks: int, *, latency_s: float, bandwidth_bytes_s: float,
                        ranks_per_host: int | None = None, inter_latency_s: float | None = None,
                        inter_bandwidth_bytes_s: float | None = None) -> dict[str, float]:
    """Per algorithm other than ring, the message size (bytes) below which it beats ring under
    ``allreduce_seconds``: inf when it does at every size, 0 when at none below some size
    (it may still beat ring above one: compare ``allreduce_terms``). Hierarchical is left out
    when the hosts hold unequal shares of the ranks."""
    links = dict(latency_s=latency_s, bandwidth_bytes_s=bandwidth_bytes_s,
                 ranks_per_host=ranks_per_host, inter_latency_s=inter_latency_s,
                 inter_bandwidth_bytes_s=inter_bandwidth_bytes_s)
    ring_fixed, ring_per_byte = allreduce_terms("ring", ranks, **links)  # type: ignore[arg-type]
    out = {}
    for algorithm in ALLREDUCE_ALGORITHMS[1:]:
        if algorithm == "hierarchical" and ranks % min(ranks_per_host or ranks, ranks):
            continue
        fixed, per_byte = allreduce_terms(algorithm, ranks, **links)  # type: ignore[arg-type]
        if fixed >= ring_fixed:
            out[algorithm] = 0.0
        elif per_byte <= ring_per_byte:
            out[algorithm] = math.inf
        else:
            out[algorithm] = (ring_fixed - fixed) / (per_byte - ring_per_byte)
    return out
