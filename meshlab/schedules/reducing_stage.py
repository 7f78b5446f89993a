"""A pipeline stage whose FSDP2 module reduce-scatters every micro-batch's gradients.

torch's PipelineStage holds FSDP2's reduction back to the last micro-batch: every backward
runs with ``set_requires_gradient_sync(False)``, so a stage's gradients accumulate unsharded,
in the reduce dtype (fp32 under meshlab's bf16), from its first micro-batch to its last. On
Llama 3 405B's second stage that is 10 GiB more than the stage's shards (79.8 GiB of an
H100's 76 usable, where reducing as it goes holds 69.5). Here each micro-batch's backward
reduce-scatters its gradients as FSDP2 does outside a pipeline, and they accumulate as
shards; the parameters stay gathered between micro-batches as torch's stage keeps them. The
schedule's final ``perform_reduce_grad`` then finds nothing left to reduce (FSDP2's
post-backward is idempotent) and scales the shards by 1/m as before: the same sum, in a
different order, for m times the reduce-scatter bytes.

A schedule that splits a backward into its input and weight halves (zero bubble) cannot run
this way: FSDP2 would reduce after the input half, before the weights have gradients
(meshlab.parallel.combinations refuses the pair).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage


class ReducingStage(PipelineStage):
    """torch's PipelineStage, FSDP2's reduction run in every micro-batch's backward."""

    def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any],
                                   last_backward: bool = False) -> Any:
        if not isinstance(self.submod, FSDPModule):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        from torch.distributed.pipelining.stage import stage_backward

        module = self.submod
        module.set_is_last_backward(False)  # the last is the schedule's perform_reduce_grad
        module.set_reshard_after_backward(False)  # gathered until the step's last backward
        module.set_requires_gradient_sync(True)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                               bwd_kwargs["input_values"])
        return grads, None
