"""The float64 variant of a model that computes parts in float32: inside
``float64_throughout()``, every float32 (or complex64) the code asks for is float64 (or
complex128): ``x.float()``, ``x.to(torch.float32)``, ``softmax(..., dtype=torch.float32)``,
``torch.zeros(..., dtype=torch.float32)``.

Many models compute their norms, routers or rotary angles in float32 even when they are given
float64 (Gemma, Cohere, DeepSeek-V3, Mixtral's router): one process alone then moves by ~1e-7
when only the order of its sums changes, and a float64 comparison could tell a correct
parallel run from a wrong one no closer than that. Run both the reference and the parallel
run of a float64 comparison inside this, and they agree to float64's rounding (measured:
2e-13 to 5e-14 after 3 AdamW steps on those families), so its tolerance (1e-8 of the
parameters) leaves a correct run 10^5 of room and a wrong one nowhere to hide. It changes the
model's arithmetic only, never its code; the models keep their real dtype elsewhere, and
an optimizer's step runs as written (torchao's 8-bit states keep their float32 code maps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.overrides import TorchFunctionMode

WIDER = {torch.float32: torch.float64, torch.complex64: torch.complex128}


class Float64Throughout(TorchFunctionMode):
    """Float32 and complex64 requests made float64 and complex128 (see the module);
    ``widened`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.widened = 0
        self.paused = False

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.paused:
            return func(*args, **kwargs)
        if func is torch.Tensor.float:
            self.widened += 1
            return args[0].double()
        if kwargs.get("dtype") in WIDER:
            self.widened += 1
            kwargs = {**kwargs, "dtype": WIDER[kwargs["dtype"]]}
        if func in (torch.Tensor.to, torch.Tensor.type) and len(args) > 1 and args[1] in WIDER:
            self.widened += 1
            args = (args[0], WIDER[args[1]], *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_throughout(on: bool = True) -> Iterator[Float64Throughout | None]:
    """Inside, the float64 variant of whatever runs (nothing changes when ``on`` is False);
    yields the mode, to ask how many requests it widened."""
    if not on:
        yield None
        return
    mode = Float64Throughout()

    def pause(*_: Any) -> None:
        mode.paused = True

    def resume(*_: Any) -> None:
        mode.paused = False

    before = register_optimizer_step_pre_hook(pause)
    after = register_optimizer_step_post_hook(resume)
    try:
        with mode:
            yield mode
    finally:
        before.remove()
        after.remove()
