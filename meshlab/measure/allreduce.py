"""All-reduce algorithms written on point-to-point ops, to compare with each other and with the
backend's own ``dist.all_reduce``.

An algorithm is data: ``rounds(algorithm, p)`` is the list of rounds one all-reduce takes on p
members, each round the transfers (who sends which chunks of the buffer to whom, and whether
the receiver adds them or copies them) that happen at once. ``all_reduce`` walks those rounds
with isend/irecv; the planner costs the same rounds with an alpha-beta model, and a test
simulates them on plain lists, so what is timed, modelled and checked is one schedule.

Only SUM: it is what gradients need (an average is a sum and one division).

    >>> all_reduce(grad, mesh["dp"].get_group(), algorithm="halving_doubling")
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from meshlab.measure import comms

ALGORITHMS = ("ring", "halving_doubling", "tree", "hierarchical")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One message of a round: chunks [start, stop) of the buffer cut in ``chunks`` equal
    parts (``torch.tensor_split``) go from member ``src`` to member ``dst``."""

    src: int  # group-local index of the sender
    dst: int  # group-local index of the receiver
    start: int  # first chunk sent
    stop: int  # one past the last chunk sent
    chunks: int  # how many chunks the buffer is cut into
    reduce: bool  # True: dst adds what it receives; False: dst overwrites its chunks with it

    @property
    def fraction(self) -> float:
        """The share of the buffer this message carries (bytes = fraction * buffer bytes)."""
        return (self.stop - self.start) / self.chunks

    def crosses(self, hosts: Sequence[int]) -> bool:
        """Whether sender and receiver are on different hosts (``hosts``: one per member)."""
        return hosts[self.src] != hosts[self.dst]


@dataclass(frozen=True, slots=True)
class Round:
    """Transfers that run at the same time; the next round starts once they all arrived."""

    transfers: tuple[Transfer, ...]

    def sent_by(self, member: int) -> float:
        """The share of the buffer ``member`` sends in this round."""
        return sum(t.fraction for t in self.transfers if t.src == member)

    def leaving(self, hosts: Sequence[int], host: int) -> int:
        """How many transfers of this round leave ``host`` (they share its link)."""
        return sum(1 for t in self.transfers if hosts[t.src] == host and t.crosses(hosts))


def rounds(algorithm: str, ranks: int, hosts: Sequence[int] | None = None) -> list[Round]:
    """The rounds one all-reduce with ``algorithm`` takes on ``ranks`` members (group-local
    indices 0..ranks-1); ``hosts`` (a host index per member) only shapes "hierarchical",
    which without it sees one host and is a ring."""
    _check_algorithm(algorithm)
    if ranks < 1:
        raise ValueError(f"an all-reduce needs at least 1 member, got ranks={ranks}")
    if algorithm != "hierarchical" or hosts is None:
        return list(_rounds(algorithm, ranks, None))
    if len(hosts) != ranks:
        raise ValueError(f"hosts has {len(hosts)} entries for {ranks} members: give one host "
                         "index per member")
    return list(_rounds(algorithm, ranks, tuple(hosts)))


def all_reduce(tensor: torch.Tensor, group: ProcessGroup | None = None, *,
               algorithm: str = "ring", hosts: Sequence[int] | None = None) -> torch.Tensor:
    """Sum ``tensor`` in place over ``group`` (default world) with ``algorithm``, on send/recv
    only; returns ``tensor``. ``hosts``: for "hierarchical", a host index per member (default
    ``host_of_ranks(group)``)."""
    _check_algorithm(algorithm)
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if me < 0:
        raise ValueError("this rank is not a member of the group it all-reduces over: call "
                         "all_reduce only on the group's members")
    if size == 1:
        return tensor
    if algorithm == "hierarchical" and hosts is None:
        hosts = host_of_ranks(group)
    schedule = rounds(algorithm, size, hosts)
    peers = [dist.get_global_rank(group, i) if group is not None else i for i in range(size)]
    flat = tensor.detach().contiguous().view(-1)  # the tensor itself when already contiguous
    bounds = _bounds(flat.numel(), schedule[0].transfers[0].chunks)
    with torch.no_grad(), comms.algorithm(algorithm):
        for step in schedule:
            _run(step, flat, me, peers, group, bounds)
    if flat.data_ptr() != tensor.data_ptr():
        with torch.no_grad():
            tensor.copy_(flat.view_as(tensor))
    return tensor


