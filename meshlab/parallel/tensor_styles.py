"""transformers' tensor-parallel style names, applied.

A plan in transformers' names ("colwise", "rowwise", "packed_colwise", "moe_tp_experts",
...) is applied by transformers' own styles, whatever its installed version registers in its
``ParallelInterface``, expanded over the model's modules and parameters as transformers
expands them. Two kinds are meshlab's instead: ``replicated_with_grad_allreduce``, summed
per use (OWN_STYLES says why), and any entry naming GPT-2's Conv1D layers
(meshlab.parallel.conv1d).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from meshlab.parallel.blocks import PassThrough, owner_of
from meshlab.parallel.tp_sums import SumInBackward

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_named(model: nn.Module, tp_mesh: DeviceMesh, plan: Mapping[str, str]) -> None:
    """transformers' own styles, by the names its plans use (its ParallelInterface: every
    style it registers, not a copy of some): the plan's patterns expanded over this model's
    modules and parameters as transformers expands them, then applied by transformers."""
    try:
        from transformers.distributed.parallel_utils import (
            ALL_PARALLEL_STYLES,
            replace_layer_number_by_wildcard,
        )
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError as e:
        raise ValueError(f"the TP plan names transformers' styles ({', '.join(set(plan.values()))}"
                         f"), and transformers >= 5 is not importable here ({e}): install it, or "
                         "give torch ParallelStyles (ColwiseParallel(), ...)") from None
    own = {p: s for p, s in plan.items() if s in OWN_STYLES}
    plan = {p: s for p, s in plan.items() if s not in OWN_STYLES}
    conv1d = _conv1d_entries(model, plan)
    plan = {p: s for p, s in plan.items() if p not in conv1d}
    unknown = {p: s for p, s in plan.items() if s not in ALL_PARALLEL_STYLES}
    if unknown:
        pattern, style = next(iter(unknown.items()))
        raise ValueError(f"TP plan entry {pattern!r}: {style!r} is not a torch ParallelStyle "
                         f"nor one of transformers' styles ({', '.join(ALL_PARALLEL_STYLES)}): "
                         "give ColwiseParallel(), RowwiseParallel() or one of those names")
    expanded: dict[str, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, PassThrough):  # a block another pipeline stage holds
            continue
        generic = replace_layer_number_by_wildcard(name)
        for leaf, _ in module.named_parameters(recurse=False):
            full = f"{name}.{leaf}" if name else leaf
            found = plan.get(replace_layer_number_by_wildcard(full)) or plan.get(generic)
            if found:
                expanded[full] = found
        if generic in plan:
            expanded[name] = plan[generic]
    # a pipeline stage: transformers' MLA style reads it (a model written by hand has none)
    if not hasattr(model, "config") and hasattr(owner_of(model), "config"):
        model.config = owner_of(model).config
    apply_tensor_parallelism(model, tp_mesh, expanded)
    for name, module in model.named_modules():
        mine = own.get(replace_layer_number_by_wildcard(name))
        if mine is not None and not isinstance(module, PassThrough):
            OWN_STYLES[mine](module, tp_mesh)
    if conv1d:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, conv1d)


def _conv1d_entries(model: nn.Module, plan: Mapping[str, str]) -> dict[str, Any]:
    """Entries naming GPT-2's Conv1D layers, as meshlab's Conv1D styles (transformers' and
    torch's take nn.Linear only)."""
    from meshlab.parallel.conv1d import Conv1DColwise, Conv1DRowwise, is_conv1d

    styles = {"colwise": Conv1DColwise, "rowwise": Conv1DRowwise}
    found: dict[str, Any] = {}
    for pattern, style in plan.items():
        hits = [m for n, m in model.named_modules() if name_matches(pattern, n)]
        if hits and all(is_conv1d(m) for m in hits):
            if style not in styles:
                raise ValueError(f"TP plan entry {pattern!r}: {style!r} on a Conv1D layer "
                                 "(an (in, out) weight): give 'colwise' or 'rowwise', or "
                                 "meshlab.parallel.conv1d.Conv1DColwise(parts=3) for a packed "
                                 "q, k, v projection")
            found[pattern] = styles[style]()
    return found


def _sum_gradient_over_tp(module: nn.Module, tp_mesh: DeviceMesh) -> None:
    """transformers' ``replicated_with_grad_allreduce``: a replicated weight that sees only
    this rank's part of its input (Qwen3's per-head q_norm, between a column- and a
    row-parallel projection), so its gradient sums over tp. Summed per use, in backward:
    transformers sums the accumulated gradient each time one accumulates, which counts the
    earlier micro-batches again under pipeline or gradient accumulation."""
    group = tp_mesh.get_group()
    forward = module.forward

    def summed_in_backward(*args: Any, **kwargs: Any) -> Any:
        weights = dict(module._parameters)
        for name, p in weights.items():
            if p is not None and p.requires_grad and torch.is_grad_enabled():
                module._parameters[name] = SumInBackward.apply(p, group)
        try:
            return forward(*args, **kwargs)
        finally:
            module._parameters.update(weights)

    module.forward = summed_in_backward


OWN_STYLES: dict[str, Callable[[nn.Module, DeviceMesh], None]] = {
    "replicated_with_grad_allreduce": _sum_gradient_over_tp}
"""transformers' style names meshlab applies itself, with why beside each; they need no
layout, so they hold under sequence parallelism as they are."""


def name_matches(pattern: str, name: str) -> bool:
    """Whether a module's ``name`` matches a plan's ``pattern`` (``*`` stands for one part of
    a name, as both torch and transformers read it)."""
    from fnmatch import fnmatchcase

    parts, atoms = name.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(map(fnmatchcase, parts, atoms))
