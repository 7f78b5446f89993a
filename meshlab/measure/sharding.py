"""Where every block of a tensor lives: DTensor, tensor or module -> plain-data reports.

Runs on the ranks; reports are dataclasses of ints, strings and lists that travel to
the notebook, where the sharding widget draws them. A DTensor's report covers every rank
of its mesh (computed from its placements, no communication); a plain tensor's covers
only the rank that holds it.

What makes two ranks' pieces one tensor: the same name in the whole model (a pipeline
stage keeps the full model's names, so stage 0's ``layers.0...`` is not stage 1's
``layers.2...``) and, for a DTensor, the same mesh (the same ranks), placements and shape.
A plain tensor is its rank's own (an expert slice, a stage's activations, anything made
on that rank), so no two ranks' plain tensors are ever taken for replicas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from meshlab.measure.memory import reshard


@dataclass(slots=True)
class RankShard:
    """The piece of a tensor one rank holds."""

    rank: int
    coordinate: list[int]  # the rank's index along each axis of the tensor's own mesh
    local_shape: list[int]
    offsets: list[int]  # where the piece starts in the global tensor, per dim
    bytes: int
    place: dict[str, int] = field(default_factory=dict)
    """The rank's index on each axis of the session's mesh (``mesh`` on the ranks) with more
    than one rank, ``{"pp": 1, "tp": 0}``; filled by the rank itself ({} for the others)."""


@dataclass(slots=True)
class ShardingReport:
    """A tensor's global shape, placements, and what each rank holds."""

    name: str  # what was inspected: the expression, or the name within the inspected module
    kind: str  # "dtensor" or "tensor"
    global_shape: list[int]
    dtype: str
    mesh_shape: list[int] = field(default_factory=list)
    mesh_axes: list[str] = field(default_factory=list)
    placements: list[str] = field(default_factory=list)
    shards: list[RankShard] = field(default_factory=list)
    fqn: str = ""
    """The tensor's name in the whole model (``layers.2.attention.wq.weight``): its path in
    the outermost module of the rank's namespace that holds it; "" when no module does."""
    mesh_ranks: list[int] = field(default_factory=list)
    """A DTensor's mesh: every rank of it, in mesh order ([] for a plain tensor)."""
    experts: list[int] = field(default_factory=list)
    """An expert-parallel slice (meshlab.parallel.expert): the global experts it holds."""
    n_experts: int = 0
    """How many experts the whole layer has (0 when not known)."""
    parts: list[ShardingReport] = field(default_factory=list)
    """After ``merge``: the different tensors the ranks hold under one name, one report each
    (pipeline stages, expert slices, one plain tensor per rank); [] when they hold one."""

    def bytes_per_rank(self) -> dict[int, int]:
        return {s.rank: s.bytes for s in self.shards}

    def distinct(self) -> list[ShardingReport]:
        """The tensors to draw apart: ``parts``; else this report, or one per rank for a plain
        tensor's report that lists several ranks (each holds its own)."""
        if self.parts:
            return self.parts
        ranks = sorted({s.rank for s in self.shards})
        if self.kind == "dtensor" or len(ranks) < 2:
            return [self]
        return [dataclasses.replace(self, shards=[s for s in self.shards if s.rank == r])
                for r in ranks]

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
    resharded: list[str] = field(default_factory=list)
    """FSDP units found gathered and resharded before reading (meshlab.measure.memory)."""
    reset: bool = False
    """Whether a step that raised was reset first (meshlab.measure.memory.reshard)."""

    def bytes_per_rank(self) -> dict[int, int]:
        totals: dict[int, int] = {}
        for report in self.tensors:
            for rank, n in report.bytes_per_rank().items():
                totals[rank] = totals.get(rank, 0) + n
        return totals


# where a tensor sits in the rank's models: its full name, the module holding it, attribute
_Where = tuple[str, nn.Module | None, str]


def describe(obj: Any, name: str = "", namespace: Mapping[str, Any] | None = None
             ) -> ShardingReport | ModuleReport:
    """A report for a DTensor, a plain tensor (held by this rank), or an nn.Module.

    ``namespace`` (the rank's globals, where cells run): its modules give each tensor its
    name in the whole model, and its ``mesh`` places the rank on the session's mesh.
    """
    namespace = namespace or {}
    models = _model_names(namespace) if isinstance(obj, (nn.Module, torch.Tensor)) else {}
    return _describe(obj, name, models, _place(namespace.get("mesh")))


def _describe(obj: Any, name: str, models: dict[int, _Where], place: dict[str, int]
              ) -> ShardingReport | ModuleReport:
    if isinstance(obj, nn.Module):
        # what the optimizer holds, not what a failed forward left gathered
        resharded, reset = reshard(obj)
        tensors: list[ShardingReport] = []
        for n, t in [*obj.named_parameters(), *obj.named_buffers()]:
            path, _, attr = n.rpartition(".")
            tensors.append(_describe_tensor(t, n, models, place,
                                            (obj.get_submodule(path), attr)))
        buffers = [n for n, _ in obj.named_buffers()]
        return ModuleReport(name or type(obj).__name__, tensors, buffers, resharded, reset)
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"cannot describe a {type(obj).__name__}: pass a DTensor, a tensor or "
                        "an nn.Module")
    return _describe_tensor(obj, name, models, place)