_hosts: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def host_of_ranks(group: ProcessGroup | None = None) -> list[int]:
    """A host index per member of ``group`` (group order; hosts numbered as first seen),
    from each member's hostname, gathered once per group."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "no default process group: call dist.init_process_group first"
    key = (pg.group_name, tuple(dist.get_process_group_ranks(pg)))
    if key not in _hosts:
        names: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, socket.gethostname(), group=group)
        index: dict[object, int] = {}
        _hosts[key] = [index.setdefault(name, len(index)) for name in names]
    return list(_hosts[key])


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {algorithm!r}: use one of "
                         f"{', '.join(ALGORITHMS)}")


def _bounds(numel: int, chunks: int) -> list[int]:
    """Where each of ``chunks`` parts begins (and the end), as ``torch.tensor_split`` cuts."""
    size, extra = divmod(numel, chunks)
    return [i * size + min(i, extra) for i in range(chunks + 1)]


def _run(step: Round, flat: torch.Tensor, me: int, peers: list[int],
         group: ProcessGroup | None, bounds: list[int]) -> None:
    """This member's part of one round: post every send and receive, wait, then add or copy
    what arrived (sends read the buffer as it was when the round began)."""
    ops, arrived = [], []
    for t in step.transfers:  # every member walks the same list: messages match in order
        lo, hi = bounds[t.start], bounds[t.stop]
        if hi == lo or me not in (t.src, t.dst):  # both ends skip an empty chunk alike
            continue
        if t.src == me:
            ops.append(dist.P2POp(dist.isend, flat[lo:hi], peers[t.dst], group))
        else:
            buffer = torch.empty(hi - lo, dtype=flat.dtype, device=flat.device)
            ops.append(dist.P2POp(dist.irecv, buffer, peers[t.src], group))
            arrived.append((flat[lo:hi], buffer, t.reduce))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for mine, buffer, reduce in arrived:
        mine.add_(buffer) if reduce else mine.copy_(buffer)


# -- the schedules --------------------------------------------------------------------------

@lru_cache(maxsize=256)
def _rounds(algorithm: str, p: int, hosts: tuple[int, ...] | None) -> tuple[Round, ...]:
    if p == 1:
        return ()
    if algorithm == "ring":
        return _ring(p)
    if algorithm == "halving_doubling":
        return _halving_doubling(p)
    if algorithm == "tree":
        return _tree(p)
    return _hierarchical(p, hosts if hosts is not None else (0,) * p)


def _ring_phases(members: list[int], pieces: list[tuple[int, int]], chunks: int
                 ) -> tuple[list[list[Transfer]], list[list[Transfer]]]:
    """A ring all-reduce of ``pieces`` (chunk ranges, one per member) around ``members``:
    the reduce-scatter's rounds, then the all-gather's (n-1 each)."""
    n = len(members)

    def send(j: int, piece: int, reduce: bool) -> Transfer:
        lo, hi = pieces[piece % n]
        return Transfer(members[j], members[(j + 1) % n], lo, hi, chunks, reduce)

    scatter = [[send(j, j - s, True) for j in range(n)] for s in range(n - 1)]
    gather = [[send(j, j + 1 - s, False) for j in range(n)] for s in range(n - 1)]
    return scatter, gather


def _ring(p: int) -> tuple[Round, ...]:
    """Reduce-scatter then all-gather around the ring: 2(p-1) rounds of one chunk (1/p)."""
    scatter, gather = _ring_phases(list(range(p)), [(c, c + 1) for c in range(p)], p)
    return tuple(Round(tuple(r)) for r in scatter + gather)


def _halving_doubling(p: int) -> tuple[Round, ...]:
    """Rabenseifner's all-reduce: a reduce-scatter by recursive vector halving and distance
    doubling, then an all-gather by vector doubling and distance halving: 2 log2 p rounds,
    each member sending 2(p-1)/p of the buffer when p is a power of two. Otherwise the fold
    loads members unequally (p=3: 1, 2 and 1 buffers; p=6: up to 2.5). The standard fold
    (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations
    in MPICH", IJHPCA 19(1), 49-66; MPICH's allreduce does the same): of the first 2r
    members (r = p minus the largest power of two q below it) each even one sends its whole
    buffer to the odd one after it, the q remaining members run the algorithm, and the odd
    ones send the result back."""
    q = 1 << (p.bit_length() - 1)
    extra = p - q
    # the q members that run the power-of-two algorithm, by their index among them
    runs = [2 * i + 1 for i in range(extra)] + list(range(2 * extra, p))
    fold = [Transfer(2 * i, 2 * i + 1, 0, q, q, True) for i in range(extra)]
    held = [(0, q)] * q  # the chunk range each runner is responsible for
    scatter: list[list[Transfer]] = []
    mask = 1
    while mask < q:  # distance doubling, the vector halving
        step, after = [], list(held)
        for i in range(q):
            lo, hi = held[i]
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if i & mask == 0 else ((mid, hi), (lo, mid))
            step.append(Transfer(runs[i], runs[i ^ mask], *give, q, True))
            after[i] = keep
        scatter.append(step)
        held, mask = after, mask * 2
    gather: list[list[Transfer]] = []
    while mask > 1:  # distance halving, the vector doubling
        mask //= 2
        step, after = [], list(held)
        for i in range(q):
            lo, hi = held[i]
            step.append(Transfer(runs[i], runs[i ^ mask], lo, hi, q, False))
            other = held[i ^ mask]
            after[i] = (min(lo, other[0]), max(hi, other[1]))
        gather.append(step)
        held = after
    unfold = [Transfer(2 * i + 1, 2 * i, 0, q, q, False) for i in range(extra)]
    steps = ([fold] if fold else []) + scatter + gather + ([unfold] if unfold else [])
    return tuple(Round(tuple(s)) for s in steps)


def _tree(p: int) -> tuple[Round, ...]:
    """A binomial-tree reduce to member 0, then a binomial broadcast from it: 2 ceil(log2 p)
    rounds of the whole buffer. NCCL's tree is a pipelined double binary tree; this is the
    unpipelined textbook form, latency log p but every round carries the whole buffer."""
    depth = (p - 1).bit_length()
    reduce = [[Transfer(r, r - (1 << k), 0, 1, 1, True) for r in range(p)
               if r % (2 << k) == 1 << k] for k in range(depth)]
    bcast = [[Transfer(r, r + (1 << k), 0, 1, 1, False) for r in range(0, p, 2 << k)
              if r + (1 << k) < p] for k in reversed(range(depth))]
    return tuple(Round(tuple(s)) for s in reduce + bcast)


def _hierarchical(p: int, hosts: tuple[int, ...]) -> tuple[Round, ...]:
    """Reduce-scatter inside each host (ring), all-reduce each member's piece across hosts
    among the members with the same local index (ring), all-gather inside each host (ring):
    2(L-1) + 2(H-1) rounds for H hosts of L members, of which only 2(H-1) cross hosts."""
    on: dict[int, list[int]] = {}
    for member, host in enumerate(hosts):
        on.setdefault(host, []).append(member)
    sizes = {host: len(members) for host, members in on.items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"hierarchical all-reduce needs the same number of members on every "
                         f"host, got {sizes} (members per host index): use a group with as "
                         "many ranks from each host, or another algorithm")
    per_host, n_hosts = len(next(iter(on.values()))), len(on)
    # piece i (the part local member i-1 reduces across hosts) is chunks [i*H, (i+1)*H)
    pieces = [(i * n_hosts, (i + 1) * n_hosts) for i in range(per_host)]
    inside = [_ring_phases(members, pieces, p) for members in on.values()]
    across = []
    for local in range(per_host):  # after the reduce-scatter, local member i holds piece i+1
        lo = pieces[(local + 1) % per_host][0]
        members = [on_host[local] for on_host in on.values()]
        across.append(_ring_phases(members, [(lo + h, lo + h + 1) for h in range(n_hosts)],
                                   p))

    def merged(phases: list[list[list[Transfer]]]) -> list[Round]:
        """Rounds of rings that run side by side, as one round each."""
        return [Round(tuple(t for ring in phases for t in ring[i]))
                for i in range(len(phases[0]))]

    return tuple(merged([s for s, _ in inside]) + merged([s for s, _ in across])
                 + merged([g for _, g in across]) + merged([g for _, g in inside]))
