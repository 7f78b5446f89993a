"""A step whose loss is non-finite or jumps, re-run from the state before it: does it repeat,
and which module first made a non-finite value (Megatron's rerun state machine, in small).

``train(..., on_anomaly=RerunOnAnomaly(spike=3.0))`` checks each step's loss after its
backward and *before* its optimizer step, so the state before the step is still the model's:
a re-run needs no copy of it, only the gradients zeroed and the random generators put back
as they were. The re-run records every module's forward output and output gradient, and
the first non-finite one (in the order modules ran, then the order the backward reached
them) is named with the ranks where it was. Then:

- the re-run's loss equals the first (bit for bit, or non-finite again): **it repeats**, a
  fault of the model, its data or its layout, not of the machine; ``AnomalyError`` is
  raised with the report, and the optimizer has not stepped: the model is as it was before
  the step, nothing lost;
- it differs: **a transient fault** (a flipped bit, a racing kernel); the step goes on with
  the re-run's gradients, and the report is kept in ``anomalies``.

Every rank decides together (one all-reduce of a flag a step), so a rank whose own rows
spiked re-runs with the rest. A loss "jumps" where it exceeds ``spike`` times the median of
the last ``window`` steps' losses. Random draws through torch's generators are put back
(CPU and the current accelerator's); a DTensor's own random offsets are not.
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshlab.parallel.blocks import clean_name


@dataclass(slots=True)
class Anomaly:
    """One step's anomaly and what its re-run said."""

    step: int
    rank: int
    """The rank whose loss was anomalous (one that repeated, where one did)."""
    loss: float
    rerun_loss: float
    why: str
    """"non-finite" or "a jump: ..." (the loss beside the recent median)."""
    repeats: bool
    """The re-run's loss equal to the first on some anomalous rank (or non-finite again)."""
    first_non_finite: str = ""
    """Where the re-run first made a non-finite value (phase, module, ranks), if it did."""

    def __str__(self) -> str:
        verdict = ("it repeats: a fault of the model, its data or its layout, not a "
                   "transient one" if self.repeats else
                   "it does not repeat: a transient fault; the step went on with the re-run")
        where = (f"; first non-finite value: {self.first_non_finite}"
                 if self.first_non_finite else "; no module made a non-finite value")
        return (f"step {self.step}: rank {self.rank}'s loss {self.loss!r} ({self.why}); re-run "
                f"from the state before it: {self.rerun_loss!r}, {verdict}{where}")


class AnomalyError(RuntimeError):
    """A step's anomaly repeated on its re-run; the optimizer did not step."""

    def __init__(self, anomaly: Anomaly) -> None:
        super().__init__(f"{anomaly}. The optimizer did not step: the model holds the state "
                         f"before step {anomaly.step}")
        self.anomaly = anomaly


@dataclass
class RerunOnAnomaly:
    """What ``train(on_anomaly=...)`` does with a non-finite or jumping loss (the module's
    docstring). ``spike``: a loss above ``spike`` x the median of the last ``window`` steps
    is a jump (None: only non-finite losses)."""

    spike: float | None = None
    window: int = 10
    anomalies: list[Anomaly] = field(default_factory=list)
    _recent: list[float] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.spike is not None and not self.spike > 1:
            raise ValueError(f"spike={self.spike}: a factor over the recent median, above 1 "
                             "(e.g. 3.0), or None for non-finite losses only")
        if self.window < 1:
            raise ValueError(f"window={self.window}: the number of recent steps, 1 or more")

    def why(self, loss: float) -> str:
        """Why this rank's ``loss`` is anomalous ("" where it is not)."""
        if not math.isfinite(loss):
            return "non-finite"
        if self.spike is not None and len(self._recent) >= min(3, self.window):
            median = statistics.median(self._recent[-self.window:])
            if loss > self.spike * median:
                return f"a jump: {loss / median:.3g}x the median {median:.4g} of the last steps"
        return ""

    def check(self, step: int, model: nn.Module, loss: torch.Tensor,
              rng: tuple[torch.Tensor, ...],
              run: Callable[[], torch.Tensor], zero_grad: Callable[[], None]) -> torch.Tensor:
        """Step ``step``'s ``loss`` (this rank's, before the optimizer steps): as it is, or
        its re-run's (a transient fault), or AnomalyError (it repeats)."""
        value = loss.item()
        why = self.why(value)
        if not _anyone(bool(why)):
            self._recent.append(value)
            return loss
        zero_grad()
        _restore(rng)
        with _NonFinite(model) as watch, warnings.catch_warnings():
            # a hook on the root module: its inputs (token ids) need no gradient, as expected
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            rerun = run().detach().clone()
        anomaly = _together(step, why, value, rerun.item(), watch.first_everywhere())
        self.anomalies.append(anomaly)
        if anomaly.repeats:
            raise AnomalyError(anomaly)
        self._recent.append(rerun.item())
        return rerun


