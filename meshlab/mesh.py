"""The one place that owns mesh axes: their names, order, validation and process groups.

``MeshSpec.parse("dp=2 tp=2")`` is checked against the world size on the notebook side;
``build(spec)`` makes the named DeviceMesh on every rank. Axes follow torchtitan's order,
``pp, dp_replicate, dp_shard, cp, tp`` (outermost first: tp ranks are neighbours, so on a
GPU node tp stays inside NVLink). Plain Python and torch only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
ALIASES = {"dp": "dp_shard"}
OPTIONS = (*AXES, "ep")  # ep is not an axis of its own: it is carved out of dp_shard x cp
HELP = ", ".join((*AXES, "dp (= dp_shard)", "ep"))
VIEWS = ("dp", "dp_shard_cp", "dp_cp", "ep", "dp_shard_mod_ep", "dp_shard_in_ep")
INTERNAL_VIEWS = ("dp_shard_cp", "dp_cp")  # what FSDP and the loss use; no one types them
"""Names a trainer may ask a mesh for besides AXES: flattened views and ep's split of dp_shard."""


@dataclass(kw_only=True, slots=True)
class MeshSpec:
    """Parallel degrees of a run; their product is the world size."""

    pp: int = 1
    """Pipeline stages."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP, or the replicate dim of HSDP)."""
    dp_shard: int = 1
    """Data-parallel shards (ZeRO/FSDP); ``dp=`` means this."""
    cp: int = 1
    """Context parallel: the sequence split across ranks."""
    tp: int = 1
    """Tensor parallel."""
    ep: int = 1
    """Expert parallel, borrowed from dp_shard x cp (as torchtitan does)."""
    named: tuple[str, ...] = ()
    """Axes the user wrote even at size 1: they stay on the mesh so ``mesh[name]`` works."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "named" and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{f.name}={value!r}: every degree must be a positive integer")
        inner = self.dp_shard * self.cp
        if self.ep > 1 and (inner % self.ep or self.ep % self.cp):
            raise ValueError(
                f"ep={self.ep} must divide dp_shard x cp = {self.dp_shard} x {self.cp} = {inner} "
                f"and be a multiple of cp={self.cp}: experts are spread over dp_shard x cp ranks")

    @classmethod
    def parse(cls, text: str) -> MeshSpec:
        """``"dp=2 tp=2"`` (spaces or commas) -> MeshSpec; unknown or bad axes raise."""
        degrees: dict[str, int] = {}
        for item in re.split(r"[\s,]+", text.strip()):
            if not item:
                continue
            name, eq, value = item.partition("=")
            name = ALIASES.get(name, name)
            if not eq or name not in OPTIONS:
                raise ValueError(f"unknown mesh axis {item!r}: write NAME=SIZE with NAME one of "
                                 f"{HELP}, e.g. 'dp=2 tp=2'")
            if name in degrees:
                raise ValueError(f"axis {name!r} given twice in {text!r}")
            try:
                degrees[name] = int(value)
            except ValueError:
                raise ValueError(f"{item!r}: the size of {name} must be an integer") from None
        if not degrees:
            raise ValueError(f"an empty mesh: name at least one axis, e.g. 'dp=2 tp=2' ({HELP})")
        named = tuple(a for a in AXES if a in degrees)
        return cls(**degrees, named=named)

    @property
    def size(self) -> int:
        return math.prod(getattr(self, a) for a in AXES)

    def axes(self) -> dict[str, int]:
        """The axes on the mesh, in order: those of size > 1 plus those named explicitly."""
        kept = {a: getattr(self, a) for a in AXES if getattr(self, a) > 1 or a in self.named}
        return kept or {"dp_shard": 1}

    def check(self, world_size: int) -> None:
        """Raise unless the degrees multiply to the world size."""
        if self.size != world_size:
            sizes = " x ".join(f"{a}={n}" for a, n in self.axes().items())
            raise ValueError(f"{sizes} = {self.size}, but the cluster has {world_size} ranks: "
                             f"make the product {world_size} (or start {self.size} ranks)")

    def mesh_axes(self) -> dict[str, int]:
        """The DeviceMesh's own dimensions; with ep, dp_shard is split in two (torchtitan)."""
        axes = self.axes()
        if self.ep == 1:
            return axes
        in_ep = self.ep // self.cp  # ep takes the innermost dp_shard ranks and all of cp
        out: dict[str, int] = {}
        for a, n in axes.items():
            if a == "dp_shard":
                out["dp_shard_mod_ep"], out["dp_shard_in_ep"] = n // in_ep, in_ep
            else:
                out[a] = n
        return out

    def views(self) -> dict[str, tuple[str, ...]]:
        """Names a trainer asks for that span mesh dimensions, flattened on the mesh."""
        dims = self.mesh_axes()
        shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if self.ep > 1 else ("dp_shard",)
        wanted = {
            "dp_shard": shard,  # a view only when ep splits it
            "dp": ("dp_replicate", *shard),  # the batch is split over all of these
            "dp_shard_cp": (*shard, "cp"),  # FSDP shards parameters over these together
            "dp_cp": ("dp_replicate", *shard, "cp"),  # the loss is averaged over these
            "ep": ("dp_shard_in_ep", "cp"),
        }
        views = {}
        for name, span in wanted.items():
            present = tuple(d for d in span if d in dims)
            if name not in dims and present and (name != "ep" or self.ep > 1):
                views[name] = present
        return views

    def size_of(self, name: str) -> int:
        """The degree of axis or view ``name`` (1 where the mesh has none), as ``axis_size``
        reads it off a built mesh: arithmetic only, for checking a plan without ranks."""
        if name not in AXES and name not in VIEWS:
            raise ValueError(f"unknown mesh axis {name!r}: ask for one of "
                             f"{', '.join(AXES + VIEWS)}")
        dims, views = self.mesh_axes(), self.views()
        if name in dims:
            return dims[name]
        return math.prod(dims[d] for d in views[name]) if name in views else 1

    def shown_name(self, name: str) -> str:
        """The name one of meshlab's own views is shown by: the axes it spans that have more
        than one rank, joined by "+" (FSDP's "dp_shard_cp" without cp is "dp_shard", the name
        the mesh table gives it; with cp=2, "dp_shard+cp"). Any other name as it is: an axis,
        a name one says (dp, ep), or a mesh of one's own that happens to share it."""
        views, dims = self.views(), self.mesh_axes()
        if name not in views or name not in INTERNAL_VIEWS:
            return name
        spanned = [d for d in views[name] if dims.get(d, 1) > 1] or list(views[name][:1])
        return "+".join(spanned)

    def groups(self) -> dict[str, list[list[int]]]:
        """Every axis and view with its process groups as rank lists (pure arithmetic)."""
        dims = self.mesh_axes()
        names, shape = list(dims), list(dims.values())
        spans = {name: (name,) for name in names} | self.views()
        return {name: _groups(shape, [names.index(d) for d in span])
                for name, span in spans.items()}

    def coordinates_of(self, rank: int) -> dict[str, int]:
        """{mesh dimension: index} of one rank (``coordinates`` gives every rank's)."""
        dims = self.mesh_axes()
        return {d: rank // stride % n for d, n, stride in zip(dims, dims.values(),
                                                               self._strides(), strict=True)}

    def group_of(self, rank: int, span: tuple[str, ...]) -> list[int]:
        """The ranks that differ from ``rank`` only along the mesh dimensions ``span``
        (row-major, as ``groups`` lists them all; this one costs no more at 16,384 ranks)."""
        strides = dict(zip(self.mesh_axes(), self._strides(), strict=True))
        coords = self.coordinates_of(rank)
        group = [rank - sum(coords[d] * strides[d] for d in span)]
        for d in span:
            group = [g + k * strides[d] for g in group for k in range(self.mesh_axes()[d])]
        return sorted(group)

    def _strides(self) -> list[int]:
        sizes = list(self.mesh_axes().values())
        return [math.prod(sizes[i + 1:]) for i in range(len(sizes))]

    def __str__(self) -> str:
        parts = [f"{a}={n}" for a, n in self.axes().items()]
        return " ".join(parts + ([f"ep={self.ep}"] if self.ep > 1 else []))


