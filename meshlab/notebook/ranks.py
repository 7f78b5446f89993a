"""Rank sets written the way people type them (``0,2-3``), and ranks laid out host by host."""

from __future__ import annotations

import re
from collections.abc import Iterable


def parse_ranks(spec: str | Iterable[int] | None, world_size: int) -> list[int]:
    """Turn ``"0,2-3"`` (or a list of ints, or None for all) into sorted, checked ranks. Each
    part is checked before any range is built: ``0-99999999999`` is out of range, not 10^11
    ints in memory."""
    if spec is None:
        return list(range(world_size))
    ranks: set[int] = set()
    if isinstance(spec, str):
        parts = spec.replace(" ", "").split(",")
        if parts == [""]:
            raise ValueError(f"rank set {spec!r} is empty: name at least one rank, e.g. '0'")
        for part in parts:
            written = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
            if written is None:
                raise ValueError(f"bad rank set {spec!r}: {part!r} is not a rank or a range "
                                 "(a-b); use comma-separated ranks and ranges, e.g. '0,2-3'")
            first, last = int(written[1]), int(written[2] or written[1])
            if first > last:
                raise ValueError(f"bad rank set {spec!r}: {part!r} runs backwards; write "
                                 f"{last}-{first}")
            if last >= world_size:
                raise ValueError(f"rank(s) {part} out of range: the cluster has ranks "
                                 f"0-{world_size - 1}")
            ranks.update(range(first, last + 1))
    else:
        ranks = {int(r) for r in spec}
    if not ranks:
        raise ValueError(f"rank set {spec!r} is empty: name at least one rank, e.g. '0'")
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise ValueError(
            f"rank(s) {format_ranks(bad)} out of range: the cluster has ranks 0-{world_size - 1}"
        )
    return sorted(ranks)


def format_ranks(ranks: Iterable[int]) -> str:
    """The inverse of parse_ranks: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def label(ranks: Iterable[int]) -> str:
    """``[rank 2]`` or ``[ranks 0-3]``: the prefix used for grouped output."""
    ranks = sorted(set(ranks))
    return f"[rank {ranks[0]}]" if len(ranks) == 1 else f"[ranks {format_ranks(ranks)}]"


def ranks_are(ranks: Iterable[int]) -> str:
    """``rank 0 is`` / ``ranks 0,2 are``: the subject of a sentence about some ranks."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]} is" if len(ranks) == 1 else f"ranks {format_ranks(ranks)} are"


def host_by_host(host_of: list[str], order: list[str]) -> list[int]:
    """Engines (by index, each on ``host_of[i]``) in rank order: one host's before the next,
    hosts in ``order`` (the profile's; others as their engines came). The innermost mesh
    axis, tp, then stays on one host."""
    named = {h: i for i, h in enumerate(order)}
    first: dict[str, int] = {}
    for i, host in enumerate(host_of):
        first.setdefault(host, i)
    return sorted(range(len(host_of)), key=lambda i: (
        named.get(host_of[i], len(named)), first[host_of[i]], i))
