"""load_pretrained: a save_pretrained folder straight into this rank's shards (the
package's docstring says how each tensor is read)."""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.parallel.blocks import clean_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from meshlab.pretrained.held import INDEX, SINGLE, held_tensors, model_class, reshard_all, unwrap

_Read = Callable[[tuple[slice, ...]], torch.Tensor]


@dataclass(slots=True)
class _Piece:
    """Part of a target tensor stored elsewhere: the box ``[start, stop)`` per target dim that
    ``read(slices within the box)`` gives; ``stacked``: the source lacks the box's dim 0 (one
    expert of a stacked weight)."""

    read: _Read
    box: list[tuple[int, int]]
    stacked: bool = False
    key: str = ""


@dataclass(slots=True)
class _Group:
    """A transformers conversion meshlab does not read in slices: its sources, read whole."""

    converter: Any
    target: str
    sources: list[tuple[str, str]] = field(default_factory=list)  # (pattern, file key)


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
        sources, fallbacks, unexpected = _map_keys(inner, handles, names)
        ep = ep_place(mesh)
        for name, tensor, source in _match(inner, names, groups, sources, fallbacks,
                                           unexpected, folder):
            pieces = sources.get(source)
            if pieces is None:  # a conversion run whole: its target, in memory
                full = fallbacks[source]()
                pieces = [_Piece(full.__getitem__, [(0, n) for n in full.shape], key=source)]
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


