"""A straggler you can make: slow this rank's compute by a factor.

``throttle(3)`` makes every op on this rank take about three times as long: after each aten
op, the rank sleeps twice the time the op took. Communication is not slowed (c10d and
functional-collective ops pass straight through), so the other ranks see a rank that
arrives late at every collective, as a slow GPU or a busy host would. ``%mesh throttle 2
--factor 3`` calls it on rank 2; ``%%mesh --profile`` then shows the others waiting.

>>> throttle(3)            # from now on, until off() (it outlives the cell)
>>> with throttle(3):      # or only inside the block
...     loss = train_step()

How it stays out of the way:

- It is a TorchDispatchMode kept at the *bottom* of torch's mode stack, whatever was
  entered before or after it: a comms tracer or profiler entered and left around each cell
  (``%%mesh --comms``, ``--profile``) stays LIFO above it, and ``off()`` takes it out from
  under them.
- Sleeps are paid once at least ``MIN_SLEEP_S`` is owed (``time.sleep`` overshoots by tens
  of microseconds, which would multiply tiny ops' time), always inside a compute op, never
  inside a collective: the delay shows as compute, and the rank's arrival is late.
- Ops on fake or meta tensors (dry runs, meta-device init) compute nothing: not slowed.
- ``torch.compile``: the mode ignores compile internals, so a compiled function stays
  compiled; what its compiled code still dispatches as aten ops (matmuls and convolutions
  run as extern kernels) is slowed, its fused kernels are not.
- CUDA: a kernel launch returns before the kernel runs, so on a GPU each op is timed between
  two ``torch.cuda.synchronize()``; that also takes away the host's run-ahead of the GPU,
  so a throttled GPU rank is slower than ``factor`` alone makes it (CPU ranks: ``factor``).

Plain torch: exported scripts never carry a throttle (the notebook leaves it out).
"""

from __future__ import annotations

import math
import time
from types import TracebackType
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _python_dispatch as dispatch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

MIN_SLEEP_S = 0.001  # owed sleep below this waits for more (sleeping overshoots ~50-100 us)
_COMM_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")


def check_factor(factor: Any) -> float:
    """``factor`` as a float, or ValueError naming it and what to give instead."""
    try:
        value = float(factor)
    except (TypeError, ValueError):
        raise ValueError(f"throttle factor {factor!r} is not a number: give how many times "
                         "slower the rank should compute, e.g. 2 (1: full speed)") from None
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"throttle factor {factor!r} must be a finite number >= 1 (how many "
                         "times slower the rank computes; 1 is full speed, 2 twice as slow); "
                         "to turn the throttle off use off() or `%mesh throttle off`")
    return value


class Throttle(TorchDispatchMode):
    """Sleeps ``factor - 1`` times each compute op's duration after it; collectives pass."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = check_factor(factor)
        self.owed_s = 0.0  # sleep owed but not yet paid (under MIN_SLEEP_S)
        self.slept_s = 0.0  # all it has slept: what it added to this rank's time
        self.computed_s = 0.0  # the compute ops' own time, which the sleeps multiply

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # compiled code stays compiled (the default would make torch.compile fall back to
        # eager on this rank only: slower by more than the factor, and differently)
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        if (self.factor == 1 or func.namespace in _COMM_NAMESPACES
                or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None):
            return func(*args, **kwargs)
        leaves = _tensors((args, kwargs))
        if any(_computes_nothing(t) for t in leaves):
            return func(*args, **kwargs)
        cuda = next((t.device for t in leaves if t.device.type == "cuda"), None)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        started = time.perf_counter()
        out = func(*args, **kwargs)
        if cuda is not None:
            torch.cuda.synchronize(cuda)
        elapsed = time.perf_counter() - started
        if not leaves and any(_computes_nothing(t) for t in _tensors(out)):
            return out  # a factory on the meta device
        self.computed_s += elapsed
        self.owed_s += (self.factor - 1) * elapsed
        if self.owed_s >= MIN_SLEEP_S:
            self.pay()
        return out

    def pay(self) -> None:
        """Sleep what is owed (the measured sleep counts, overshoot included)."""
        started = time.perf_counter()
        time.sleep(self.owed_s)
        slept = time.perf_counter() - started
        self.slept_s += slept
        self.owed_s -= slept


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _computes_nothing(t: torch.Tensor) -> bool:
    """A meta or fake tensor: ops on it only work out shapes."""
    return t.device.type == "meta" or isinstance(t, FakeTensor)


_active: Throttle | None = None


def current_factor() -> float:
    """This rank's throttle factor now (1.0: full speed)."""
    return _active.factor if _active is not None else 1.0