def _groups(shape: list[int], dims: list[int]) -> list[list[int]]:
    """Ranks that differ only along ``dims`` of a row-major grid of ``shape``."""
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    others = [i for i in range(len(shape)) if i not in dims]
    groups = []
    for fixed in _coords([shape[i] for i in others]):
        base = sum(c * strides[i] for c, i in zip(fixed, others, strict=True))
        groups.append(sorted(base + sum(c * strides[i] for c, i in zip(var, dims, strict=True))
                             for var in _coords([shape[i] for i in dims])))
    return sorted(groups)


def _coords(shape: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for n in shape:
        out = [(*c, i) for c in out for i in range(n)]
    return out


def coordinates(spec: MeshSpec) -> dict[int, dict[str, int]]:
    """rank -> {axis: index} on the mesh (pure arithmetic, no process group)."""
    axes = spec.mesh_axes()
    return {rank: dict(zip(axes, coord, strict=True))
            for rank, coord in enumerate(_coords(list(axes.values())))}


def hosts_spanned(spec: MeshSpec, host_of: list[str]) -> dict[str, int]:
    """Axis (and ep) -> how many hosts its widest group spans, given each rank's host."""
    groups = spec.groups()
    named = [*spec.axes(), *(["ep"] if spec.ep > 1 else [])]
    return {axis: max(len({host_of[r] for r in g}) for g in groups[axis])
            for axis in named if axis in groups}


def crossing_hosts(spec: MeshSpec, host_of: list[str]) -> list[str]:
    """What a user should know of the axes whose groups leave a host: the network carries
    their collectives. Empty on one host."""
    if len(set(host_of)) < 2:
        return []
    per_host = max(host_of.count(h) for h in set(host_of))
    notes = []
    for axis, hosts in hosts_spanned(spec, host_of).items():
        if hosts < 2:
            continue
        size = getattr(spec, axis)
        note = f"{axis}={size} spans {hosts} hosts: its collectives cross the network"
        if axis in ("tp", "ep", "cp"):  # a collective in every layer: keep it on the host
            note += (f", in every layer; {axis} <= {per_host} (ranks per host) keeps it on one"
                     if size > per_host else
                     f", in every layer; tp x {axis} = {spec.tp * size} > {per_host} ranks per "
                     f"host: a smaller tp or {axis} keeps both on one")
        notes.append(note)
    return notes


def axis_size(mesh: DeviceMesh, name: str) -> int:
    """The size of axis or view ``name`` on ``mesh``: 1 when the mesh does not have it (a
    run without tp has tp=1); a name that is neither an axis nor a view raises."""
    if name not in AXES and name not in VIEWS:
        raise ValueError(f"unknown mesh axis {name!r}: ask for one of "
                         f"{', '.join(AXES + VIEWS)}")
    try:
        return int(mesh[name].size())
    except (KeyError, RuntimeError, ValueError):  # a known name this mesh does not have
        return 1


_built: dict[str, tuple[object, DeviceMesh]] = {}
"""spec -> (the default group it was built on, the mesh): see build."""


def build(spec: MeshSpec | str) -> DeviceMesh:
    """The named DeviceMesh on this rank (call it on every rank), with its flattened views.

    The same spec on the same default group gives the same mesh: torch never frees a
    mesh's groups, and each holds threads (gloo's loop polls), so a notebook re-running
    ``%mesh init`` would pile them up.
    """
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from meshlab import runtime

    runtime.before_reform(forget_built)
    spec = MeshSpec.parse(spec) if isinstance(spec, str) else spec
    spec.check(dist.get_world_size())
    built = _built.get(repr(spec))
    if built is not None and built[0] is dist.group.WORLD:
        return built[1]
    dims = spec.mesh_axes()
    mesh = init_device_mesh(runtime.device().type, tuple(dims.values()),
                            mesh_dim_names=tuple(dims))
    for view, span in spec.views().items():
        mesh[span]._flatten(view)
    # mesh["dp"] on a flattened view is the contract; torch only warns that it may change.
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    _built[repr(spec)] = (dist.group.WORLD, mesh)
    return mesh


def forget_built() -> None:
    """Before the default group goes: its meshes must not outlive it here."""
    _built.clear()
