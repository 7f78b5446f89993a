"""The layout diff's recorded runs (meshlab.verify.layout_diff): SGD steps with hooks on every
module keeping, per step, each forward output and the gradient flowing back into it, every
parameter's gradient and update, under the names of the plain model. A pipeline's micro-
batches, or a gradient accumulation's micro-steps, are joined into the step's tensors; a
tied weight is kept under each of its names; an expert-parallel rank's expert slices say
where they lie in the whole tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from meshlab.parallel.accumulate import micro_batches
from meshlab.parallel.blocks import clean_name
from meshlab.parallel.materialize import marked_slice
from meshlab.verify.comparison import full_parameters, whole
from meshlab.verify.training import next_token_loss


class Recorder:
    """Hooks on ``model``'s modules: each forward output and output gradient, by step."""

    def __init__(self, model: nn.Module, full: Callable[[torch.Tensor], torch.Tensor], *,
                 joined: bool = False) -> None:
        # joined: a pipeline calls each module once per micro-batch, in order; its calls in
        # a step are joined along the batch (end_step), not the first kept
        self.model, self.full, self.step, self.joined = model, full, 0, joined
        self.paused = False
        self.levels: dict[tuple[int, str], torch.Tensor] = {}
        self.slices: dict[str, tuple[int, int]] = {}
        """Parameters that hold a slice of the whole (dim, start): an EP rank's experts."""
        self.calls: dict[tuple[int, str, str], list[torch.Tensor]] = {}
        self.tensors: dict[tuple[int, str, str], torch.Tensor] = {}
        self.order: dict[tuple[int, str, str], int] = {}
        self.counts: dict[tuple[int, str], int] = {}
        self.scales: dict[tuple[int, str, str], torch.Tensor] = {}
        """What a tensor's error is relative to, where not its own largest magnitude."""
        self.handles: list[Any] = []
        # DDP's wrapper runs the model it holds: record that one's modules, by their own names
        inner = model.module if isinstance(model, DistributedDataParallel) else model
        for name, module in inner.named_modules():
            name = clean_name(name)
            self.handles.append(module.register_forward_hook(self._forward(name)))
            self.handles.append(module.register_full_backward_hook(self._backward(name)))

    def _keep(self, phase: str, name: str, value: Any) -> None:
        tensor = _first_tensor(value)
        if tensor is None or self.paused:
            return
        key = (self.step, phase, name)
        if key in self.tensors or key in self.calls:  # a module called again in a step
            if self.joined:
                self.calls[key].append(self.full(tensor).detach().clone())
            return  # else its first call stands for it
        self.order[key] = self.counts.get(key[:2], 0)
        self.counts[key[:2]] = self.order[key] + 1
        if self.joined:
            self.calls[key] = [self.full(tensor).detach().clone()]
        else:
            self.tensors[key] = self.full(tensor).detach().clone()

    def end_step(self) -> None:
        """A pipeline's micro-batches (or an accumulation's micro-steps) of each module
        joined along dim 0 into the step's tensor, in the order they ran (a micro-batch's
        rows, or its tokens flattened, come in that order); a tensor the same in every call
        (a rotary table, whatever the tokens) is the first call's."""
        for key, calls in self.calls.items():
            joined = calls[0].dim() and not all(torch.equal(c, calls[0]) for c in calls[1:])
            self.tensors[key] = torch.cat(calls) if joined else calls[0]
        self.calls.clear()

    def _forward(self, name: str) -> Callable[..., None]:
        return lambda module, args, out: self._keep("forward", name, out)

    def _backward(self, name: str) -> Callable[..., None]:
        return lambda module, grad_in, grad_out: self._keep("output gradient", name, grad_out)

    def parameters(self, phase: str, values: dict[str, torch.Tensor]) -> None:
        """Per parameter, its module's ``phase`` (gradients, updates) for this step."""
        for i, (name, value) in enumerate(values.items()):
            self.tensors[(self.step, phase, name)] = value
            self.order[(self.step, phase, name)] = i

    def level(self, step: int, phase: str) -> torch.Tensor:
        """The largest magnitude of any tensor of ``phase`` at ``step``."""
        key = (step, phase)
        if key not in self.levels:
            self.levels[key] = max((t.abs().max() for (s, p, _), t in self.tensors.items()
                                    if (s, p) == key and t.numel()),
                                   default=torch.tensor(0.0))
        return self.levels[key]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return next((t for v in value if (t := _first_tensor(v)) is not None), None)
    return None


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return _with_aliases(model, {clean_name(n): whole(p.grad).detach().clone()
                                 for n, p in model.named_parameters() if p.grad is not None})


def _slices(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The parameters that hold a slice of the whole tensor (materialize's marks)."""
    found = {}
    for name, _ in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        cut = marked_slice(model.get_submodule(owner), attr)
        if cut is not None:
            found[clean_name(name)] = cut
    return found


def _with_aliases(model: nn.Module, values: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """``values`` under every name of a tied parameter too (``lm_head.weight`` beside
    ``model.embed_tokens.weight``): a pipeline's last stage holds the tie's other name."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        name = clean_name(name)
        first.setdefault(id(p), name)
        if name not in values and first[id(p)] in values:
            values[name] = values[first[id(p)]]
    return values


def train(model: nn.Module, batches: list[Any], lr: float,
           full: Callable[[torch.Tensor], torch.Tensor], *, ranks: int,
           accumulate: int = 1) -> Recorder:
    """SGD steps with every module recorded; each rank's loss is its rows' mean, and its
    output gradients are scaled to the whole batch's (x 1/ranks). ``accumulate``: micro-steps
    a step (gradient accumulation, each micro-batch's loss over ``accumulate``)."""
    pipeline = getattr(model, "pipeline", None)
    recorder = Recorder(model, full, joined=pipeline is not None or accumulate > 1)
    if pipeline is not None and batches:  # torch's stages infer shapes by running a forward
        recorder.paused = True
        pipeline.begin(*batches[0])
        recorder.paused = False
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for step, batch in enumerate(batches):
        recorder.step = step
        optimizer.zero_grad()
        if pipeline is not None:
            pipeline.step(*batch)
            recorder.end_step()
        elif accumulate > 1:  # each micro-step's rows a 1/accumulate share of the step's
            for inputs, targets in micro_batches(model, batch, accumulate):
                (next_token_loss(model, (inputs, targets)) / accumulate).backward()
            recorder.end_step()
        else:
            next_token_loss(model, batch).backward()
        recorder.parameters("parameter gradient", _grads(model))
        recorder.slices = _slices(model)
        before = _with_aliases(model, {n: t.clone() for n, t in
                                       full_parameters(model).items()})
        optimizer.step()
        after = _with_aliases(model, full_parameters(model))
        recorder.parameters("update", {n: after[n] - before[n] for n in after})
        # float32 subtracts two parameters to get an update: u * |p| of noise, so its error is
        # held relative to the parameter there (float64's noise stays far below its tolerance)
        if next(iter(after.values())).dtype == torch.float32:
            recorder.scales.update({(step, "update", n): after[n].abs().max() for n in after})
    recorder.close()
    # a pipeline's micro-batch losses are each their rows' mean (torch scales the parameters'
    # gradients by 1/m after): its output gradients are m x the rank's
    micro = pipeline.schedule.microbatches if pipeline is not None else 1
    for key, tensor in recorder.tensors.items():
        if key[1] == "output gradient":
            recorder.tensors[key] = tensor / (ranks * micro)
    return recorder
