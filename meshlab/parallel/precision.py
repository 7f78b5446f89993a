"""Precision options: fp16 with dynamic loss scaling, and quantization-aware training.

fp16's five exponent bits overflow where bf16's eight do not, so fp16 training multiplies the
loss by a large scale before backward (small gradients stay representable), divides the
gradients by it before the step, and skips a step whose gradients hold an inf or a NaN,
halving the scale (Micikevicius et al. 2018). The skip decision is one for the whole world:
torch's ShardedGradScaler all-reduces its found-inf flag over its process group, given here
as the world, so every TP, PP and DP rank skips the same steps and no rank steps alone.

>>> opt = build_optimizer(model, mesh, ParallelPlan(mixed_precision="fp16"))
>>> opt.zero_grad()
>>> opt.scale(loss_fn(model(x), y)).backward()
>>> opt.step()          # unscale, clip (max_grad_norm), step or skip, update the scale
>>> opt.skipped_steps, opt.loss_scale

QAT swaps every nn.Linear for torchao's FakeQuantizedLinear, which rounds its weights (and
input activations) to a low-bit grid in the forward and passes gradients straight through,
so the model learns weights that survive quantization (torchao.quantization.qat).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

PRECISIONS = ("bf16", "fp16")
"""ParallelPlan.mixed_precision's values (True means bf16)."""
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
QAT_SCHEMES = {"8da4w": "int8 dynamic per-token activations, int4 weights in groups of 32",
               "8da8w": "int8 dynamic per-token activations, int8 per-channel weights",
               "4w": "int4 weights in groups of 32 (weight-only)"}
"""ParallelPlan.qat's names (torchao's short names) and what each fake-quantizes."""
REPLICATED_FLAG = r"Found a non-scalar tensor with numel=1 and ndim!=0"
GROUP = 32
"""Input features per int4 weight scale (torchao's usual group size)."""


def precision_of(value: bool | str) -> str | None:
    """ParallelPlan.mixed_precision read as one vocabulary: None (the model's own dtype),
    bf16 or fp16; fp8 and unknown names refused with the fix."""
    if value is False or value is None:
        return None
    if value is True:
        return "bf16"
    if value == "fp8":
        raise ValueError("mixed_precision='fp8' trains only on GPUs with FP8 tensor cores "
                         "(H100 and later, torchao.float8), and parallelize does not apply it "
                         "on any rank yet (CPU ranks cannot run it at all): use 'bf16', or "
                         "'fp16' with loss scaling; the planner estimates fp8 layouts")
    if value not in PRECISIONS:
        raise ValueError(f"mixed_precision={value!r} is not one of {PRECISIONS} (or True for "
                         "bf16, False for the model's own dtype)")
    return str(value)


def compute_dtype(value: bool | str) -> torch.dtype | None:
    """The dtype the forward computes in under ``mixed_precision=value``, None: the model's."""
    precision = precision_of(value)
    return DTYPES[precision] if precision else None


def check_fp16(plan: Any, axes: dict[str, int]) -> None:
    """Refuse fp16 where its loss scaling is not verified equal to one process."""
    if precision_of(plan.mixed_precision) != "fp16":
        return
    if plan.replica_sync != "every_step":
        raise ValueError(f"mixed_precision='fp16' with replica_sync={plan.replica_sync!r}: "
                         "replicas that step on their own would skip overflowing steps on "
                         "their own, and this is not verified equal to one process: use "
                         "replica_sync='every_step', or mixed_precision='bf16' (no loss "
                         "scaling)")
    for axis in ("cp", "ep"):
        if axes.get(axis, 1) > 1:
            raise ValueError(f"mixed_precision='fp16' with {axis}={axes[axis]} is not verified "
                             "equal to one process yet: build the mesh without it (fp16 is "
                             "verified on DDP, ZeRO-1/2/3, TP and PP), or use 'bf16'")


