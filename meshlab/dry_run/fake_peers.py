"""The peers a rank of a dry run does not have (meshlab.dry_run.run): on torch's fake process
group collectives return at once, but DDP's reducer expects its group's answer and torch's
pipeline stages vote with their neighbours and receive the shape of what the previous stage
sends. A stage's input is the hidden state between blocks, whose shape the caller states; the
backward's metadata is the gradient of the stage's own outputs, as torch's static mode
derives it.

Plain torch, rank side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn


def ddp_without_peers(model: nn.Module) -> int:
    """A DDP model's gradient all-reduce, bucket by bucket, on the fake group (DDP's own
    hook expects the group's answer, which a fake group does not give); the bytes of its
    buckets, which DDP allocated when it was built (a copy of the gradients, unless they
    are views into them): 0 for any other model."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return 0

    import torch.distributed as dist

    def allreduce(group: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        dist.all_reduce(tensor, group=group)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(tensor)
        return done

    # DDP checks a hook's annotations as objects (this module's are strings)
    allreduce.__annotations__ = {"group": Any, "bucket": dist.GradBucket,
                                 "return": torch.futures.Future[torch.Tensor]}
    model.register_comm_hook(model.process_group, allreduce)
    data = model._get_ddp_logging_data()
    if data.get("gradient_as_bucket_view"):
        return 0
    return sum(int(b) for b in str(data.get("bucket_sizes", "")).split(",") if b.strip())


@contextlib.contextmanager
def without_peers(hidden: torch.Size, dtype: torch.dtype) -> Iterator[None]:
    """torch's pipeline stages run without their neighbours: no vote (the ends infer their
    metadata, torch's dynamic mode; the stages between are given the hidden state's), a
    stage's input is a ``hidden`` tensor of ``dtype`` (what one block hands the next), its
    output gradients those of its outputs; meshlab's executor keeps the step's loss unknown
    (NaN) instead of reading a fake value."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
        _StageMeta,
        _TensorMeta,
    )
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    from meshlab.schedules.execute import Executor

    stride = torch.empty(hidden, device="meta").stride()
    boundary = _TensorMeta(shape=hidden, stride=stride, dtype=dtype, requires_grad=True)

    def warmup(self: Any, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        # a stage between the ends takes and gives the blocks' hidden state: torch's static
        # mode skips the forward and backward its dynamic mode runs to learn that (seconds
        # of a large stage); the ends infer theirs (the tokens, the logits), and so does a
        # stage beside one on this rank, which hands it its metadata
        dynamic = {s.stage_index for s in stages if s.is_first or s.is_last}
        mine = {s.stage_index for s in stages}
        while grown := {n for d in dynamic for n in (d - 1, d + 1) if n in mine} - dynamic:
            dynamic |= grown
        for stage in stages:
            if stage.stage_index in dynamic:
                stage._inference_mode = InferenceMode.DYNAMIC
            else:
                stage._inference_mode = InferenceMode.STATIC
                stage._user_meta = _StageMeta(inputs=(boundary,), outputs=(boundary,))

    def recv_meta(self: Any, src_stage: int) -> Any:
        if src_stage < self.stage_index:  # forward: the hidden state the blocks pass on
            return _StageForwardMeta(forward_metas=(boundary,))
        return _StageBackwardMeta(backward_metas=_derive_grad_metas(self._stage_meta.outputs))

    def send_meta(self: Any, meta: Any, dst_stage: int) -> None:
        return None

    original_finish = Executor._finish

    def finish(self: Executor) -> None:
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            original_finish(self)
        except DataDependentOutputException:  # float() of the fake loss, its last line
            self.loss = float("nan")

    patches: list[tuple[Any, str, Any]] = [
        (_PipelineScheduleRuntime, "_warmup_p2p", warmup),
        (PipelineStage, "_recv_meta", recv_meta),
        (PipelineStage, "_send_meta", send_meta),
        (Executor, "_finish", finish)]
    saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in patches]
    try:
        for owner, name, fn in patches:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, old in saved:
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
