"""Where every block of a tensor lives: DTensor, tensor or module -> plain-data reports.

Runs on the ranks; reports are dataclasses of ints, strings and lists that travel to
the notebook, where the sharding widget draws them. A DTensor's report covers every rank
of its mesh (computed from its placements, no communication); a plain tensor's covers
only the rank that holds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass(slots=True)
class RankShard:
    """The piece of a tensor one rank holds."""

    rank: int
    coordinate: list[int]  # the rank's index along each mesh axis
    local_shape: list[int]
    offsets: list[int]  # where the piece starts in the global tensor, per dim
    bytes: int


@dataclass(slots=True)
class ShardingReport:
    """A tensor's global shape, placements, and what each rank holds."""

    name: str
    kind: str  # "dtensor" or "tensor"
    global_shape: list[int]
    dtype: str
    mesh_shape: list[int] = field(default_factory=list)
    mesh_axes: list[str] = field(default_factory=list)
    placements: list[str] = field(default_factory=list)
    shards: list[RankShard] = field(default_factory=list)

    def bytes_per_rank(self) -> dict[int, int]:
        return {s.rank: s.bytes for s in self.shards}

    @property
    def partial(self) -> bool:
        """Some mesh axis holds unreduced partial values (a reduction is pending)."""
        return any(p.startswith("Partial") for p in self.placements)


@dataclass(slots=True)
class ModuleReport:
    """Every parameter and buffer of a module, each with its own report."""

    name: str
    tensors: list[ShardingReport]
    buffers: list[str] = field(default_factory=list)  # names among `tensors` that are buffers

    def bytes_per_rank(self) -> dict[int, int]:
        totals: dict[int, int] = {}
        for report in self.tensors:
            for rank, n in report.bytes_per_rank().items():
                totals[rank] = totals.get(rank, 0) + n
        return totals


def describe(obj: Any, name: str = "") -> ShardingReport | ModuleReport:
    """A report for a DTensor, a plain tensor (held by this rank), or an nn.Module."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, nn.Module):
        tensors = [describe(p, n) for n, p in obj.named_parameters()]
        buffers = [n for n, _ in obj.named_buffers()]
        tensors += [describe(b, n) for n, b in obj.named_buffers()]
        return ModuleReport(name or type(obj).__name__, tensors, buffers)  # type: ignore[arg-type]
    if isinstance(obj, DTensor):
        return _describe_dtensor(obj, name)
    if isinstance(obj, torch.Tensor):
        return ShardingReport(
            name=name, kind="tensor", global_shape=list(obj.shape), dtype=_dtype(obj.dtype),
            shards=[RankShard(rank=_rank(), coordinate=[], local_shape=list(obj.shape),
                              offsets=[0] * obj.dim(),
                              bytes=obj.numel() * obj.element_size())])
    raise TypeError(f"cannot describe a {type(obj).__name__}: pass a DTensor, a tensor or an "
                    "nn.Module")


def merge(per_rank: dict[int, Any]) -> ShardingReport | ModuleReport:
    """One report from every rank's own: each rank's piece comes from that rank's report.

    A DTensor on a sub-mesh (say mesh["tp"]) exists once per group of the other axes;
    merged, the copies show up as the same blocks held by several groups.
    """
    first = per_rank[min(per_rank)]
    if isinstance(first, ModuleReport):
        names = [t.name for t in first.tensors]
        tensors = [merge({r: m.tensors[i] for r, m in per_rank.items() if i < len(m.tensors)})
                   for i in range(len(names))]
        return ModuleReport(first.name, tensors, first.buffers)  # type: ignore[arg-type]
    shards: list[RankShard] = []
    for rank in sorted(per_rank):
        own = [s for s in per_rank[rank].shards if s.rank == rank]
        shards += own or []
    return ShardingReport(first.name, first.kind, first.global_shape, first.dtype,
                          first.mesh_shape, first.mesh_axes, first.placements, shards)


def _describe_dtensor(dt: Any, name: str) -> ShardingReport:
    mesh = dt.device_mesh
    mesh_shape = list(mesh.shape)
    ranks = mesh.mesh.flatten().tolist()
    placements = list(dt.placements)
    itemsize = dt.element_size() if hasattr(dt, "element_size") else dt.dtype.itemsize
    shards = []
    for index, rank in enumerate(ranks):
        coord = _unravel(index, mesh_shape)
        shape, offsets = local_shape_and_offsets(list(dt.shape), mesh_shape, coord, placements)
        shards.append(RankShard(rank=rank, coordinate=coord, local_shape=shape,
                                offsets=offsets, bytes=math.prod(shape) * itemsize))
    return ShardingReport(
        name=name, kind="dtensor", global_shape=list(dt.shape), dtype=_dtype(dt.dtype),
        mesh_shape=mesh_shape, mesh_axes=list(mesh.mesh_dim_names or []),
        placements=[_placement(p) for p in placements], shards=shards)


def local_shape_and_offsets(global_shape: list[int], mesh_shape: list[int], coord: list[int],
                            placements: list[Any]) -> tuple[list[int], list[int]]:
    """The local shape and global offsets at one mesh coordinate.

    Shard(d) on mesh axis i cuts the piece left by earlier axes into ``mesh_shape[i]``
    chunks the way torch.chunk does (ceil-sized, so the last ranks may get less or
    nothing); Replicate and Partial keep the whole piece.
    """
    from torch.distributed.tensor import Partial, Replicate, Shard

    shape, offsets = list(global_shape), [0] * len(global_shape)
    for axis, p in enumerate(placements):
        if type(p) is Shard:
            n, i, size = mesh_shape[axis], coord[axis], shape[p.dim]
            chunk = -(-size // n)
            start, stop = min(i * chunk, size), min((i + 1) * chunk, size)
            offsets[p.dim] += start
            shape[p.dim] = stop - start
            if shape[p.dim] == 0:  # torch's convention: an empty piece starts at the end
                offsets[p.dim] = global_shape[p.dim]
        elif not isinstance(p, (Replicate, Partial)):  # e.g. _StridedShard: ask torch
            from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

            local, offset = _compute_local_shape_and_global_offset(
                global_shape, mesh_shape, coord, placements)
            return list(local), list(offset)
    return shape, offsets


def _placement(p: Any) -> str:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if type(p) is Shard:
        return f"Shard({p.dim})"
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op})"
    if hasattr(p, "split_factor") and hasattr(p, "dim"):  # torch's _StridedShard, "_S(0, 2)"
        # FSDP2 over a tensor-parallel dim: each rank holds every split_factor-th block of dim
        return f"strided shard on dim {p.dim} (FSDP over TP, split {p.split_factor} ways)"
    return str(p)


def _unravel(index: int, shape: list[int]) -> list[int]:
    coord = []
    for n in reversed(shape):
        coord.append(index % n)
        index //= n
    return coord[::-1]


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0