class ScaledLoss(torch.autograd.Function):
    """The loss unchanged in the forward, its gradient times ``scale`` in the backward: a
    pipeline reports the true loss while its backward runs on the scaled one."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        # a copy, not a view: a zero-bubble schedule's input-only backward detaches the
        # stage's output in place, which a view refuses ("Can't detach views in-place")
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class LossScaledOptimizer(torch.optim.Optimizer):
    """fp16 training's optimizer: ``scale(loss)`` before backward; ``step()`` unscales the
    gradients, steps (the wrapped optimizer's clip hook then sees true gradients) or skips
    when any rank found an inf or NaN, and updates the scale."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *,
                 init_scale: float = 2.0**16, growth_interval: int = 2000,
                 world: bool | None = None) -> None:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        # the wrapped optimizer owns the groups and states; this one shares them (schedulers)
        super().__init__([{"params": []}], optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        distributed = dist.is_initialized() if world is None else world
        device = _device(optimizer)
        # one found-inf decision for the world: every TP, PP and DP rank skips together
        self.scaler: torch.amp.GradScaler = (
            _scaler_class(ShardedGradScaler)(device.type, init_scale=init_scale,
                                             growth_interval=growth_interval,
                                             process_group=dist.group.WORLD)
            if distributed else torch.amp.GradScaler(device.type, init_scale=init_scale,
                                                     growth_interval=growth_interval))
        # the scale exists from the start: pipeline ranks without the loss never call scale()
        self.scaler.scale(torch.zeros((), device=device))
        self.skipped_steps = 0
        """Steps skipped because a gradient overflowed (the same count on every rank)."""
        self._scaled = False
        pipeline = getattr(model, "pipeline", None)
        if pipeline is not None:  # its last stage computes the loss and runs backward
            self._scale_pipeline(pipeline)

    @property
    def loss_scale(self) -> float:
        """The factor the next loss is multiplied by."""
        return float(self.scaler.get_scale())

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale: call ``.backward()`` on this, never on ``loss``."""
        self._scaled = True
        return self.scaler.scale(loss)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's zero_grad (ZeRO-1's own, where it is one)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Unscale, step or skip on overflow anywhere, update the scale."""
        if closure is not None:
            raise ValueError("LossScaledOptimizer.step takes no closure: run forward and "
                             "backward on opt.scale(loss) first, then call step()")
        if not self._scaled:
            raise RuntimeError("step() with no opt.scale(loss) since the last step: the "
                               "gradients are not scaled, and unscaling would divide them by "
                               f"{self.loss_scale:g}; call opt.scale(loss).backward() instead "
                               "of loss.backward()")
        self._scaled = False
        before = self.loss_scale
        with warnings.catch_warnings():
            # FSDP/TP gradients are DTensors: the found-inf flag joins them as a replicated
            # one-element DTensor, as it should (torch warns about it on every step)
            warnings.filterwarnings("ignore", message=REPLICATED_FLAG, category=UserWarning)
            self.scaler.step(self.optimizer)
        self.scaler.update()
        # the scale shrinks only when a gradient overflowed on some rank, and then the step
        # was skipped everywhere
        if self.loss_scale < before:
            self.skipped_steps += 1

    def _scale_pipeline(self, pipeline: Any) -> None:
        runtime = pipeline.runtime
        loss_fn = runtime._loss_fn

        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            return ScaledLoss.apply(loss_fn(*args, **kwargs), self.loss_scale)

        runtime._loss_fn = scaled

        def mark() -> None:  # every pp rank, not only the one holding the loss
            self._scaled = True

        pipeline.after_backward.append(mark)


def cast_params_in_forward(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """FSDP2's mixed precision in one process: the forward sees every floating parameter cast
    to ``dtype`` (as FSDP's all-gather hands it over), so every op the model does not upcast
    itself runs in ``dtype`` (its norms too, unlike autocast), and the gradients flow back to
    the full-precision parameters. The reference of an fp16 comparison under ZeRO-2/3."""
    from torch.nn.utils.stateless import _reparametrize_module

    forward = model.forward

    def cast_forward(*args: Any, **kwargs: Any) -> Any:
        cast = {n: p.to(dtype) for n, p in model.named_parameters()
                if p.is_floating_point()}
        with _reparametrize_module(model, cast, tie_weights=True):
            return forward(*args, **kwargs)

    model.forward = cast_forward
    return model


def _scaler_class(base: type) -> type:
    """``base`` (torch's ShardedGradScaler) unscaling DTensor gradients apart from plain ones:
    its one foreach call per device and dtype refuses a list of both ("got mixed torch.Tensor
    and DTensor"), which tensor parallel without FSDP leaves (a pipeline stage on pp x tp)."""

    class ScalerOverBothKinds(base):
        def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor,
                            found_inf: torch.Tensor, allow_fp16: bool = True) -> Any:
            from types import SimpleNamespace

            from torch.distributed.tensor import DTensor

            kinds: dict[bool, list[torch.Tensor]] = {}
            for group in optimizer.param_groups:
                for p in group["params"]:
                    kinds.setdefault(isinstance(p.grad, DTensor), []).append(p)
            found: dict[Any, torch.Tensor] = {}
            for params in kinds.values():  # each call adds to the same found_inf
                part = SimpleNamespace(param_groups=[{"params": params}])
                found.update(super()._unscale_grads_(part, inv_scale, found_inf, allow_fp16))
            return found

    return ScalerOverBothKinds


def _device(optimizer: torch.optim.Optimizer) -> torch.device:
    for group in optimizer.param_groups:
        for p in group["params"]:
            return torch.device(p.device.type)
    return torch.device("cpu")


def qat_config(scheme: str) -> Any:
    """torchao's QATConfig (prepare step) for one of QAT_SCHEMES."""
    try:
        from torchao.quantization.qat import IntxFakeQuantizeConfig, QATConfig
    except ImportError as e:
        raise ImportError(f"qat={scheme!r} fake-quantizes through torchao, which is not "
                          "installed: pip install torchao (meshlab[quant]: 0.18 or later)") from e
    activations = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
    int4 = torch.int4  # type: ignore[attr-defined]  # torch has it; its stubs do not
    weights = {"8da4w": IntxFakeQuantizeConfig(int4, group_size=GROUP, is_symmetric=True),
               "4w": IntxFakeQuantizeConfig(int4, group_size=GROUP, is_symmetric=True),
               "8da8w": IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)}
    return QATConfig(activation_config=None if scheme == "4w" else activations,
                     weight_config=weights[scheme], step="prepare")


