"""Which key of a save_pretrained folder feeds which tensor of the model: transformers' own
renamings and converters, per-expert MoE keys read into stacked experts slice by slice, and
the keys another pipeline stage holds."""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from meshlab.parallel.blocks import clean_name
from meshlab.pretrained.held import model_class_of

Read = Callable[[tuple[slice, ...]], torch.Tensor]
"""Reads a box of one file tensor: its slices -> the tensor there."""


@dataclass(slots=True)
class Piece:
    """Part of a target tensor stored elsewhere: the box ``[start, stop)`` per target dim that
    ``read(slices within the box)`` gives; ``stacked``: the source lacks the box's dim 0 (one
    expert of a stacked weight)."""

    read: Read
    box: list[tuple[int, int]]
    stacked: bool = False
    key: str = ""


@dataclass(slots=True)
class Group:
    """A transformers conversion meshlab does not read in slices: its sources, read whole."""

    converter: Any
    target: str
    sources: list[tuple[str, str]] = field(default_factory=list)  # (pattern, file key)


def _conversions(inner: nn.Module) -> tuple[list[Any], list[Any]]:
    """transformers' renamings and converters for this model, as from_pretrained applies them."""
    if not hasattr(inner, "config") or not hasattr(inner, "base_model_prefix"):
        return [], []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:
        return [], []
    with _own_classes(inner):
        transforms = get_model_conversion_mapping(inner)  # type: ignore[arg-type]
    return ([t for t in transforms if isinstance(t, WeightRenaming)],
            [t for t in transforms if isinstance(t, WeightConverter)])


@contextlib.contextmanager
def _own_classes(model: nn.Module) -> Iterator[None]:
    """Inside, every module FSDP2 wrapped has its own class again: transformers looks its key
    renamings up by class name, and FSDP2's ``FSDPGPTNeoXForCausalLM`` has none (a ZeRO-2/3
    GPT-NeoX refused its own checkpoint: "has no place for: embed_out.weight")."""
    swapped = []
    for module in model.modules():
        own = model_class_of(module)
        if own is not type(module):
            swapped.append((module, type(module)))
            module.__class__ = own
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def map_keys(inner: nn.Module, handles: dict[str, Any], names: dict[str, torch.Tensor]
              ) -> tuple[dict[str, list[Piece]], dict[str, Callable[[], torch.Tensor]], list[str]]:
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
    sources: dict[str, list[Piece]] = {}
    merged: dict[str, tuple[Any, dict[int, dict[int, str]]]] = {}
    groups: dict[str, Group] = {}
    unexpected: list[str] = []

    def reader(key: str) -> Read:
        handle = handles[keys[key]]
        return lambda s: handle.get_slice(key)[s] if s else handle.get_tensor(key)

    def shape(key: str) -> tuple[int, ...]:
        return tuple(handles[keys[key]].get_slice(key).get_shape())

    def foreign(target: str) -> bool:
        return elsewhere is None or not elsewhere(target)

    for key in sorted(keys, key=natural_order):
        if key in wanted:
            sources[key] = [Piece(reader(key), [(0, n) for n in shape(key)], key=key)]
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
                groups.setdefault(target, Group(converter, target)).sources.append((pattern, key))
            continue
        if target not in wanted and prefix:  # a base model's keys into a head model, or back
            bare, longer = target.removeprefix(f"{prefix}."), f"{prefix}.{target}"
            target = bare if bare in wanted else longer if longer in wanted else target
        if target in wanted:
            sources[target] = [Piece(reader(key), [(0, n) for n in shape(key)], key=key)]
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
                    reader: Callable[[str], Read], shape: Callable[[str], tuple[int, ...]]
                    ) -> list[Piece]:
    """Pieces of a stacked experts weight: expert e of source pattern p is box
    ``[e, e + 1)`` on dim 0 and its share of the concatenated dim."""
    concat = converter.operations[1].dim if len(converter.operations) > 1 else None
    counts = {len(experts) for experts in by_pattern.values()}
    experts = sorted(next(iter(by_pattern.values())))
    if len(counts) != 1 or experts != list(range(len(experts))) or \
            len(by_pattern) != len(converter.source_patterns):
        keys = sorted(k for e in by_pattern.values() for k in e.values())
        raise ValueError(f"the folder holds experts {few(keys)} of "
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
            pieces.append(Piece(reader(key), box, stacked=True, key=key))
        offset += size[concat - 1] if concat is not None else 0
    return pieces


@dataclass(slots=True)
class _Produced:
    """The targets of a conversion read whole, and for each a call that gives it."""

    names: list[str]
    get: Callable[[str], Callable[[], torch.Tensor]]


def _run_group(inner: nn.Module, group: Group, reader: Callable[[str], Read]) -> _Produced:
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


def few(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