def slept() -> float:
    """Seconds the throttle has made this rank sleep since it was turned on (0 when off)."""
    return _active.slept_s if _active is not None else 0.0


class _Previous:
    """What ``throttle()`` returns: the state before it, put back at the end of a with
    block (outside one, the throttle simply stays on)."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __enter__(self) -> _Previous:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        throttle(self.factor)


def throttle(factor: float) -> _Previous:
    """Slow this rank's compute ``factor`` times from now on (until ``off()``, or the end of
    a ``with`` block); 1 turns it off. Calling it again changes the factor."""
    global _active
    value, previous = check_factor(factor), current_factor()
    if value == 1:
        off()
    elif _active is not None:
        _active.factor = value
    else:
        mode = Throttle(value)
        _insert_at_bottom(mode)
        _active = mode
    return _Previous(previous)


def off() -> None:
    """Full speed again: the throttle leaves torch's mode stack, wherever it sits in it."""
    global _active
    if _active is None:
        return
    mode, _active = _active, None
    above = []
    while (top := dispatch._get_current_dispatch_mode()) is not mode:
        if top is None:  # it left already (someone's __exit__ popped it): nothing to take out
            _refresh_flags()
            return
        above.append(dispatch._pop_mode())
    mode.__exit__(None, None, None)
    for m in reversed(above):
        dispatch._push_mode(m)
    _refresh_flags()


def _insert_at_bottom(mode: Throttle) -> None:
    """Enter ``mode`` under every user mode already on the stack: they leave LIFO above it."""
    above = []
    while dispatch._get_current_dispatch_mode() is not None:  # user modes; infra ones stay
        above.append(dispatch._pop_mode())
    mode.__enter__()
    for m in reversed(above):
        dispatch._push_mode(m)
    _refresh_flags()


def _refresh_flags() -> None:
    """torch keeps three "inside a mode" flags, each mode saving their old values as it
    enters and restoring them as it leaves; a mode put under or taken from under others
    would leave those saved values wrong. Recompute them bottom-up from the stack as it is."""
    inside = non_infra = compiling = False
    for i in range(torch._C._len_torch_dispatch_stack()):  # infra modes first, then the stack
        m = torch._C._get_dispatch_stack_at(i)
        saved = (getattr(m, "old_dispatch_mode_flags", None),
                 getattr(m, "old_non_infra_dispatch_mode_flags", None),
                 getattr(m, "old_without_ignore_compile_internals_dispatch_mode_flags", None))
        for flags, value in zip(saved, (inside, non_infra, compiling), strict=True):
            if flags:
                flags[-1] = value
        inside = True
        non_infra = non_infra or not m.is_infra_mode()
        compiling = compiling or not m.ignore_compile_internals()
    dispatch._is_in_torch_dispatch_mode = inside
    dispatch._is_in_non_infra_torch_dispatch_mode = non_infra
    dispatch._is_in_any_mode_without_ignore_compile_internals = compiling
    dispatch.set_is_in_mode_without_ignore_compile_internals(compiling)


__all__ = ["MIN_SLEEP_S", "Throttle", "check_factor", "current_factor", "off", "slept",
           "throttle"]
