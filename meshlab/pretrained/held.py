"""What a rank holds of a model, as a save_pretrained folder names it: the plain model's
names of its parameters and persistent buffers, under DDP and FSDP2 alike."""

from __future__ import annotations

import torch
from torch import nn

from meshlab.parallel.blocks import clean_name


def unwrap(model: nn.Module) -> nn.Module:
    """The model under DDP."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def reshard_all(model: nn.Module) -> None:
    """FSDP2 keeps a root gathered after a forward without backward: shards first (with a pp
    axis the stage roots live in the pipeline's stages)."""
    from meshlab.measure.memory import reshard

    reshard(model)
    pipeline = getattr(unwrap(model), "pipeline", None)
    for stage in getattr(pipeline, "stages", {}).values():
        reshard(stage.submod)


def held_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[list[str]]]:
    """Every name (plain model's) of the parameters and persistent buffers this rank holds, and
    the names of each one tensor (a tied weight has several)."""
    names: dict[str, torch.Tensor] = {}
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[clean_name(name)] = p
        by_id.setdefault(id(p), []).append(clean_name(name))
    for owner, module in model.named_modules(remove_duplicate=False):
        for leaf, b in module._buffers.items():
            if b is not None and leaf not in module._non_persistent_buffers_set:
                name = clean_name(f"{owner}.{leaf}" if owner else leaf)
                names[name] = b
                by_id.setdefault(id(b), []).append(name)
    return names, [list(dict.fromkeys(g)) for g in by_id.values()]


def model_class(inner: nn.Module) -> str:
    """The model's own class name (FSDP2 puts a subclass ``FSDP<name>`` over it)."""
    return model_class_of(inner).__name__


def model_class_of(module: nn.Module) -> type[nn.Module]:
    """A module's own class, under the subclass FSDP2 puts over it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return type(module)
    return next(c for c in type(module).__mro__
                if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
"""A save_pretrained folder's weights: one file, or shards and their index."""
