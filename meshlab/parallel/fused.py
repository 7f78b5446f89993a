"""Fused projections under tensor parallel: one nn.Linear whose output packs equal parts.

A nanoGPT-style attention computes q, k and v with one ``c_attn = nn.Linear(d, 3 * d)`` and
splits its output, ``q, k, v = self.c_attn(x).split(self.n_embd, dim=2)``; a fused MLP packs
gate and up, ``nn.Linear(d, 2 * ffn)`` then ``.chunk(2, -1)``. A plain column split would give
rank 0 all of q and half of k; ``FusedColwise(parts=3)`` gives each rank its 1/tp of each
part (the heads it owns of q, of k and of v), as meshlab.parallel.conv1d does for GPT-2's
packed Conv1D. The module that splits the output then holds 1/tp of the heads, so the sizes
its forward splits by are this rank's share too: ``LocalSizes("n_embd", "n_head")`` on that
module divides them by tp (as ``LocalSplit`` does GPT-2's ``split_size``). Whether the
module's forward then gives what it gave whole is proved on a probe batch before training
(meshlab.parallel.fused_proof), so a size it reads elsewhere is refused, not trained on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from meshlab.parallel.conv1d import LocalParameters, shard_parameter
from meshlab.parallel.tp_sums import SumInBackward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class FusedColwise(ParallelStyle):
    """Column-parallel nn.Linear packing ``parts`` equal blocks along its outputs (q, k, v:
    3; gate, up: 2): this rank's 1/tp of each block, in the block order, so the module's own
    ``split`` / ``chunk`` of the output gives this rank's slice of every part. The input is
    whole on every rank (its gradient summed over tp), the output this rank's part."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        if not isinstance(parts, int) or parts < 1:
            raise ValueError(f"FusedColwise(parts={parts!r}): expected the number of equal "
                             "blocks the projection packs (3 for q, k, v; 2 for gate, up)")
        self.parts = parts

    def __repr__(self) -> str:
        return f"FusedColwise(parts={self.parts})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor.placement_types import _StridedShard

        if not isinstance(module, nn.Linear):
            raise ValueError(f"FusedColwise(parts={self.parts}) takes an nn.Linear, not "
                             f"{type(module).__name__}: give GPT-2's Conv1D "
                             "meshlab.parallel.conv1d.Conv1DColwise(parts=...)")
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        if module.out_features % (self.parts * size):
            raise ValueError(f"FusedColwise(parts={self.parts}) on nn.Linear({module.in_features}"
                             f", {module.out_features}): {module.out_features} outputs are "
                             f"not {self.parts} parts that tp={size} divides: give the number "
                             "of equal parts it packs, and a tp that divides each part")
        placement = Shard(0) if self.parts == 1 else _StridedShard(0, split_factor=self.parts)
        shard_parameter(module, "weight", device_mesh, placement)
        if self.parts == 1:
            shard_parameter(module, "bias", device_mesh, Shard(0))
        # a packed bias stays whole, as Conv1DColwise's (FSDP's dim-0 split over a strided
        # one does not gather back): each rank adds its slices, the gradient summed over tp
        group, parts = device_mesh.get_group(), self.parts
        forward = module.forward

        def local_forward(x: torch.Tensor) -> torch.Tensor:
            local: dict[str, Any] = {}
            bias = module.bias
            if parts > 1 and bias is not None:
                whole = SumInBackward.apply(bias, group)
                local["bias"] = torch.cat([part.chunk(size)[rank] for part in whole.chunk(parts)])
            with LocalParameters(module, **local):
                return forward(SumInBackward.apply(x, group))

        cast(nn.Module, module).forward = local_forward
        return module


class LocalSizes(ParallelStyle):
    """The module that splits a fused projection's output holds 1/tp of its heads: the
    attributes its forward reads that size (nanoGPT's ``n_embd`` and ``n_head``) divided by
    tp. Sizes of one head (``head_dim``) stay as they are: do not name them."""

    def __init__(self, *names: str) -> None:
        super().__init__()
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"LocalSizes{names!r}: expected the names of the module's integer "
                             "attributes its forward splits the fused output by, e.g. "
                             "LocalSizes('n_embd', 'n_head')")
        self.names = names

    def __repr__(self) -> str:
        return f"LocalSizes({', '.join(map(repr, self.names))})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        size = device_mesh.size()
        for name in self.names:
            value = getattr(module, name, None)
            if not isinstance(value, int) or isinstance(value, bool) or value % size:
                held = [k for k, v in vars(module).items()
                        if isinstance(v, int) and not isinstance(v, bool) and k != "training"
                        and not k.startswith("_")]
                raise ValueError(f"LocalSizes({name!r}) on {type(module).__name__}: its "
                                 f"{name} is {value!r}, expected an integer tp={size} "
                                 f"divides; its integer attributes are {', '.join(held) or 'none'}"
                                 ": name those its forward splits the fused output by")
        for name in self.names:
            setattr(module, name, getattr(module, name) // size)
        return module
