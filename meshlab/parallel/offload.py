"""Offloading to host memory: parameters (with their gradients and optimizer states) and the
activations saved for backward.

- Parameters: FSDP2's ``CPUOffloadPolicy`` keeps each rank's shards, their gradients and so
  the optimizer states in host memory; every all-gather copies a shard to the device first,
  every reduce-scatter's output is copied back, and the optimizer steps on the CPU (ZeRO-
  Offload's placement, as FSDP2 does it). Pinned host memory needs an accelerator, so CPU
  ranks run the same code with ``pin_memory=False``: the path is verified there, the saving
  only on a GPU.
- Activations: inside every block, tensors autograd saves for backward are copied to host
  memory and back when backward needs them (``torch.autograd.graph.save_on_cpu``'s hooks,
  here counting what they move). Parameters stay where they are.

>>> ParallelPlan(data_parallel="zero3", offload_params=True, offload_activations=True)
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from meshlab.measure.memory import is_parameter, local_shard
from meshlab.parallel.blocks import find_blocks, items


def offload_policy() -> Any:
    """FSDP2's policy: pinned host memory where there is an accelerator to copy from."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.accelerator.is_available())


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors to host memory in the forward, back to their device in the backward;
    ``moved`` counts the bytes packed since it was last reset."""

    def __init__(self) -> None:
        self.pin = torch.accelerator.is_available()
        self.moved = 0
        super().__init__(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> Any:
        if is_parameter(tensor):  # resident anyway: copying it saves nothing
            return tensor
        shard = local_shard(tensor)
        self.moved += shard.numel() * shard.element_size()
        if tensor.device.type == "cpu":  # a CPU rank: host memory already
            return tensor.device, tensor
        if self.pin and type(tensor) is torch.Tensor:  # pinned: the copy overlaps compute
            host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                               pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            return tensor.device, host
        return tensor.device, tensor.cpu()  # a DTensor moves as a whole

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, tensor = packed
        return tensor.to(device, non_blocking=self.pin)


def apply_activation_offload(model: nn.Module, *, blocks: str | None = None) -> nn.Module:
    """Offload what every block (found, or at the path ``blocks``) saves for backward; the
    hooks are ``model.activation_offload`` (its ``moved`` counts the bytes)."""
    hooks = ActivationOffload()
    for _, block in items(find_blocks(model, blocks)[1]):
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        # always_call: a forward that raises must not leave the hooks installed
        block.register_forward_hook(lambda *_: hooks.__exit__(), always_call=True)
    cast(Any, model).activation_offload = hooks  # what meshlab.measure.memory's placement reads
    return model
