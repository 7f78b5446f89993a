"""load_pretrained: a save_pretrained folder straight into this rank's shards (the
package's docstring says how each tensor is read)."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.pretrained.held import INDEX, SINGLE, held_tensors, model_class, reshard_all, unwrap
from meshlab.pretrained.keys import Piece, few, map_keys

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def load_pretrained(model: nn.Module, folder: str | os.PathLike[str], *,
                    mesh: DeviceMesh | None = None) -> None:
    """Fill ``model`` (parallelized or not) with the weights of a ``save_pretrained`` folder,
    each rank reading only what its shards hold, cast to each tensor's dtype; no
    communication. A tensor the folder lacks (a tied head is its embedding), a key the model
    has no place for (another pipeline stage's are skipped) or a shape that differs raises
    ValueError naming them and the fix. ``mesh``: places expert slices that carry no mark of
    parallelize's (made outside it, or materialized from meta, which drops the mark)."""
    folder = Path(folder)
    inner = unwrap(model)
    reshard_all(model)
    with _opened(_weight_files(folder)) as handles:
        names, groups = held_tensors(model)
        sources, fallbacks, unexpected = map_keys(inner, handles, names)
        ep = ep_place(mesh)
        for name, tensor, source in _match(inner, names, groups, sources, fallbacks,
                                           unexpected, folder):
            pieces = sources.get(source)
            if pieces is None:  # a conversion run whole: its target, in memory
                full = fallbacks[source]()
                pieces = [Piece(full.__getitem__, [(0, n) for n in full.shape], key=source)]
            _fill(tensor, pieces, name, folder, ep)


@contextmanager
def _opened(files: dict[str, Path]) -> Iterator[dict[str, Any]]:
    """Every file of the folder open (memory-mapped: a rank touches only what it reads)."""
    from safetensors import safe_open

    handles = {name: safe_open(str(path), framework="pt") for name, path in files.items()}
    try:
        yield handles
    finally:
        handles.clear()  # unmapped: the pages a rank touched leave its memory


def _weight_files(folder: Path) -> dict[str, Path]:
    """The safetensors files of a ``save_pretrained`` folder; ValueError naming what is there."""
    if not folder.is_dir():
        raise ValueError(f"no folder {folder}: pass the folder save_pretrained wrote (it holds "
                         f"{SINGLE} or {INDEX})")
    if (folder / INDEX).is_file():
        index = json.loads((folder / INDEX).read_text())
        names = sorted(set(index.get("weight_map", {}).values()))
        gone = [n for n in names if not (folder / n).is_file()]
        if gone or not names:
            raise ValueError(f"{folder / INDEX} names shards {gone or names} that are not in "
                             f"{folder}: copy the whole folder, every shard with its index")
        return {n: folder / n for n in names}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if found:
        return {n: folder / n for n in found}
    there = sorted(p.name for p in folder.iterdir())[:8]
    raise ValueError(f"no safetensors weights in {folder} (looked for {SINGLE} or {INDEX}; it "
                     f"holds {', '.join(there) or 'nothing'}): save the model with "
                     "save_pretrained(folder), whose default is safetensors (a pytorch_model.bin "
                     "folder: load it once with from_pretrained and save it again)")


def _match(inner: nn.Module, names: dict[str, torch.Tensor], groups: list[list[str]],
           sources: dict[str, list[Piece]], fallbacks: dict[str, Any], unexpected: list[str],
           folder: Path) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, the name its weights are under) for each tensor this rank holds; a
    ValueError naming the keys when the folder and the model do not fit."""
    aliases = dict(getattr(inner, "all_tied_weights_keys", None) or {})  # head -> embedding
    ignore_missing = getattr(inner, "_keys_to_ignore_on_load_missing", None) or ()
    ignore_unexpected = getattr(inner, "_keys_to_ignore_on_load_unexpected", None) or ()
    unexpected = [k for k in unexpected if not any(re.search(p, k) for p in ignore_unexpected)]
    where = _describe(folder)
    if unexpected:
        raise ValueError(f"{folder} holds {len(unexpected)} tensors this "
                         f"{model_class(inner)} has no place for: {few(unexpected)}: the "
                         f"folder was saved from another model{where}; build the model from "
                         "its config (AutoConfig.from_pretrained(folder)), or pass the folder "
                         "of this model")
    todo, missing = [], []
    for group in groups:
        found = [n for n in group if n in sources or n in fallbacks]
        found += [aliases[n] for n in group if aliases.get(n) in sources
                  or aliases.get(n) in fallbacks]
        if found:
            todo.append((group[0], names[group[0]], found[0]))
        elif not any(re.search(p, n) for p in ignore_missing for n in group):
            missing.append(group[0])
    if missing:
        raise ValueError(f"{folder} has no weights for {len(missing)} of this "
                         f"{model_class(inner)}'s tensors: {few(missing)}: the folder was "
                         f"saved from another model or config{where}; build the model from its "
                         "config (AutoConfig.from_pretrained(folder)), or pass the folder of "
                         "this model")
    return todo


def _describe(folder: Path) -> str:
    """`` (config.json: LlamaForCausalLM)``: what the folder says it holds."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return ""
    kind = (config.get("architectures") or [config.get("model_type")])[0]
    return f" ({folder.name}/config.json: {kind})" if kind else ""


