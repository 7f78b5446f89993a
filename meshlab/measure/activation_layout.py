"""Where each tensor-parallel rank's part of the activations lies, as one forward runs.

Runs on the ranks. ``activation_layouts`` records the input of every module that receives
a DTensor on the tensor-parallel axis, as the module sees it (after its parallel style has
laid the input out: a sequence-parallel norm gets its slice of the sequence, a
column-parallel projection the whole sequence, a row-parallel one its slice of the
features). Each record is a ``meshlab.measure.sharding.ShardingReport``: the global shape, the
placements and every rank's piece, computed from the placements, so one rank's records
describe its whole tp group. The notebook draws them (``meshlab.notebook.activation_chart``).
"""

from __future__ import annotations

import re
from typing import Any, cast

import torch
from torch import nn

from meshlab.measure.memory import reshard
from meshlab.measure.sharding import ShardingReport, describe

__all__ = ["activation_layouts"]


def activation_layouts(model: nn.Module, *inputs: Any, axis: str = "tp",
                       every_block: bool = False) -> list[ShardingReport]:
    """The layout of each module's input over mesh axis ``axis`` during one forward of
    ``model`` on ``inputs`` (no gradients kept), in the order the forward reaches them,
    each named for its module. A module whose input is a plain tensor (its layout lost to
    ``to_local()``) is left out. ``every_block=False`` keeps the first of the repeated
    blocks only (``layers.1.attention`` repeats ``layers.0.attention``)."""
    from torch.distributed.tensor import DTensor

    seen: set[str] = set()
    reports: list[ShardingReport] = []

    def record(name: str) -> Any:
        def hook(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            first = args[0] if args else next(iter(kwargs.values()), None)
            if not isinstance(first, DTensor) or axis not in (
                    first.device_mesh.mesh_dim_names or ()):
                return
            pattern = re.sub(r"\.\d+(?=\.|$)", ".*", name)
            if not every_block and pattern in seen:
                return
            seen.add(pattern)
            reports.append(cast(ShardingReport, describe(first, name)))  # a DTensor's
        return hook

    # appended after the parallel styles' own input hooks: the input as the module gets it
    handles = [m.register_forward_pre_hook(record(n), with_kwargs=True)
               for n, m in model.named_modules() if n]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
        reshard(model)  # a forward without backward leaves FSDP2's root gathered
    return reports