def _describe_tensor(t: torch.Tensor, name: str, models: dict[int, _Where],
                     place: dict[str, int], owner: tuple[nn.Module, str] | None = None
                     ) -> ShardingReport:
    from torch.distributed.tensor import DTensor

    fqn, module, attr = models.get(id(t), ("", None, ""))
    if module is None and owner is not None:
        module, attr = owner
    if isinstance(t, DTensor):
        report = _describe_dtensor(t, name)
    else:
        report = ShardingReport(
            name=name, kind="tensor", global_shape=list(t.shape), dtype=_dtype(t.dtype),
            shards=[RankShard(rank=_rank(), coordinate=[], local_shape=list(t.shape),
                              offsets=[0] * t.dim(), bytes=t.numel() * t.element_size())])
        report.experts, report.n_experts = _experts(t, module, attr)
    report.fqn = fqn
    for shard in report.shards:
        if shard.rank == _rank():
            shard.place = dict(place)
    return report


def merge(per_rank: dict[int, Any]) -> ShardingReport | ModuleReport:
    """One report from every rank's own: each rank's piece comes from that rank's report.

    Ranks that hold the same tensor share one report (``_same_tensor``); when the ranks hold
    different tensors under one name (pipeline stages, expert slices, plain tensors), the
    result lists every rank's piece and keeps each tensor apart in ``parts``. A module's
    tensors are matched by name, so a pipeline stage's own layers stay its own.
    """
    first = per_rank[min(per_rank)]
    if isinstance(first, ModuleReport):
        names: dict[str, None] = {}  # in the order the ranks list them
        by_name = {r: {t.name: t for t in m.tensors} for r, m in per_rank.items()}
        for rank in sorted(per_rank):
            names.update(dict.fromkeys(by_name[rank]))
        tensors = [merge({r: by_name[r][n] for r in sorted(per_rank) if n in by_name[r]})
                   for n in names]
        buffers = [n for n in names if any(n in m.buffers for m in per_rank.values())]
        resharded = sorted({n for m in per_rank.values() for n in m.resharded})
        reset = any(m.reset for m in per_rank.values())
        return ModuleReport(first.name, tensors, buffers,  # type: ignore[arg-type]
                            resharded, reset)
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank in sorted(per_rank):
        groups.setdefault(_same_tensor(per_rank[rank], rank), []).append(rank)
    parts = [dataclasses.replace(per_rank[ranks[0]], parts=[], shards=[
        s for r in ranks for s in per_rank[r].shards if s.rank == r]) for ranks in groups.values()]
    if len(parts) == 1:
        return parts[0]
    shards = sorted((s for p in parts for s in p.shards), key=lambda s: s.rank)
    return dataclasses.replace(parts[0], shards=shards, parts=parts)


def _same_tensor(report: ShardingReport, rank: int) -> tuple[Any, ...]:
    """What two ranks' reports share exactly when they describe one tensor.

    A DTensor: its name in the model, its mesh's ranks, placements, shape and dtype (copies
    on other meshes, say one per data-parallel group of a tp-only DTensor, are other
    DTensors). A plain tensor is its rank's own, whatever its name or shape.
    """
    if report.kind != "dtensor":
        return ("tensor", rank)
    return (report.fqn or report.name, tuple(report.mesh_ranks), tuple(report.placements),
            tuple(report.global_shape), report.dtype)


def _model_names(namespace: Mapping[str, Any]) -> dict[int, _Where]:
    """id of every parameter, buffer and module in the namespace's modules -> its name in the
    outermost module holding it (the deepest path wins; ties go to the first name)."""
    found: dict[int, _Where] = {}
    for var in sorted(namespace):
        root = namespace[var]
        if var.startswith("_") or not isinstance(root, nn.Module):
            continue
        for path, module in root.named_modules(remove_duplicate=False):
            _keep(found, id(module), (path, None, ""))
            for attr, t in [*module.named_parameters(recurse=False, remove_duplicate=False),
                            *module.named_buffers(recurse=False, remove_duplicate=False)]:
                _keep(found, id(t), (f"{path}.{attr}" if path else attr, module, attr))
    return found


def _keep(found: dict[int, _Where], key: int, where: _Where) -> None:
    old = found.get(key)
    if old is None or where[0].count(".") > old[0].count("."):
        found[key] = where


def _experts(t: torch.Tensor, module: nn.Module | None, attr: str) -> tuple[list[int], int]:
    """The global experts an expert-parallel rank's slice holds, and how many there are."""
    from meshlab.parallel.materialize import marked_slice

    cut = marked_slice(module, attr) if module is not None else None
    if cut is None:
        return [], 0
    dim, start = cut
    total = getattr(module, "n_experts", 0)  # meshlab's MoE keeps the global count
    return list(range(start, start + t.shape[dim])), total if isinstance(total, int) else 0


def _place(mesh: Any) -> dict[str, int]:
    """This rank's index on each axis of the session's mesh with more than one rank; ep's
    split of dp_shard is said as dp_shard and ep."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh) or not mesh.mesh_dim_names:
        return {}
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return {}
    place = {axis: index for axis, index, size in
             zip(mesh.mesh_dim_names, coordinate, mesh.shape, strict=True)
             if size > 1 and not axis.endswith("_ep")}
    if len(place) < sum(size > 1 for size in mesh.shape):
        for view in ("dp_shard", "ep"):
            try:
                sub = mesh[view]
            except (KeyError, RuntimeError, ValueError):
                continue
            if sub.size() > 1:
                place[view] = sub.get_local_rank()
    return place


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
        placements=[_placement(p) for p in placements], shards=shards, mesh_ranks=ranks)


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
