"""One reference run for many comparisons of the same model.

``compare_with_single_process`` trains its reference in one process, and measures the
model's own floor, for every comparison. Comparing one model under many strategies (a
notebook trying layouts, the model matrix) trains the same reference again each time. Inside
``reusing_references()``, a comparison whose reference was already trained in this process
loads its final weights instead of training again.

A reference is reused only when everything it depends on is equal:

- the model's factory (the same object; a ModelConfig by value);
- the training settings: dtype, optimizer, lr, batches, seed and loss;
- the plan's fields that reach the one-process run (``reference_plan``);
- and the freshly built model itself: its structure, its config and the bytes of every
  parameter and buffer.

The caller vouches that the factory builds the same model each time, and that its forward
reads nothing that changes between the comparisons. A model that reads a global it then
edits is not safe to reuse, which is why this is opt-in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

import torch

if TYPE_CHECKING:
    from meshlab.parallel.compose import ParallelPlan

R = TypeVar("R")

_STORE: dict[Any, tuple[Any, list[dict[str, torch.Tensor]]]] | None = None


@contextmanager
def reusing_references() -> Iterator[None]:
    """Within the block, comparisons of the same model with the same settings train their
    one-process reference once (nested blocks share the outer one's store)."""
    global _STORE
    outer = _STORE
    _STORE = {} if outer is None else outer
    try:
        yield
    finally:
        _STORE = outer


# how the model is split and run, never what one process trains
PARALLEL_ONLY = ("data_parallel", "seq_len", "sequence_parallel", "tp_plan",
                 "activation_checkpoint", "pipeline_schedule", "microbatches", "virtual",
                 "split_points", "context_parallel", "cp_chunks", "cp_offload", "grad_accum",
                 "offload_params", "offload_activations")


def reference_plan(plan: ParallelPlan) -> ParallelPlan:
    """``plan`` with the fields that only shape the parallel run at their defaults: what is
    left (precision, QAT, clipping, the replicas' sync) is what the reference depends on.
    A field not named here counts, so a new one can only make reuse rarer."""
    from meshlab.parallel.compose import ParallelPlan

    default = ParallelPlan()
    return replace(plan, **{name: getattr(default, name) for name in PARALLEL_ONLY})


def trained(settings: tuple[Any, ...], models: list[torch.nn.Module],
            train: Callable[[], R]) -> R:
    """``train()``'s result, which trains ``models`` in place; inside
    ``reusing_references()``, the stored result of an equal run with the stored final
    weights loaded into ``models`` instead."""
    if _STORE is None:
        return train()
    key = (_hashable(settings), *(_fingerprint(m) for m in models))
    if key in _STORE:
        result, states = _STORE[key]
        for model, state in zip(models, states, strict=True):
            model.load_state_dict(state)
        return result
    result = train()
    _STORE[key] = result, [{k: t.clone() for k, t in m.state_dict().items()} for m in models]
    return result


def _hashable(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """The settings as a key: each value itself where it hashes, else its repr."""
    out = []
    for value in values:
        try:
            hash(value)
            out.append(value)
        except TypeError:
            out.append(repr(value))
    return tuple(out)


def _fingerprint(model: torch.nn.Module) -> tuple[str, str, str]:
    """A freshly built model as a key: its structure, its config and a digest of every
    parameter's and buffer's bytes."""
    digest = hashlib.sha256()
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        if tensor.device.type != "meta":
            flat = tensor.detach().cpu().contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    return repr(model), repr(getattr(model, "config", None)), digest.hexdigest()
