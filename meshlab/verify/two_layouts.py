"""Where two layouts part: two parallel runs of one model set beside each other, tensor by
tensor, and the first step, phase, module and rank at which they differ.

``diff_layouts`` trains the same model, data and seed under two layouts on the same ranks
(each on its own DeviceMesh: ``dp=4`` beside ``dp=2 tp=2``), recorded as the layout diff
records one (meshlab.verify.layout_diff). The two runs split each tensor differently, so
each is first put back together: every rank's part is placed where it lies in the one-
process tensor (its rows of the batch, its tp chunk; the one-process run, trained once
beside them, gives the shapes), and each rank's part of one layout is set beside the same
part of the other layout's whole tensor, in both directions. The report names the first
difference in the order one is born, with the layout whose rank it is, and each layout's
own verdict beside one process: which of the two departed from it, or both alike.

Tolerance: each run stays within its dtype's tolerance of one process (layout_diff), so two
correct runs stay within twice it; the report holds them to the one tolerance, whose margin
over a correct layout's measure (about 150x) covers the factor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import meshlab.mesh
from meshlab.mesh import axis_size
from meshlab.models import ModelConfig
from meshlab.parallel.compose import ParallelPlan
from meshlab.verify.comparison import data_rank
from meshlab.verify.diff_recorder import Recorder
from meshlab.verify.layout_diff import (
    TOLERANCES,
    Difference,
    LayoutDiff,
    as_dtype,
    builder,
    error_of,
    everyone,
    locate,
    one_process_run,
    parallel_run,
    refuse_untested,
    set_beside,
)

Layout = tuple[str, ParallelPlan]
"""A layout: the mesh's axes (``"dp=2 tp=2"``) and the plan applied on it."""
Parts = dict[tuple[int, str, str], tuple[tuple[slice, ...], torch.Tensor]]
"""One rank's tensors of a run, each with where it lies in the one-process tensor."""
Whole = tuple[torch.Tensor, torch.Tensor]
"""A run's tensor put back together, and which of its elements some rank held."""


def diff_layouts(model: ModelConfig | Callable[[], nn.Module], first: Layout, second: Layout,
                 *, names: tuple[str, str] | None = None, steps: int = 2, batch: int = 8,
                 seq: int = 16, vocab: int | None = None, lr: float = 1e-2,
                 dtype: torch.dtype | str = torch.float64,
                 seed: int = 0, before: Callable[[nn.Module], nn.Module] | None = None,
                 after: Callable[[nn.Module], nn.Module] | None = None) -> LayoutDiff:
    """``first`` and ``second`` (each ``(mesh axes, plan)``) trained on ``model`` on the same
    ranks, set beside each other module by module (see the module's docstring). ``before``
    and ``after`` edit the second layout's model before and after ``parallelize`` (the tests
    inject bugs with them). Every rank returns the same diff."""
    dtype = as_dtype(dtype)
    tolerance = TOLERANCES[dtype]
    names = names or (_name(first), _name(second))
    if names[0] == names[1]:
        raise ValueError(f"both layouts are {names[0]}: diff_with_itself runs one layout twice")
    meshes = [meshlab.mesh.build(spec) for spec, _ in (first, second)]
    for mesh, (_, plan) in zip(meshes, (first, second), strict=True):
        refuse_untested(mesh, plan)
    build = builder(model, dtype, seed)
    shape, alone = one_process_run(build, model, seq=seq, vocab=vocab, seed=seed, steps=steps,
                                   batch=batch, lr=lr)
    runs = [parallel_run(build, meshes[0], first[1], shape, steps, batch, lr, None, None),
            parallel_run(build, meshes[1], second[1], shape, steps, batch, lr, before, after)]
    verdicts = {}
    for name, run, mesh in zip(names, runs, meshes, strict=True):
        rank, ranks = data_rank(mesh)
        found, missing = set_beside(run, alone, mesh, rank, ranks, tolerance)
        verdicts[name] = str(everyone(found, missing, tolerance))
    parts = [_parts(run, alone, mesh) for run, mesh in zip(runs, meshes, strict=True)]
    wholes = [_whole(p, alone) for p in parts]
    me = dist.get_rank()
    found, missing = _beside(runs[1], parts[1][me], wholes[0], names[1], tolerance, alone)
    more, unheld = _beside(runs[0], parts[0][me], wholes[1], names[0], tolerance, alone)
    found, missing = found + more, missing + unheld
    diff = everyone(found, missing, tolerance, against=names[0])
    diff.beside_one_process = verdicts
    return diff


def _name(layout: Layout) -> str:
    spec, plan = layout
    return f"{plan.data_parallel} on {spec}"


def _parts(run: Recorder, alone: Recorder, mesh: Any) -> list[Parts]:
    """Every rank's tensors of ``run``, each placed in the one-process tensor's shape."""
    rank, ranks = data_rank(mesh)
    tp = axis_size(mesh, "tp")
    tp_rank = mesh["tp"].get_local_rank() if tp > 1 else 0
    mine: Parts = {}
    for key, value in run.tensors.items():
        ref = alone.tensors.get(key)
        index = None if ref is None else locate(
            tuple(ref.shape), tuple(value.shape), rank, ranks, tp, tp_rank,
            rows=key[1] in ("forward", "output gradient"), cut=run.slices.get(key[2]))
        if index is not None:
            mine[key] = (index, value)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def _whole(parts: list[Parts], alone: Recorder) -> dict[tuple[int, str, str], Whole]:
    """One run's tensors put back together from its ranks' parts, with which elements some
    rank held; where replicas overlap, the lowest rank's part (a replica that differs is
    its own rank's difference)."""
    wholes: dict[tuple[int, str, str], Whole] = {}
    for mine in reversed(parts):
        for key, (index, value) in mine.items():
            if key not in wholes:
                ref = alone.tensors[key]
                wholes[key] = (torch.zeros_like(ref), torch.zeros_like(ref, dtype=torch.bool))
            wholes[key][0][index] = value
            wholes[key][1][index] = True
    return wholes


def _beside(run: Recorder, mine: Parts, other: dict[tuple[int, str, str], Whole], name: str,
            tolerance: float, alone: Recorder) -> tuple[list[Difference], list[str]]:
    """This rank's parts of layout ``name`` beside the same parts of the other's whole, and
    its tensors with nothing beside them."""
    me, found, missing = dist.get_rank(), [], []
    for key in run.tensors:
        if key not in mine or key not in other or not other[key][1][mine[key][0]].all():
            missing.append(f"{key[1]} of {key[2] or '(the model)'} on {name}")
            continue
        index, value = mine[key]
        theirs = other[key][0][index]
        found.append(Difference(key[0], key[1], key[2], me,
                                error_of(value, theirs, key, alone), tolerance,
                                tuple(value.shape), order=alone.order[key], layout=name))
    return found, missing
