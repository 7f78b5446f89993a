"""GPT-2's Conv1D layers under tensor parallel, and the plan GPT-2 does not ship.

transformers' Conv1D is a linear layer with its weight stored transposed, (in, out), so
torch's and transformers' column/row styles (written for nn.Linear's (out, in)) do not
take it. The styles here shard it the other way round and run the layer's own forward on
this rank's part: column-parallel keeps 1/tp of the outputs (of each of ``parts`` packed
blocks: GPT-2's c_attn packs q, k and v), row-parallel 1/tp of the inputs, its partial
outputs summed and the bias added once after. With GPT-2's fused attention the block's
``split_size`` becomes this rank's share; its heads then follow from the local width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2, GPT, ...): a linear layer with an (in, out) weight."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


class Conv1DColwise(ParallelStyle):
    """Column-parallel Conv1D: this rank's 1/tp of each of ``parts`` packed output blocks;
    the input is whole on every rank (its gradient summed over tp), the output this
    rank's part. ``split_size``: a module attribute of the layer's parent sized by the
    packed width (GPT-2's attention), divided by tp too."""

    def __init__(self, parts: int = 1) -> None:
        super().__init__()
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor.placement_types import _StridedShard

        def split(dim: int) -> Any:
            return Shard(dim) if self.parts == 1 else _StridedShard(dim, split_factor=self.parts)

        shard_parameter(module, "weight", device_mesh, split(1))
        if self.parts == 1:
            shard_parameter(module, "bias", device_mesh, Shard(0))
        # a packed bias stays whole (FSDP's dim-0 split over a strided one does not gather
        # back): each rank adds its slices, and the gradient sums over tp
        size, rank = device_mesh.size(), device_mesh.get_local_rank()
        width = cast(Any, module).nf // size
        group = device_mesh.get_group()
        forward = module.forward

        def local_forward(x: torch.Tensor) -> torch.Tensor:
            from meshlab.parallel.tp_sums import SumInBackward

            local: dict[str, Any] = {"nf": width}
            bias = module.bias
            if self.parts > 1 and bias is not None:
                whole = SumInBackward.apply(bias, group)
                local["bias"] = torch.cat([part.chunk(size)[rank]
                                           for part in whole.chunk(self.parts)])
            with LocalParameters(module, **local):
                return forward(SumInBackward.apply(x, group))

        module.forward = local_forward
        return module


class Conv1DRowwise(ParallelStyle):
    """Row-parallel Conv1D: this rank's 1/tp of the inputs; the partial outputs summed over
    tp and the (replicated) bias added once, after."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shard_parameter(module, "weight", device_mesh, Shard(0))
        shard_parameter(module, "bias", device_mesh, Replicate())
        group = device_mesh.get_group()
        forward = module.forward

        def local_forward(x: torch.Tensor) -> torch.Tensor:
            from meshlab.parallel.tp_sums import SumInForward

            bias: Any = module.bias
            with LocalParameters(module, bias=torch.zeros_like(bias.to_local())):
                partial = forward(x)
            return SumInForward.apply(partial, group) + bias.to_local()

        module.forward = local_forward
        return module


class LocalSplit(ParallelStyle):
    """GPT-2's attention splits its packed c_attn output in ``split_size`` pieces: under a
    column-parallel c_attn each piece is this rank's share."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        attention: Any = module
        attention.split_size //= device_mesh.size()
        return module


def gpt2_plan() -> dict[str, Any]:
    """Megatron's plan on GPT-2 (GPT2LMHeadModel ships none): the vocabulary split over the
    tied embedding and head, column-parallel c_attn (q, k, v packed) and c_fc,
    row-parallel projections."""
    return {
        "transformer.wte": "embedding_rowwise",
        "lm_head": "colwise_gather_output",
        "transformer.h.*.attn": LocalSplit(),
        "transformer.h.*.attn.c_attn": Conv1DColwise(parts=3),
        "transformer.h.*.attn.c_proj": Conv1DRowwise(),
        "transformer.h.*.mlp.c_fc": Conv1DColwise(),
        "transformer.h.*.mlp.c_proj": Conv1DRowwise(),
    }


def shard_parameter(module: nn.Module, name: str, mesh: DeviceMesh, placement: Any) -> None:
    """``module.<name>`` as a DTensor of ``placement`` over ``mesh``, this rank keeping its part."""
    param = module._parameters[name]
    if param is None or isinstance(param, DTensor):
        return
    # every rank built the same weights: each keeps its part (src_data_rank=None: no send)
    module._parameters[name] = nn.Parameter(
        distribute_tensor(param.data, mesh, [placement], src_data_rank=None),
        requires_grad=param.requires_grad)


class LocalParameters:
    """Within: the module's DTensor parameters as this rank's local tensors (differentiable,
    so their gradients land on the DTensors), and the given attributes set."""

    def __init__(self, module: nn.Module, **attributes: Any) -> None:
        self.module, self.attributes = module, attributes

    def __enter__(self) -> None:
        self.params = dict(self.module._parameters)
        self.saved = {k: getattr(self.module, k) for k in self.attributes
                      if k not in self.params}
        for name, p in self.params.items():
            if isinstance(p, DTensor):
                self.module._parameters[name] = p.to_local()
        for key, value in self.attributes.items():
            if key in self.params:
                self.module._parameters[key] = value
            else:
                setattr(self.module, key, value)

    def __exit__(self, *_: object) -> None:
        self.module._parameters.update(self.params)
        for key, value in self.saved.items():
            setattr(self.module, key, value)
