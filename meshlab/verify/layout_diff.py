"""Where a layout stops matching one process: the first step, phase, module and rank.

``diff_with_single_process`` trains the same model, data and seed twice on every rank, as
``compare_with_single_process`` does: alone on the global batch, and parallelized on this
rank's rows. Hooks on every module record, per step, its forward output and the gradient
flowing back into that output; after each backward every parameter's gradient, and after
each optimizer step its update. Each parallel tensor is set beside its part of the one-
process tensor (this rank's rows of the batch; under tensor parallelism, this rank's chunk
of the dimension tp split), full tensors gathered from DTensor shards.

The report names the first difference beyond the tolerance in the order a difference is
*born*: step by step; in a step the forward in the order modules ran, then the output
gradients in the order the backward reached them, then parameter gradients, then updates.
A bug shows first in the module that has it; every later one inherits it.

Tolerance. A tensor's error is its largest absolute difference over its largest magnitude.
Both runs differ only by the order of floating-point sums, so a correct layout stays within a
few units of roundoff times the sums' lengths: float64 (u = 1.1e-16, the default) to 1e-10;
float32 (u = 6e-8) to 1e-4. A tensor zero up to roundoff (a key bias's gradient, which
softmax makes exactly zero: its largest magnitude below 1e3 u times the largest of its
step's phase) is held relative to that phase's largest instead, its own magnitude being
noise. An update is the parameter after the step less the parameter before it: in float32
that subtraction alone carries u * |p|, so there an update's error is held relative to the
parameter's largest magnitude. Measured on a 2-layer model over 3 steps
under DDP, ZeRO-3 and TP+SP on 4 ranks: float64's worst 5.6e-13 (an update), float32's
6.8e-7 (a gradient): each tolerance is about 150x its measure. A missing reduction, a wrong
shard or an untied weight differs by O(1). The diff steps SGD: AdamW divides each element's
step by that element's own gradient scale, so where a summed gradient nearly cancels a
reordered sum changes its step a lot (meshlab.verify.compare), and an update's difference
would say nothing of the layout.

``diff_with_itself`` runs the layout twice from the same seed and data and names the first
tensor that is not bit-identical (tolerance 0): a nondeterministic kernel, a random draw
outside the seeded generator, a reduction whose order depends on arrival.

Pipelines: a module's calls of a step (one per micro-batch) are joined along the batch, and
its output gradients scaled by the micro-batches (torch scales parameter gradients by 1/m).
Expert parallelism: an expert slice's parameter is set beside its rows of the whole (the
slice materialize marks). Gradient accumulation: a step's micro-steps are joined as a
pipeline's are. Not yet: context parallelism, replica modes, mixed precision (each refused
naming it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from meshlab.mesh import axis_size
from meshlab.models import ModelConfig, Transformer, global_batch, local_batch
from meshlab.parallel.compose import ParallelPlan, parallelize
from meshlab.verify.comparison import ZERO, data_rank, vocab_size, whole
from meshlab.verify.diff_recorder import Recorder, train

PHASES = ("forward", "output gradient", "parameter gradient", "update")
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4}
"""The largest error (|difference| over the tensor's largest magnitude) of a correct layout,
by dtype: see the module's docstring."""


@dataclass(slots=True)
class Difference:
    """One tensor of the parallel run beside its part of the one-process run's."""

    step: int
    phase: str
    module: str
    rank: int
    error: float
    tolerance: float
    shape: tuple[int, ...]
    """The parallel tensor's shape on this rank."""
    order: int = 0
    """Its place in its phase: the order modules ran (forward) or were reached (backward)."""
    layout: str = ""
    """Whose rank it is, where two layouts are set beside each other (meshlab.verify.
    two_layouts); empty beside one process or itself."""

    @property
    def ok(self) -> bool:
        return self.error <= self.tolerance

    @property
    def where(self) -> str:
        return f"rank {self.rank}" + (f" of {self.layout}" if self.layout else "")

    def __str__(self) -> str:
        return (f"step {self.step}, {self.phase} of {self.module or '(the model)'} on "
                f"{self.where}: {self.error:.1e} (tolerance {self.tolerance:.0e}, shape "
                f"{list(self.shape)})")


@dataclass(slots=True)
class LayoutDiff:
    """Every compared tensor on every rank, and the first that differs."""

    differences: list[Difference]
    tolerance: float
    not_compared: list[str] = field(default_factory=list)
    """Tensors with no part of the one-process run to set beside them, with their shapes."""
    against: str = "one process"
    """What the run was set beside: one process, itself (run twice), or another layout."""
    beside_one_process: dict[str, str] = field(default_factory=dict)
    """Where two layouts are diffed: each one's verdict beside one process, by name."""

    @property
    def first(self) -> Difference | None:
        """The first difference beyond the tolerance, in the order it is born."""
        return next((d for d in self.born() if not d.ok), None)

    @property
    def ok(self) -> bool:
        return self.first is None

    def born(self) -> list[Difference]:
        """Every compared tensor in the order a difference is born (step, phase, the order
        its modules ran or were reached, rank)."""
        return sorted(self.differences, key=_born)

    def worst(self, n: int = 10) -> list[Difference]:
        """The ``n`` largest errors, one per (module, phase)."""
        seen: dict[tuple[str, str], Difference] = {}
        for d in self.differences:
            key = (d.module, d.phase)
            if key not in seen or d.error > seen[key].error:
                seen[key] = d
        return sorted(seen.values(), key=lambda d: -d.error)[:n]

    def __str__(self) -> str:
        first = self.first
        if first is not None:
            beside = "run to run" if self.against == "itself" else f"from {self.against}"
            verdict = f"first difference {beside}: {first}"
        elif self.against == "itself":
            verdict = (f"bit-identical run to run: {len(self.differences)} tensors, each "
                       "equal in both runs")
        else:
            verdict = (f"matches {self.against}: {len(self.differences)} tensors within "
                       f"{self.tolerance:.0e}")
        return verdict + "".join(f"\n  {name}: {said}"
                                 for name, said in self.beside_one_process.items())


def _born(d: Difference) -> tuple[int, int, int, int]:
    return d.step, PHASES.index(d.phase), d.order, d.rank


def refuse_untested(mesh: Any, plan: ParallelPlan) -> None:
    """What the diff cannot set beside one process yet, refused before training."""
    named = {"cp": "context parallelism"}
    for axis, what in named.items():
        if axis_size(mesh, axis) > 1:
            raise ValueError(f"the layout diff does not yet follow {what} ({axis}="
                             f"{axis_size(mesh, axis)}): compare_with_single_process checks "
                             "the whole run; diff a layout without it")
    if plan.replica_sync != "every_step" or plan.mixed_precision:
        raise ValueError("the layout diff runs every-step data parallel in the model's dtype "
                         "(replica_sync, mixed_precision unset): compare_with_single_process "
                         "checks the others")


def diff_with_single_process(model: ModelConfig | Callable[[], nn.Module], mesh: Any,
                             plan: ParallelPlan, *, steps: int = 2, batch: int = 8,
                             seq: int = 16, vocab: int | None = None, lr: float = 1e-2,
                             dtype: torch.dtype | str = torch.float64, seed: int = 0,
                             before: Callable[[nn.Module], nn.Module] | None = None,
                             after: Callable[[nn.Module], nn.Module] | None = None
                             ) -> LayoutDiff:
    """The layout ``plan`` on ``mesh`` beside one process, module by module (see the module's
    docstring). ``before`` and ``after`` edit the parallel run's model before and after
    ``parallelize`` (the one-process run never sees them: the tests inject bugs with them).
    ``vocab``: the token ids' range, where the model's config does not say it. Every rank
    returns the same diff."""
    dtype = as_dtype(dtype)
    refuse_untested(mesh, plan)
    build = builder(model, dtype, seed)
    shape, alone = one_process_run(build, model, seq=seq, vocab=vocab, seed=seed, steps=steps,
                                   batch=batch, lr=lr)
    rank, ranks = data_rank(mesh)
    mine = parallel_run(build, mesh, plan, shape, steps, batch, lr, before, after)
    found, missing = set_beside(mine, alone, mesh, rank, ranks, TOLERANCES[dtype])
    return everyone(found, missing, TOLERANCES[dtype])


def diff_with_itself(model: ModelConfig | Callable[[], nn.Module], mesh: Any,
                     plan: ParallelPlan, *, steps: int = 2, batch: int = 8, seq: int = 16,
                     vocab: int | None = None,
                     lr: float = 1e-2, dtype: torch.dtype | str = torch.float64, seed: int = 0,
                     before: Callable[[nn.Module], nn.Module] | None = None,
                     after: Callable[[nn.Module], nn.Module] | None = None) -> LayoutDiff:
    """The layout ``plan`` run twice on ``mesh`` from the same seed and data: bit-identical
    or not, and the first tensor that is not, in the order a difference is born. Each rank's
    own tensors are set beside each other as they are: no reference, tolerance 0 (the
    determinism check of Megatron's per-rank digests, module by module); a tensor above
    DIGEST_ABOVE elements is kept from the first run as its digest."""
    dtype = as_dtype(dtype)
    refuse_untested(mesh, plan)
    build = builder(model, dtype, seed)
    shape = data_shape(model, build(), seq, vocab, seed)
    first = parallel_run(build, mesh, plan, shape, steps, batch, lr, before, after)
    kept: dict[Any, torch.Tensor | str] = {
        key: digest(value) if value.numel() > DIGEST_ABOVE else value
        for key, value in first.tensors.items()}  # the second run's tensors then fit beside
    first.tensors.clear()
    second = parallel_run(build, mesh, plan, shape, steps, batch, lr, before, after)
    me = dist.get_rank()
    found = []
    for key, value in second.tensors.items():
        was = kept[key]
        if isinstance(was, str):  # a digest: equal, or not (no magnitude to tell)
            error = 0.0 if digest(value) == was else float("inf")
        else:
            error = 0.0 if torch.equal(value, was) else (
                (value - was).abs().max() / was.abs().max().clamp_min(1e-30)).item()
        found.append(Difference(key[0], key[1], key[2], me, error, 0.0, tuple(value.shape),
                                order=first.order[key]))
    return everyone(found, [], 0.0, against="itself")


DIGEST_ABOVE = 1 << 20
"""Elements above which diff_with_itself keeps the first run's tensor as its digest (the bytes'
BLAKE2b), as Megatron's determinism trace does: bit-identical or not, without its copy."""


def digest(tensor: torch.Tensor) -> str:
    """The BLAKE2b digest of ``tensor``'s bytes (its dtype and shape included)."""
    data = tensor.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()
    head = f"{tensor.dtype} {list(tensor.shape)}".encode()
    return hashlib.blake2b(head + data.tobytes()).hexdigest()


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    dtype = getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in TOLERANCES:
        raise ValueError(f"dtype={dtype}: the diff holds float32 or float64 (low precision "
                         "rounds each run its own way)")
    return dtype


def data_shape(model: ModelConfig | Callable[[], nn.Module], built: nn.Module, seq: int,
               vocab: int | None, seed: int) -> dict[str, int]:
    """The batches' shape and seed: ``vocab`` or the built model's vocabulary."""
    return {"seq": seq, "vocab": vocab or vocab_size(built), "seed": _seed(model, seed)}


def one_process_run(build: Callable[[], nn.Module], model: ModelConfig | Callable[[], nn.Module],
                    *, seq: int, vocab: int | None, seed: int, steps: int, batch: int,
                    lr: float) -> tuple[dict[str, int], Recorder]:
    """The batches' shape, and the run every layout is set beside: the model alone on the
    global batches."""
    reference = build()
    shape = data_shape(model, reference, seq, vocab, seed)
    batches = [global_batch(step=s, batch=batch, **shape) for s in range(steps)]
    return shape, train(reference, batches, lr, lambda t: t, ranks=1)


def _seed(model: ModelConfig | Callable[[], nn.Module], seed: int) -> int:
    return model.seed if isinstance(model, ModelConfig) else seed


def builder(model: ModelConfig | Callable[[], nn.Module], dtype: torch.dtype, seed: int
             ) -> Callable[[], nn.Module]:
    """The model, built under one seed each time (the same weights for every run)."""
    factory = (lambda: Transformer(model)) if isinstance(model, ModelConfig) else model
    seed = _seed(model, seed)

    def build() -> nn.Module:
        torch.manual_seed(seed)
        return factory().to(dtype)

    return build


def parallel_run(build: Callable[[], nn.Module], mesh: Any, plan: ParallelPlan,
                  shape: dict[str, int], steps: int, batch: int, lr: float,
                  before: Callable[[nn.Module], nn.Module] | None,
                  after: Callable[[nn.Module], nn.Module] | None) -> Recorder:
    rank, ranks = data_rank(mesh)
    parallel = build()
    parallel = parallelize(before(parallel) if before else parallel, mesh, plan,
                           seed=shape["seed"])
    parallel = after(parallel) if after else parallel
    return train(parallel, [local_batch(step=s, batch=batch, rank=rank, ranks=ranks, **shape)
                             for s in range(steps)], lr, whole, ranks=ranks,
                 accumulate=plan.grad_accum)


def everyone(found: list[Difference], missing: list[str], tolerance: float, *,
              against: str = "one process") -> LayoutDiff:
    """Every rank's differences, on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (found, missing))
    return LayoutDiff([d for f, _ in everyone for d in f], tolerance,
                      sorted({m for _, ms in everyone for m in ms}), against=against)


def set_beside(mine: Recorder, alone: Recorder, mesh: Any, rank: int, ranks: int,
                tolerance: float) -> tuple[list[Difference], list[str]]:
    tp = axis_size(mesh, "tp")
    tp_rank = mesh["tp"].get_local_rank() if tp > 1 else 0
    me = dist.get_rank()
    found, missing = [], []
    for key, value in mine.tensors.items():
        step, phase, name = key
        ref = alone.tensors.get(key)
        part = None if ref is None else part_of(ref, value, rank, ranks, tp, tp_rank,
                                                 rows=phase in ("forward", "output gradient"),
                                                 cut=mine.slices.get(name))
        if part is None:
            missing.append(f"{phase} of {name or '(the model)'} "
                           f"{list(value.shape)}" + ("" if ref is None else
                                                     f" beside {list(ref.shape)}"))
            continue
        error = error_of(value, part, key, alone)
        found.append(Difference(step, phase, name, me, error, tolerance, tuple(value.shape),
                                order=alone.order.get(key, mine.order[key])))
    return found, missing


def error_of(value: torch.Tensor, part: torch.Tensor, key: tuple[int, str, str],
             alone: Recorder) -> float:
    """|value - part|'s largest over the part's largest magnitude (over its phase's largest
    where the part is zero up to roundoff; over its parameter's for a float32 update);
    infinite where either is not finite."""
    if not part.numel():
        return 0.0
    scale = alone.scales.get(key)
    if scale is None:
        scale = part.abs().max()
        level = alone.level(key[0], key[1])
        if scale <= ZERO * torch.finfo(part.dtype).eps / 2 * level:
            scale = level
    error = ((value - part).abs().max() / scale.clamp_min(1e-30)).item()
    return error if error == error else float("inf")


def part_of(ref: torch.Tensor, value: torch.Tensor, rank: int, ranks: int, tp: int,
            tp_rank: int, *, rows: bool, cut: tuple[int, int] | None = None
            ) -> torch.Tensor | None:
    """The part of the one-process tensor ``ref`` that ``value`` is on this rank (locate)."""
    index = locate(tuple(ref.shape), tuple(value.shape), rank, ranks, tp, tp_rank, rows=rows,
                   cut=cut)
    return None if index is None else ref[index]


def locate(ref: tuple[int, ...], value: tuple[int, ...], rank: int, ranks: int, tp: int,
           tp_rank: int, *, rows: bool, cut: tuple[int, int] | None = None
           ) -> tuple[slice, ...] | None:
    """Where in a one-process tensor of shape ``ref`` a tensor of shape ``value`` lies on
    this rank: its rows of the batch (dim 0, ``rows``), or the slice ``cut`` (dim, start: an
    expert-parallel rank's experts), then this tp rank's chunk of each dimension tp split;
    None where the shapes say neither."""
    if len(ref) != len(value):
        return None
    index = []
    for d, (whole_size, mine) in enumerate(zip(ref, value, strict=True)):
        if d == 0 and rows and ranks > 1 and whole_size == mine * ranks:
            index.append(slice(rank * mine, (rank + 1) * mine))
        elif cut is not None and d == cut[0] and cut[1] + mine <= whole_size:
            index.append(slice(cut[1], cut[1] + mine))
        elif whole_size == mine:
            index.append(slice(None))
        elif tp > 1 and whole_size == mine * tp:
            index.append(slice(tp_rank * mine, (tp_rank + 1) * mine))
        else:
            return None
    return tuple(index)
