"""A gradient counted as one by torch's MemTracker once autograd has put it in ``.grad``
(torch's tracker calls it a temporary until the step ends, an activation at the backward's
peak). Mixed into trackers before MemTracker: the dry run's and ``%%mesh --memory``'s."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _MemRefType


class GradientsInGrad:
    """Needs ``watch_gradients(params)`` in ``__init__``."""

    _update_and_maybe_create_winfos: Any
    _params: list[torch.Tensor]
    _grad_hooks: list[Any]

    def watch_gradients(self, params: list[torch.Tensor]) -> None:
        self._params, self._grad_hooks = params, []

    def __enter__(self) -> Any:
        entered = super().__enter__()  # type: ignore[misc]
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._is_gradient)
                            for p in self._params]
        return entered

    def __exit__(self, *args: Any) -> None:
        for hook in self._grad_hooks:
            hook.remove()
        super().__exit__(*args)  # type: ignore[misc]

    def _is_gradient(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._update_and_maybe_create_winfos(param.grad, _MemRefType.GRAD,
                                                 update_existing=True)