def ep_place(mesh: DeviceMesh | None) -> tuple[int, int] | None:
    """(place, size) of this rank on the mesh's ep axis, for slices no parallelize marked."""
    from meshlab.mesh import axis_size

    if mesh is None or axis_size(mesh, "ep") < 2:
        return None
    return mesh["ep"].get_local_rank(), mesh["ep"].size()


def _fill(tensor: torch.Tensor, pieces: list[Piece], key: str, folder: Path,
          ep: tuple[int, int] | None) -> None:
    """Copy this rank's part of the pieces' target into ``tensor``'s local storage."""
    from torch.distributed.tensor import DTensor

    from meshlab.parallel.clip import PARTS

    full = _box_shape(pieces)
    shape = tuple(tensor.shape)  # a DTensor's global shape; an expert slice's own
    rows = 0
    group = getattr(tensor, PARTS, None)
    if group is not None and shape and full and shape[0] != full[0]:
        size = dist.get_world_size(group)
        rows = dist.get_rank(group) * shape[0]
        shape = (shape[0] * size, *shape[1:])
    elif ep is not None and shape and full and shape[0] * ep[1] == full[0] and \
            shape[1:] == full[1:]:
        rows, shape = ep[0] * shape[0], (full[0], *shape[1:])
    if shape != full:
        where = f"{pieces[0].key}" if len(pieces) == 1 else f"{key} (from {len(pieces)} keys)"
        raise ValueError(f"{where} in {folder} is {tuple(full)}, but the model's {key} is "
                         f"{shape}: the folder was saved with another config; build the "
                         "model from its config (AutoConfig.from_pretrained(folder))")
    held = _held(tensor, rows)
    with torch.no_grad():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor  # its storage
        if local.is_meta:
            raise ValueError(f"{key} is on the meta device, with no memory to load into: "
                             "parallelize the model first (it gives each rank's shards "
                             "memory), or call model.to_empty(device=...)")
        if tuple(local.shape) != tuple(sum(b - a for a, b, _ in runs) for runs in held):
            placements = getattr(tensor, "placements", None)
            raise ValueError(f"{key}'s local part {tuple(local.shape)} is not what its layout "
                             f"{placements} gives for {shape}: a layout meshlab cannot read "
                             "into; load the model unsharded and shard it after")
        for piece in pieces:
            cuts = []
            for d, runs in enumerate(held):
                lo, hi = piece.box[d]
                cut = [(max(a, lo), min(b, hi), at + max(a, lo) - a) for a, b, at in runs
                       if max(a, lo) < min(b, hi)]
                cuts.append(cut)
            for combo in itertools.product(*cuts):
                src = tuple(slice(a - piece.box[d][0], b - piece.box[d][0])
                            for d, (a, b, _) in enumerate(combo))
                dst = tuple(slice(at, at + b - a) for a, b, at in combo)
                block = piece.read(src[1:] if piece.stacked else src)
                local[dst].copy_(block.unsqueeze(0) if piece.stacked else block)


def _box_shape(pieces: list[Piece]) -> tuple[int, ...]:
    """The target's shape: the boxes' extent."""
    dims = len(pieces[0].box)
    return tuple(max(p.box[d][1] for p in pieces) for d in range(dims))


def _held(tensor: torch.Tensor, rows: int) -> list[list[tuple[int, int, int]]]:
    """Per dim of the target: the runs ``(global start, global stop, local start)`` this rank
    holds; ``rows``: where an expert slice starts in dim 0."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(tensor, DTensor):
        return [[(rows if d == 0 else 0, (rows if d == 0 else 0) + n, 0)]
                for d, n in enumerate(tensor.shape)]
    held = []
    for d, n in enumerate(tensor.shape):
        along: list[Any] = []
        for p in tensor.placements:
            if isinstance(p, Shard | _StridedShard) and p.dim % tensor.ndim == d:
                along.append(_StridedShard(0, split_factor=p.split_factor)
                             if isinstance(p, _StridedShard) else Shard(0))
            else:
                along.append(Replicate())
        index = torch.arange(n)
        if any(not isinstance(p, Replicate) for p in along):
            index = distribute_tensor(index, tensor.device_mesh, along,
                                      src_data_rank=None).to_local().cpu()
        held.append(_runs(index + (rows if d == 0 else 0)))
    return held


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of increasing indices: ``(start, stop, position in index)``."""
    if index.numel() == 0:
        return []
    breaks = (torch.nonzero(index.diff() != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    stops = [*breaks, index.numel()]
    return [(int(index[s]), int(index[e - 1]) + 1, s) for s, e in zip(starts, stops, strict=True)]