def _conversions(inner: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters for this model, as from_pretrained applies them."""
    if not hasattr(inner, "config") or not hasattr(inner, "base_model_prefix"):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    transforms = get_model_conversion_mapping(inner)  # type: ignore[arg-type]
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


def _map_keys(inner: nn.Module, handles: dict[str, Any], names: dict[str, torch.Tensor]
              ) -> tuple[dict[str, list[_Piece]], dict[str, Callable[[], torch.Tensor]], list[str]]:
    """The file's keys as the model's names, as from_pretrained maps them: {name: pieces},
    {name: a conversion read whole}, and the keys that are no name of the model (nor of a
    part another pipeline stage holds)."""
    keys = {k: f for f, handle in handles.items() for k in handle.keys()}  # noqa: SIM118
    aliases = dict(getattr(inner, "all_tied_weights_keys", None) or {})
    # a pipeline's copy of a tied head reads the embedding, which another stage holds
    wanted = set(names) | {aliases[n] for n in names if n in aliases}
    renamings, converters = _conversions(inner)
    prefix = getattr(inner, "base_model_prefix", "") or ""
    elsewhere = _elsewhere(inner) if getattr(inner, "pipeline", None) is not None else None
    sources: dict[str, list[_Piece]] = {}
    merged: dict[str, tuple[Any, dict[int, dict[int, str]]]] = {}
    groups: dict[str, _Group] = {}
    unexpected: list[str] = []

    def reader(key: str) -> _Read:
        handle = handles[keys[key]]
        return lambda s: handle.get_slice(key)[s] if s else handle.get_tensor(key)

    def shape(key: str) -> tuple[int, ...]:
        return tuple(handles[keys[key]].get_slice(key).get_shape())

    def foreign(target: str) -> bool:
        return elsewhere is None or not elsewhere(target)

    for key in sorted(keys, key=natural_order):
        if key in wanted:
            sources[key] = [_Piece(reader(key), [(0, n) for n in shape(key)], key=key)]
            continue
        renamed = key
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        for converter in converters:
            target, pattern = converter.rename_source_key(renamed)
            if pattern is not None:
                break
        else:
            target, pattern, converter = renamed, None, None
        if converter is not None and pattern is not None:
            match = re.search(pattern.replace("*.", r"(\d+)\."), renamed)
            if _sliceable(converter) and match and match.groups():
                by_pattern = merged.setdefault(target, (converter, {}))[1]
                index = converter.source_patterns.index(pattern)
                by_pattern.setdefault(index, {})[int(match.group(1))] = key
            else:
                groups.setdefault(target, _Group(converter, target)).sources.append((pattern, key))
            continue
        if target not in wanted and prefix:  # a base model's keys into a head model, or back
            bare, longer = target.removeprefix(f"{prefix}."), f"{prefix}.{target}"
            target = bare if bare in wanted else longer if longer in wanted else target
        if target in wanted:
            sources[target] = [_Piece(reader(key), [(0, n) for n in shape(key)], key=key)]
        elif foreign(target):
            unexpected.append(key)
    for target, (converter, by_pattern) in merged.items():
        if target in wanted:
            sources[target] = _stacked_pieces(converter, by_pattern, reader, shape)
        elif foreign(target):
            unexpected += [k for experts in by_pattern.values() for k in experts.values()]
    fallbacks: dict[str, Callable[[], torch.Tensor]] = {}
    for group in groups.values():
        produced = _run_group(inner, group, reader)
        for target in produced.names:
            if target in wanted:
                fallbacks[target] = produced.get(target)
            elif foreign(target):
                unexpected += [k for _, k in group.sources]
    return sources, fallbacks, sorted(set(unexpected), key=natural_order)


def natural_order(key: str) -> list[tuple[int, int, str]]:
    """Sort key: layer 10 after layer 9."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in key.split(".")]


def _sliceable(converter: Any) -> bool:
    """Per-expert keys stacked on dim 0, then maybe concatenated (gate and up): what
    MoE checkpoints need, read here expert by expert in slices."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    return ops[:1] == [("MergeModulelist", 0)] and (
        len(ops) == 1 or (len(ops) == 2 and ops[1][0] == "Concatenate" and (ops[1][1] or 0) >= 1))


def _stacked_pieces(converter: Any, by_pattern: dict[int, dict[int, str]],
                    reader: Callable[[str], _Read], shape: Callable[[str], tuple[int, ...]]
                    ) -> list[_Piece]:
    """Pieces of a stacked experts weight: expert e of source pattern p is box
    ``[e, e + 1)`` on dim 0 and its share of the concatenated dim."""
    concat = converter.operations[1].dim if len(converter.operations) > 1 else None
    counts = {len(experts) for experts in by_pattern.values()}
    experts = sorted(next(iter(by_pattern.values())))
    if len(counts) != 1 or experts != list(range(len(experts))) or \
            len(by_pattern) != len(converter.source_patterns):
        keys = sorted(k for e in by_pattern.values() for k in e.values())
        raise ValueError(f"the folder holds experts {_few(keys)} of "
                         f"{converter.source_patterns} unevenly (each needs experts 0..E-1): it "
                         "is incomplete; copy the whole folder again")
    pieces, offset = [], 0
    for p in sorted(by_pattern):
        shapes = {shape(k) for k in by_pattern[p].values()}
        if len(shapes) != 1:
            raise ValueError(f"the experts of {converter.source_patterns[p]} in the folder have "
                             f"different shapes {sorted(shapes)}: it does not hold one model")
        size = shapes.pop()
        for e, key in by_pattern[p].items():
            box = [(e, e + 1)] + [(0, n) for n in size]
            if concat is not None:
                box[concat] = (offset, offset + size[concat - 1])
            pieces.append(_Piece(reader(key), box, stacked=True, key=key))
        offset += size[concat - 1] if concat is not None else 0
    return pieces


@dataclass(slots=True)
class _Produced:
    """The targets of a conversion read whole, and for each a call that gives it."""

    names: list[str]
    get: Callable[[str], Callable[[], torch.Tensor]]


def _run_group(inner: nn.Module, group: _Group, reader: Callable[[str], _Read]) -> _Produced:
    """A conversion read whole: transformers' converter runs on its sources (once, when the
    first of its targets is loaded), as from_pretrained runs it."""
    converter = copy.deepcopy(group.converter)
    targets = [group.target]
    if len(converter.target_patterns) > 1:  # one source to several targets (a qkv split)
        first = converter.target_patterns[0]
        targets = [group.target.replace(first, t) for t in converter.target_patterns]
    cache: dict[str, torch.Tensor] = {}

    def get(target: str) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            if not cache:
                for pattern, key in sorted(group.sources, key=lambda s: natural_order(s[1])):
                    converter.add_tensor(group.target, key, pattern, partial(reader(key), ()))
                out = converter.convert(group.target, model=inner,
                                        config=getattr(inner, "config", None))
                cache.update({k: v[0] if isinstance(v, list) else v for k, v in out.items()})
            return cache.pop(target)
        return run

    return _Produced(targets, get)


def _elsewhere(inner: nn.Module) -> Callable[[str], bool]:
    """Whether a name belongs to a part another pipeline stage holds: a part this stage set to
    None or a pass-through, or a block missing from its dict of blocks."""
    from meshlab.parallel.blocks import PassThrough

    modules = {clean_name(n): m for n, m in inner.named_modules()}

    def test(name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts) - 1):
            module = modules.get(".".join(parts[:i]))
            if module is None:
                return False
            if isinstance(module, PassThrough):
                return True
            child = parts[i]
            if child in module._modules and module._modules[child] is None:
                return True
            if isinstance(module, nn.ModuleDict) and child not in module._modules \
                    and child.isdigit():
                return True
        return False

    return test


def _match(inner: nn.Module, names: dict[str, torch.Tensor], groups: list[list[str]],
           sources: dict[str, list[_Piece]], fallbacks: dict[str, Any], unexpected: list[str],
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
                         f"{model_class(inner)} has no place for: {_few(unexpected)}: the "
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
                         f"{model_class(inner)}'s tensors: {_few(missing)}: the folder was "
                         f"saved from another model or config{where}; build the model from its "
                         "config (AutoConfig.from_pretrained(folder)), or pass the folder of "
                         "this model")
    return todo


def _few(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


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


def _fill(tensor: torch.Tensor, pieces: list[_Piece], key: str, folder: Path,
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


def _box_shape(pieces: list[_Piece]) -> tuple[int, ...]:
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
