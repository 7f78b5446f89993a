"""Gradient accumulation: k micro-steps per optimizer step, gradients reduced once.

Each micro-step runs forward and backward on 1/k of the local batch with its loss divided
by k, so the summed gradients are those of one step on the whole batch. The data-parallel
reduction runs only in the last micro-step's backward: DDP's ``no_sync()`` and FSDP2's
``set_requires_gradient_sync(False)`` hold it back in the others (the gradients wait
unreduced, and with FSDP unsharded, until then).

>>> for inputs, targets in micro_batches(model, (x, y), plan.grad_accum):
...     (loss_fn(model(inputs), targets) / plan.grad_accum).backward()
>>> optimizer.step()

A batch-size warm-up (``warmup``) is then a number of micro-steps that grows with the step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


def micro_batches(model: nn.Module, batch: tuple[torch.Tensor, ...], steps: int
                  ) -> Iterator[tuple[torch.Tensor, ...]]:
    """``batch`` split into ``steps`` equal parts along dim 0; the caller runs forward and
    backward on each before asking for the next, and gradients are reduced in the last's."""
    rows = batch[0].shape[0]
    if steps < 1 or rows % steps:
        raise ValueError(f"grad_accum={steps} must divide the local batch of {rows} rows: "
                         f"choose a divisor of {rows}, or a batch that is a multiple of "
                         f"{steps}")
    chunks = list(zip(*(t.chunk(steps) for t in batch), strict=True))
    for i, chunk in enumerate(chunks):
        with synchronised(model, i == steps - 1):
            yield chunk


class GradientSync:
    """Whether a strategy's own gradient hooks reduce in this backward (expert parallel's
    averaging): held back, as DDP's and FSDP's are, in every micro-step but the last. Kept on
    the model as ``GRADIENT_SYNC``; the hooks read ``now``. A pipeline, whose stages run a
    backward per micro-batch, holds them back for the whole step and calls ``flush`` after
    the last, which runs each reduction the strategy registered in ``flushes`` once."""

    def __init__(self) -> None:
        self.now = True
        self.flushes: list[Callable[[], None]] = []

    def flush(self) -> None:
        for reduce in self.flushes:
            reduce()


GRADIENT_SYNC = "_meshlab_gradient_sync"


def gradient_sync(model: nn.Module) -> GradientSync:
    """The model's GradientSync, made on first use (a strategy's hooks read it)."""
    state = getattr(model, GRADIENT_SYNC, None)
    if state is None:
        state = GradientSync()
        object.__setattr__(model, GRADIENT_SYNC, state)  # not a submodule, not state_dict
    return state


@contextlib.contextmanager
def synchronised(model: nn.Module, sync: bool) -> Iterator[None]:
    """Inside, backward reduces gradients over the data-parallel ranks only when ``sync``."""
    own: GradientSync | None = getattr(model, GRADIENT_SYNC, None)
    if own is not None:
        own.now = sync  # left as the last micro-step sets it: True
    set_sync: Any = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
    if set_sync is not None:
        set_sync(sync)
        yield
        return
    no_sync: Any = getattr(model, "no_sync", None)  # DDP (and ZeRO-1, which is DDP)
    with no_sync() if no_sync is not None and not sync else contextlib.nullcontext():
        yield


def warmup(step: int, *, start: int, end: int, steps: int, unit: int) -> int:
    """The global batch at ``step`` of a linear warm-up from ``start`` to ``end`` rows over
    ``steps`` steps, rounded down to a multiple of ``unit`` (the rows one micro-step takes
    across the data ranks), as GPT-3 ramped its batch (Brown et al. 2020, appendix B)."""
    if not 0 < start <= end or start % unit or end % unit:
        raise ValueError(f"warm-up from {start} to {end} rows: both must be multiples of "
                         f"unit={unit} with 0 < start <= end")
    if step >= steps:
        return end
    rows = start + (end - start) * step // max(1, steps)
    return max(start, rows - rows % unit)
