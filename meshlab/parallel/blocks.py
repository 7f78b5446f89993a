"""The repeated blocks of a model: what FSDP shards one by one and checkpointing wraps.

Any model built of repeated blocks works: meshlab's Transformer (``layers``), a Hugging Face
model (``model.layers``; its ``_no_split_modules`` names the block class), torchtitan's
(``layers``), or one written in a cell. The blocks are found as the ModuleList or
ModuleDict whose children are all of one class (the block class transformers names first,
else the one holding the most parameters), or taken from ``ParallelPlan(blocks="path")``.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

Blocks = nn.ModuleList | nn.ModuleDict


class PassThrough(nn.Module):
    """Stands in for a block (or a norm) another pipeline stage holds: hands its first input
    on, first of a ``width``-tuple (the rest None) where the blocks it stands for return
    tuples (Falcon reads ``outputs[0]``, Bamba unpacks two); the blocks around it keep their
    indices."""

    def __init__(self, width: int = 0) -> None:
        super().__init__()
        self.width = width

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else next(iter(kwargs.values()))
        return (x, *[None] * (self.width - 1)) if self.width else x


def owner_of(model: nn.Module) -> nn.Module:
    """The model a pipeline stage came from (its config, plans and class names), or the model
    itself."""
    return model.__dict__.get("causal_lm", model)


def find_blocks(model: nn.Module, path: str | None = None) -> tuple[str, Blocks]:
    """``(path, container)`` of the model's repeated blocks; ValueError says what it looked
    for and the argument that fixes it."""
    if path is not None:
        return path, _at(model, path)
    # transformers' block classes (a pipeline stage's: the model it came from)
    named = set(getattr(owner_of(model), "_no_split_modules", None) or ())
    # one block class, or several that transformers names (Jamba's attention and Mamba blocks)
    candidates = {name: m for name, m in model.named_modules() if isinstance(m, Blocks)
                  and (len(_own(m)) == 1 or {c.__name__ for c in _own(m)} <= named != set())}
    if not candidates:
        raise ValueError(f"found no repeated blocks in {type(model).__name__} (looked for a "
                         "ModuleList or ModuleDict of one block class): name them with "
                         "ParallelPlan(blocks='path.to.layers')")
    preferred = {n: m for n, m in candidates.items()
                 if {c.__name__ for c in _own(m)} <= named}
    pool = preferred or candidates
    return max(pool.items(), key=lambda item: sum(p.numel() for p in item[1].parameters()))


def items(blocks: Blocks) -> list[tuple[str | int, nn.Module]]:
    """``(key, block)`` pairs, where ``blocks[key] = wrapped`` replaces a block in place (a
    pipeline stage's pass-throughs left out)."""
    pairs = blocks.items() if isinstance(blocks, nn.ModuleDict) else enumerate(blocks)
    return [(key, block) for key, block in pairs if not isinstance(block, PassThrough)]


def _own(blocks: Blocks) -> set[type]:
    """The classes of the blocks this stage holds (pass-throughs stand for others')."""
    return {type(c) for c in blocks.children() if not isinstance(c, PassThrough)}


def shallow_copy(module: Any) -> Any:
    """A copy of ``module`` sharing its parts, with its own child tables and hook registries
    (what one pipeline stage swaps or attaches must not reach the model or another stage)."""
    clone = copy.copy(module)
    for key, value in vars(module).items():
        if key.startswith("_") and isinstance(value, dict | set):
            clone.__dict__[key] = copy.copy(value)
    return clone


def clean_name(name: str) -> str:
    """The plain model's name of a parameter seen through DDP or checkpoint wrappers."""
    name = name.replace("_checkpoint_wrapped_module.", "")
    return name.removeprefix("module.")


def holds(model: nn.Module, path: str) -> bool:
    """Whether ``model`` has a module at ``path`` (a pipeline stage lacks some)."""
    try:
        return model.get_submodule(path) is not None
    except AttributeError:
        return False


def _at(model: nn.Module, path: str) -> Blocks:
    module: nn.Module = model
    for i, part in enumerate(path.split(".")):
        child = getattr(module, part, None) if part else None
        if not isinstance(child, nn.Module):
            where = ".".join(path.split(".")[:i]) or type(model).__name__
            found = [n for n, m in model.named_modules() if isinstance(m, Blocks)]
            raise ValueError(f"ParallelPlan(blocks={path!r}): {where} has no module {part!r}; "
                             f"the model's ModuleLists/ModuleDicts are: "
                             f"{', '.join(found) or 'none'}")
        module = child
    if not isinstance(module, Blocks):
        raise ValueError(f"ParallelPlan(blocks={path!r}) is a {type(module).__name__}, not a "
                         "ModuleList or ModuleDict of blocks: name the container of the blocks")
    return module
