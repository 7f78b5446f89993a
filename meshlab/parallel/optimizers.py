"""Memory-efficient optimizers that step sharded parameters as one process would.

``OPTIMIZERS`` is build_optimizer's registry: kind -> (class, what it takes besides lr and
weight decay). Every class here updates a DTensor parameter (FSDP2, TP) through its local
shard: elementwise math needs nothing else, and Adafactor's factored statistics (row and
column means, the parameter's and the update's RMS) are summed across the shards with
all-reduces, so each rank computes what one process computes on the whole tensor.

- ``adamw_bf16``: AdamW with exp_avg / exp_avg_sq stored in bf16 (2 + 2 bytes per parameter),
  the update computed in fp32 (or the parameters' dtype when wider), rounded to nearest: per
  element, so sharding cannot change it.
- ``adafactor``: torch.optim.Adafactor's algorithm (Shazeer & Stern 2018, factored second
  moments); torch's own refuses DTensors (an in-place square of a partial norm).
- ``adamw8bit``: torchao's block-wise 8-bit AdamW (Dettmers et al. 2022; torchao 0.18:
  blocks of 256 values, tensors of >= 4096 values whose size is a multiple of 256, others in
  the parameters' dtype), run eagerly (torchao compiles each step, ~10 s per shape on CPU).
  Block boundaries of a shard must be one process's: ``check_sharding`` refuses otherwise.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from meshlab.plan.formulas import QUANT_BLOCK, QUANT_MIN_NUMEL


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (in place: the storage the optimizer updates), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _wrap_like(local: torch.Tensor, p: torch.Tensor, shape: list[int] | None = None,
               replicate_dims: tuple[int, ...] = ()) -> torch.Tensor:
    """``local`` as a DTensor laid out like parameter ``p`` (of global ``shape``; the tensor
    dims in ``replicate_dims`` reduced, so whole on every rank), or ``local`` if p is plain:
    checkpoints (DCP) then reshard the state as they reshard the parameter."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):
        return local
    shape = shape or list(p.shape)
    placements = [Replicate() if _shard_dim(pl, p.ndim) in replicate_dims else pl
                  for pl in p.placements]
    stride = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    return DTensor.from_local(local, p.device_mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=tuple(stride))


def _shard_dim(placement: Any, ndim: int) -> int | None:
    """The tensor dim a placement shards (Shard, and FSDP-over-TP's _StridedShard, which is
    no Shard subclass), or None (Replicate)."""
    dim = getattr(placement, "dim", None)
    return dim % ndim if isinstance(dim, int) and ndim else None


def _shard_groups(p: torch.Tensor) -> dict[int, list[Any]]:
    """Tensor dim -> the process groups (mesh dims) that shard it; {} for a plain tensor."""
    from torch.distributed.tensor import DTensor

    groups: dict[int, list[Any]] = {}
    if isinstance(p, DTensor):
        for i, pl in enumerate(p.placements):
            dim = _shard_dim(pl, p.ndim)
            if dim is not None:
                groups.setdefault(dim, []).append(p.device_mesh.get_group(i))
    return groups


def _sum_over(t: torch.Tensor, groups: Iterable[Any]) -> torch.Tensor:
    """``t`` summed over every rank of ``groups`` (in place)."""
    for group in groups:
        dist.all_reduce(t, group=group)
    return t


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (a dry run's: shapes only, no values to read)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _adam_states(optimizer: Optimizer, group: dict[str, Any],
                 moment: Callable[[torch.Tensor, bool], torch.Tensor]
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]]:
    """Each parameter of ``group`` with a gradient, the gradient and its Adam state, its step
    counted: the two moments made on first use by ``moment(local shard, first)``, laid out
    like the parameter."""
    for p in group["params"]:
        grad = p.grad
        if grad is None:
            continue
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = _wrap_like(moment(_local(p), True), p)
            state["exp_avg_sq"] = _wrap_like(moment(_local(p), False), p)
        state["step"] += 1
        yield p, grad, state


def _evaluate(closure: Callable[[], float] | None) -> float | None:
    """The closure's loss, computed with gradients on (a step runs without)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class AdamWBF16(Optimizer):
    """AdamW with its two moments stored in bf16 (``state_dtype``); the step is computed in
    fp32 or the parameters' dtype, whichever is wider, from the moments before rounding."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 state_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.state_dtype = state_dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step of every parameter with a gradient."""
        loss = _evaluate(closure)

        def moment(local: torch.Tensor, first: bool) -> torch.Tensor:
            return torch.zeros_like(local, dtype=self.state_dtype)

        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for p, p_grad, state in _adam_states(self, group, moment):
                step = state["step"].item()
                param, grad = _local(p), _local(p_grad)
                compute = torch.promote_types(param.dtype, torch.float32)
                g = grad.to(compute)
                m_low, v_low = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m = m_low.to(compute).lerp_(g, 1 - beta1)
                v = v_low.to(compute).mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m_low.copy_(m)  # rounded to nearest: the same per element on any shard
                v_low.copy_(v)
                update = param.to(compute).mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
                update.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))
                param.copy_(update)
        return loss


