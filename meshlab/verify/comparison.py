"""What a check against one process gives back, and what both sides of one use: the
comparison, the tolerances by dtype, each rank's place among the data ranks, a model's
parameters whole. Below meshlab.verify.compare and the replica modes' references
(meshlab.replicas), which build their own comparison from a replay."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from meshlab.mesh import axis_size
from meshlab.parallel.blocks import clean_name

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(slots=True)
class Comparison:
    """Losses and parameters of a parallel run beside the single-process reference."""

    losses: list[float]
    reference_losses: list[float]
    max_loss_error: float  # largest |loss - reference| / |reference|
    max_param_error: float  # largest |p - p_ref| of a parameter, relative to its max |p_ref|
    worst_param: str
    loss_rtol: float
    param_rtol: float
    notes: list[str] = field(default_factory=list)
    """What about the model bears on the comparison: tolerances it changed, and on a
    mismatch the causes meshlab can name."""
    skipped_steps: int | None = None
    """fp16: optimizer steps the parallel run skipped on overflow (None: no loss scaling)."""
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        self.ok = (self.max_loss_error <= self.loss_rtol
                   and self.max_param_error <= self.param_rtol)

    def __str__(self) -> str:
        verdict = "matches one process" if self.ok else "DIFFERS from one process"
        lines = [f"{verdict}: losses within {self.max_loss_error:.1e} (tolerance "
                 f"{self.loss_rtol:.0e}), parameters within {self.max_param_error:.1e} "
                 f"(tolerance {self.param_rtol:.0e}; worst {self.worst_param})"]
        return "\n".join(lines + [f"  - {note}" for note in self.notes])


def data_rank(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index, number of ranks) among those that get different data rows."""
    for name in ("dp", "dp_shard", "dp_replicate"):
        if axis_size(mesh, name) > 1:
            return mesh[name].get_local_rank(), axis_size(mesh, name)
    return 0, 1


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole (a collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole (DTensors gathered), under the plain model's names."""
    # FSDP over TP leaves a _StridedShard that torch gathers in two steps, warning each time
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        return {clean_name(n): whole(p).detach() for n, p in model.named_parameters()}
    finally:
        quiet.setLevel(level)


ZERO = 1e3
"""A one-process tensor whose largest magnitude is below ZERO x unit roundoff x the largest of
its kind (the model's parameters; a step's phase in the layout diff) is zero up to roundoff: a
key bias, whose gradient softmax makes exactly zero, or that gradient itself. Its own
magnitude is noise, so its error is held relative to that largest instead."""


def relative_error(value: torch.Tensor, ref: torch.Tensor, largest: torch.Tensor | float
                   ) -> float:
    """|value - ref|'s largest over ref's largest magnitude, or over ``largest`` (of its kind)
    where ref is zero up to roundoff (ZERO); infinite where either is not finite (a NaN
    must read as the worst, never compare as no error)."""
    if not ref.numel():
        return 0.0
    scale = ref.abs().max()
    if scale <= ZERO * torch.finfo(ref.dtype).eps / 2 * largest:
        scale = torch.as_tensor(largest, dtype=scale.dtype)
    error = ((value - ref).abs().max() / scale.clamp_min(1e-30)).item()
    return error if error == error else float("inf")


def largest_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The largest magnitude among ``tensors``."""
    return max((t.detach().abs().max() for t in tensors if t.numel()),
               default=torch.tensor(0.0))


TOLERANCES = {torch.bfloat16: (8e-4, 8e-3), torch.float16: (1e-4, 1e-3),
              torch.float32: (1e-5, 2e-4),
              torch.float64: (1e-9, 1e-8)}  # (loss, params)


def vocab_size(model: torch.nn.Module) -> int:
    """The model's vocabulary, from its config (meshlab's cfg or transformers' config), or
    from its one nn.Embedding (a model written by hand; with two, which is the tokens' is a
    guess, and none is made)."""
    for config in (getattr(model, "cfg", None), getattr(model, "config", None)):
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int):
            return size
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    if len(embeddings) == 1:
        return embeddings[0].num_embeddings
    raise ValueError(f"cannot tell the vocabulary size of {type(model).__name__} (looked for "
                     f"cfg.vocab_size, config.vocab_size and one nn.Embedding; it has "
                     f"{len(embeddings)}): pass vocab=N")