def _repeats(loss: float, rerun: float) -> bool:
    return loss == rerun or not (math.isfinite(loss) or math.isfinite(rerun))


def _together(step: int, why: str, loss: float, rerun: float, first: str) -> Anomaly:
    """The same report on every rank: the anomalous ranks' (one that repeated first)."""
    mine = (why, loss, rerun)
    everyone: list[Any] = [mine]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
    anomalous = [(r, *x) for r, x in enumerate(everyone) if x[0]]
    rank, why, loss, rerun = min(anomalous, key=lambda a: (not _repeats(a[2], a[3]), a[0]))
    return Anomaly(step, rank, loss, rerun, why, _repeats(loss, rerun), first)


def random_state() -> tuple[torch.Tensor, ...]:
    """The generators a re-run puts back: the CPU's, and the current accelerator's."""
    state: tuple[torch.Tensor, ...] = (torch.random.get_rng_state(),)
    if torch.cuda.is_available():
        state += (torch.cuda.get_rng_state(),)
    return state


def _restore(state: tuple[torch.Tensor, ...]) -> None:
    torch.random.set_rng_state(state[0])
    if len(state) > 1:
        torch.cuda.set_rng_state(state[1])


def _anyone(flag: bool) -> bool:
    """``flag`` on any rank (every rank calls it), or this process's outside a group."""
    if not dist.is_initialized():
        return flag
    from meshlab import runtime

    value = torch.tensor([float(flag)], device=runtime.device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


class _NonFinite:
    """Hooks on every module while a step re-runs: the first non-finite output or output
    gradient, in the order modules ran, then the order the backward reached them."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.seen = model, 0
        self.first: tuple[int, str] | None = None
        self.handles: list[Any] = []

    def __enter__(self) -> _NonFinite:
        for name, module in self.model.named_modules():
            name = clean_name(name) or "(the model)"
            self.handles.append(module.register_forward_hook(
                lambda m, a, out, name=name: self._look("forward of", name, out)))
            self.handles.append(module.register_full_backward_hook(
                lambda m, gi, go, name=name: self._look("output gradient of", name, go)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()

    def _look(self, phase: str, name: str, value: Any) -> None:
        self.seen += 1  # forwards all come before the backward's gradients
        if self.first is None and _non_finite(value):
            self.first = (self.seen, f"{phase} {name}")

    def first_everywhere(self) -> str:
        """The earliest first non-finite value over the ranks, with the ranks that saw it."""
        firsts: list[Any] = [self.first]
        if dist.is_initialized():
            firsts = [None] * dist.get_world_size()
            dist.all_gather_object(firsts, self.first)
        seen = [(f, r) for r, f in enumerate(firsts) if f is not None]
        if not seen:
            return ""
        where = min(f for f, _ in seen)[1]
        ranks = [r for f, r in seen if f[1] == where]
        return f"{where} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"


def _non_finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):  # a DTensor's own shard: no collective in a hook
        local = value.to_local() if isinstance(value, DTensor) else value
        return bool(local.is_floating_point() and not local.is_meta  # a shape inference
                    and not torch.isfinite(local).all())
    if isinstance(value, dict):
        value = list(value.values())
    return isinstance(value, list | tuple) and any(_non_finite(v) for v in value)