class Adafactor(torch.optim.Adafactor):
    """torch.optim.Adafactor's step (its arithmetic, op for op, on a plain tensor) that also
    steps DTensor parameters: the row and column means and the RMS norms are summed over the
    shards, so every rank keeps the factors of its own rows and columns."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Adafactor step of every parameter with a gradient."""
        loss = _evaluate(closure)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_one(p, group)
        return loss

    def _step_one(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        lr, d, wd = float(group["lr"]), group["d"], group["weight_decay"]
        eps1, eps2 = group["eps"]
        param, grad = _local(p), _local(p.grad)  # type: ignore[arg-type]
        if group["maximize"]:
            grad = -grad
        shards = _shard_groups(p)
        every = [g for gs in shards.values() for g in gs]
        ndim, shape = p.ndim, list(p.shape)
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            if ndim > 1:  # factors of the local rows, and of the local columns
                rows, cols = list(grad.shape), list(grad.shape)
                rows[-1], cols[-2] = 1, 1
                state["row_var"] = _wrap_like(grad.new_zeros(rows), p, [*shape[:-1], 1],
                                              (ndim - 1,))
                state["col_var"] = _wrap_like(grad.new_zeros(cols), p,
                                              [*shape[:-2], 1, shape[-1]], (ndim - 2,))
            else:
                state["variance"] = _wrap_like(torch.zeros_like(grad), p)
        if eps1 is None:
            eps1 = torch.finfo(param.dtype).eps

        # a dry run's fake tensors hold no values: norms stay tensors (the same collectives),
        # any step count runs the same ops
        fake = _is_fake(param)

        def norm_of(t: torch.Tensor) -> torch.Tensor:
            return _sum_over(t.norm(2).square(), every).sqrt() if every else t.norm(2)

        def rms_norm(t: torch.Tensor) -> float:
            if not every:
                return t.norm(2).item()
            return math.sqrt(_sum_over(t.norm(2).square(), every).item())

        step_t = state["step"]
        step_t += 1
        step = 1.0 if fake else step_t.item()
        one_minus_beta2_t = step ** group["beta2_decay"]
        rho_t = min(lr, 1 / (step ** 0.5))
        alpha: Any = ((norm_of(param) / p.numel() ** 0.5).clamp_(min=eps2) * rho_t if fake
                      else max(eps2, rms_norm(param) / (p.numel() ** 0.5)) * rho_t)
        if wd != 0:
            param.mul_(1 - lr * wd)
        if ndim > 1:
            row_var, col_var = _local(state["row_var"]), _local(state["col_var"])
            row_sq = torch.norm(grad, dim=-1, keepdim=True).square_()
            row_var.lerp_(_sum_over(row_sq, shards.get(ndim - 1, [])).div_(shape[-1]),
                          one_minus_beta2_t)
            col_sq = torch.norm(grad, dim=-2, keepdim=True).square_()
            col_var.lerp_(_sum_over(col_sq, shards.get(ndim - 2, [])).div_(shape[-2]),
                          one_minus_beta2_t)
            var_estimate = row_var @ col_var
            if ndim - 2 in shards:  # the rows are spread over ranks: their mean is a sum
                row_mean = _sum_over(row_var.sum(dim=-2, keepdim=True), shards[ndim - 2])
                row_mean.div_(shape[-2])
            else:
                row_mean = row_var.mean(dim=-2, keepdim=True)
            var_estimate.div_(row_mean.clamp_(min=eps1))
        else:
            variance = _local(state["variance"])
            variance.lerp_(grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()
        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        if fake:
            scale = (norm_of(update) / ((p.numel() ** 0.5) * d)).clamp_(min=1.0)
            param.add_(update.mul_(-alpha / scale))
            return
        denom = max(1.0, rms_norm(update) / ((p.numel() ** 0.5) * d))
        param.add_(update, alpha=-alpha / denom)


def _torchao_adam() -> Any:
    """torchao.optim.adam, or a ValueError that says how to install it."""
    try:
        from torchao.optim import adam
    except ImportError:
        raise ValueError("optimizer kind 'adamw8bit' needs torchao (block-wise 8-bit states, "
                         "CPU included): pip install torchao (meshlab[quant])") from None
    return adam


class AdamW8bit(Optimizer):
    """torchao's AdamW8bit (block-wise 8-bit moments, the step in fp32), stepped eagerly on
    each parameter's local shard: the same arithmetic without a compile per shape."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *,
                 block_size: int = QUANT_BLOCK) -> None:
        self._adam = _torchao_adam()
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

        with unset_fake_temporarily():  # torchao reads its code books' values once (cached):
            get_qmap_signed(), get_qmap_unsigned()  # real, so a dry run's fake mode can too
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.block_size = block_size

    def _zeros(self, local: torch.Tensor, signed: bool) -> torch.Tensor:
        """torchao's rule: quantize tensors of >= 4096 values in whole blocks, as
        bitsandbytes does; the rest stay in the parameters' dtype."""
        if local.numel() >= QUANT_MIN_NUMEL and local.numel() % self.block_size == 0:
            from torchao.optim.subclass_8bit import OptimState8bit

            return OptimState8bit.zeros(local.shape, signed, self.block_size, local.device,
                                        dtype=local.dtype)
        return torch.zeros_like(local)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One 8-bit AdamW step of every parameter with a gradient."""
        loss = _evaluate(closure)
        for group in self.param_groups:
            lr = torch.tensor(float(group["lr"]))
            beta1, beta2 = group["betas"]
            for p, grad, state in _adam_states(self, group, self._zeros):
                self._adam.single_param_adam(
                    _local(p), _local(grad), state["step"], _local(state["exp_avg"]),
                    _local(state["exp_avg_sq"]), None, lr, beta1, beta2,
                    group["weight_decay"], group["eps"], True, False)
        return loss


OPTIMIZERS: dict[str, tuple[Any, dict[str, Any]]] = {
    "adamw": (torch.optim.AdamW, {}), "sgd": (torch.optim.SGD, {"momentum": 0.9}),
    "adamw_bf16": (AdamWBF16, {}), "adafactor": (Adafactor, {}), "adamw8bit": (AdamW8bit, {})}
"""build_optimizer's kinds: the class and what it takes besides lr and weight decay."""


def check_sharding(kind: str, params: Iterable[torch.Tensor],
                   block_size: int = QUANT_BLOCK) -> None:
    """Refuse, before training, a sharding under which ``kind`` cannot step as one process:
    8-bit states of a DTensor parameter whose shards are quantized in other blocks (or not at
    all) than the whole tensor is in one process. Every rank decides alike (all shards known)."""
    if kind != "adamw8bit":
        return
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.tensor import DTensor

    # torch computes the offsets with small tensors: real ones, in a dry run's fake mode too
    with unset_fake_temporarily():
        _check_blocks([p for p in params if isinstance(p, DTensor)], block_size)


def _check_blocks(params: list[Any], block_size: int) -> None:
    """check_sharding's test of each DTensor parameter."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    def quantized(n: int) -> bool:
        return n >= QUANT_MIN_NUMEL and n % block_size == 0

    for p in params:
        shape, mesh = tuple(p.shape), p.device_mesh
        whole = quantized(p.numel())
        rows = all(_shard_dim(pl, p.ndim) in (None, 0) for pl in p.placements)
        shards: set[tuple[int, int]] = set()
        for coord in itertools.product(*(range(s) for s in mesh.shape)):
            local, offset = _compute_local_shape_and_global_offset(
                shape, mesh.shape, list(coord), p.placements)
            n, start = math.prod(local), offset[0] * math.prod(shape[1:]) if shape else 0
            shards.add((start, n))
            if quantized(n) != whole or (whole and not (rows and start % block_size == 0)):
                where = f"the shard at mesh coordinate {list(coord)} holds {n} values from " \
                        f"offset {start}"
                break
        else:
            # blocks are one process's only if the shards are consecutive row ranges
            ends = [a + n for a, n in sorted(shards)]
            if not whole or [a for a, _ in sorted(shards)] == [0, *ends[:-1]]:
                continue
            where = f"its shards {sorted(shards)} (start, values) are not consecutive ranges"
        raise ValueError(
            f"optimizer kind 'adamw8bit' on a parameter of shape {list(shape)} sharded as "
            f"{list(p.placements)}: {where}, so its 8-bit blocks of {block_size} (tensors of "
            f">= {QUANT_MIN_NUMEL} values, in whole blocks) differ from one process's "
            f"({'quantized' if whole else 'not quantized'} as a whole) and the run would not "
            "match it: use data_parallel='zero1' (whole tensors per rank), or sizes whose "
            f"dim-0 shards hold a multiple of {block_size} and >= {QUANT_MIN_NUMEL} values, or "
            "kind='adamw_bf16'")


def optimizer_kind(optimizer: Optimizer) -> str:
    """The build_optimizer kind of ``optimizer`` (ZeRO-1's inner one), or "" if none."""
    inner = getattr(optimizer, "optim", None)
    opt = inner if isinstance(inner, Optimizer) else optimizer
    for kind, (cls, _) in OPTIMIZERS.items():
        if type(opt) is cls:
            return kind
    return ""