def check_fp16_model(plan: Any, model: nn.Module) -> None:
    """Refuse fp16 on a model with state-space layers, naming them."""
    scans = sorted({type(m).__name__ for m in model.modules() if "Mamba" in type(m).__name__})
    if precision_of(plan.mixed_precision) == "fp16" and scans:
        raise ValueError(f"mixed_precision='fp16' on {type(model).__name__}, whose state-space "
                         f"layers ({', '.join(scans)}) scan with exponentials that leave fp16's "
                         "range where one process's do not (Jamba under DDP skipped a step on "
                         "overflow that one process took, at loss scale 256; at 16 its own "
                         "rounding moved 1e-2): use mixed_precision='bf16', as Mamba is trained")


def check_qat(plan: Any, axes: dict[str, int], model: nn.Module) -> None:
    """Refuse QAT where it is not verified equal to one process, naming the fix."""
    if plan.qat is None:
        return
    check_qat_axes(plan, axes)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"qat={plan.qat!r} on a model on the meta device: not verified yet; "
                         "build it on a device (or meshlab.parallel.materialize it) first")


def check_qat_axes(plan: Any, axes: dict[str, int]) -> None:
    """QAT's refusals that depend on the plan and the mesh alone."""
    if axes.get("tp", 1) > 1:
        raise ValueError(f"qat={plan.qat!r} with tp={axes['tp']}: torch's Colwise/RowwiseParallel "
                         "do not take torchao's FakeQuantizedLinear, and a row-wise layer's "
                         "input is split along its features, so each rank would quantize part "
                         "of a token with its own scale, unlike one process: build the mesh "
                         "without tp (QAT composes with DDP, ZeRO-1/2/3 and pp)")
    for axis in ("cp", "ep"):
        if axes.get(axis, 1) > 1:
            raise ValueError(f"qat={plan.qat!r} with {axis}={axes[axis]} is not verified equal "
                             "to one process yet: build the mesh without it")
    if plan.replica_sync != "every_step":
        raise ValueError(f"qat={plan.qat!r} with replica_sync={plan.replica_sync!r} is not "
                         "verified equal to one process yet: use replica_sync='every_step'")


def apply_qat(model: nn.Module, scheme: str) -> nn.Module:
    """Every nn.Linear of ``model`` fake-quantized by ``scheme`` (one of QAT_SCHEMES), in
    place; Linears already fake-quantized are left as they are."""
    if scheme not in QAT_SCHEMES:
        raise ValueError(f"qat={scheme!r} is not one of {tuple(QAT_SCHEMES)}")
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    for name, linear in linears.items():
        if linear.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"qat={scheme!r} on {name} in {linear.weight.dtype}: torchao's "
                             "fake quantization takes float32, bf16 or fp16; build the model "
                             "in float32")
        if scheme != "8da8w" and linear.in_features % GROUP:
            raise ValueError(f"qat={scheme!r} on {name} with {linear.in_features} input "
                             f"features: int4 weights are scaled in groups of {GROUP}, which "
                             "must divide them; use qat='8da8w' (per-channel)")
    config = qat_config(scheme)  # first: it names `pip install torchao` when absent
    from torchao.quantization import quantize_

    quantize_(model, config, filter_fn=lambda m, _: type(m) is nn.Linear)
    return model
