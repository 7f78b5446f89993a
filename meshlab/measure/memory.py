"""How many bytes a model needs per device: ZeRO and activation formulas, and a measurement.

Runs on the ranks. ``zero_bytes`` and ``activation_bytes_per_layer`` are the closed-form
estimates from the ZeRO and Megatron sequence-parallelism papers; ``measure`` counts the
bytes this process really holds for a module's parameters, gradients and optimizer state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from meshlab.plan.formulas import (  # the closed forms live with the planner: no torch there
    RECOMPUTE_MODES,
    ZERO_STAGES,
    activation_bytes_per_layer,
    zero_bytes,
)

__all__ = ["RECOMPUTE_MODES", "ZERO_STAGES", "MemoryReport", "activation_bytes",
           "activation_bytes_per_layer", "activation_placement", "local_shard", "measure",
           "reshard", "zero_bytes"]

@dataclass(slots=True)
class MemoryReport:
    """Bytes this process holds for parameters, gradients and optimizer state."""

    params: int
    grads: int
    optimizer: int
    host: int = 0
    """Of these, the bytes offloading keeps in host memory (the rest is on the device)."""
    # what the formula beside the bytes needs, not bytes: left out of == (compare=False)
    optimizer_kind: str = field(default="", compare=False)
    """build_optimizer's kind of the optimizer measured ("" if none or another), for the
    formula beside it (meshlab.plan.formulas.sharded_state_bytes)."""
    shapes: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    """The parameters' shapes on one tensor-parallel rank, before ZeRO shards them (what
    that formula needs)."""
    element_bytes: int = field(default=4, compare=False)
    """Bytes per value of the parameters (AdamW and SGD keep their states in that dtype)."""
    resharded: tuple[str, ...] = field(default=(), compare=False)
    """FSDP units found gathered and resharded before counting (``reshard``)."""
    reset: bool = field(default=False, compare=False)
    """Whether a step that raised was reset first (``reshard``)."""

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (its own numel() is the global
    tensor's), else ``t``."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(t, DTensor):
            return t.to_local()
    return t


def _count(tensors: Iterable[torch.Tensor], seen: set[tuple[int, int, int]],
           host: list[int] | None = None) -> int:
    """Bytes of ``tensors`` not yet ``seen``; those in host memory are also added to
    ``host[0]``."""
    total = 0
    for tensor in tensors:
        t = local_shard(tensor)
        if t.device.type == "meta":  # no storage behind it
            continue
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
            # a wrapper (torchao's 8-bit optimizer state) has no storage of its own: its
            # codes, scales and code book hold the bytes
            names, _ = t.__tensor_flatten__()
            total += _count((getattr(t, n) for n in names), seen, host)
            continue
        nbytes = t.numel() * t.element_size()
        # Key on the byte range, not the storage alone: tied weights share one range and are
        # counted once, while views into one flat buffer (DDP grad buckets, FSDP1 flat params)
        # are distinct ranges and each count.
        key = (t.untyped_storage().data_ptr(), int(t.storage_offset()) * t.element_size(), nbytes)
        if key in seen:
            continue
        seen.add(key)
        total += nbytes
        if host is not None and t.device.type == "cpu":
            host[0] += nbytes
    return total


def measure(model: torch.nn.Module,
            optimizer: torch.optim.Optimizer | None = None) -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state this process actually holds.

    FSDP2 modules left unsharded (a forward without backward keeps the root's parameters
    gathered) are resharded first: their sharded parameters, which hold the gradients and
    which the optimizer updates, are what this process keeps between steps."""
    gathered, reset = reshard(model)
    seen: set[tuple[int, int, int]] = set()  # shared, so no tensor counts in two categories
    # host memory is memory apart from the device's: on a CPU rank, where FSDP2 offloads
    host = [0] if torch.accelerator.is_available() or _params_on_host(model) else None
    params = list(model.parameters())  # already deduplicates tied parameters
    n_params = _count(params, seen, host)
    n_grads = _count((p.grad for p in params if p.grad is not None), seen, host)
    n_optim = 0
    if optimizer is not None:
        # ZeroRedundancyOptimizer (and similar wrappers) keep this rank's shard in `.optim`.
        inner = getattr(optimizer, "optim", None)
        opt = inner if isinstance(inner, torch.optim.Optimizer) else optimizer
        n_optim = _count((v for state in opt.state.values() for v in state.values()
                          if isinstance(v, torch.Tensor)), seen, host)
    from meshlab.parallel.optimizers import optimizer_kind

    return MemoryReport(params=n_params, grads=n_grads, optimizer=n_optim,
                        host=host[0] if host else 0,
                        optimizer_kind=optimizer_kind(optimizer) if optimizer else "",
                        shapes=tuple(tp_rank_shape(p) for p in params),
                        element_bytes=params[0].element_size() if params else 4,
                        resharded=tuple(gathered), reset=reset)


def tp_rank_params(model: torch.nn.Module) -> int:
    """Parameters one tensor-parallel rank holds before ZeRO shards them: a weight TP splits
    counts 1/tp, one it leaves whole (norms, often the embedding and head) counts whole."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        p = cast(Any, p)
        count = p.numel()
        names = list(p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else []
        if "tp" in names and not p.placements[names.index("tp")].is_replicate():
            count = -(-count // p.device_mesh.size(names.index("tp")))
        total += count
    return total


def tp_rank_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``p`` on one tensor-parallel rank: a dim TP splits is ceil(size / tp)."""
    from torch.distributed.tensor import DTensor

    shape = list(p.shape)
    if isinstance(p, DTensor):
        names = list(p.device_mesh.mesh_dim_names or ())
        if "tp" in names:
            dim = getattr(p.placements[names.index("tp")], "dim", None)
            if isinstance(dim, int):
                size = p.device_mesh.size(names.index("tp"))
                shape[dim % p.ndim] = -(-shape[dim % p.ndim] // size)
    return tuple(shape)


def _params_on_host(model: torch.nn.Module) -> bool:
    """Whether meshlab's FSDP2 keeps this model's shards in host memory (any stage of it)."""
    return any(getattr(m, "params_on_host", False) for m in model.modules())


def activation_bytes(model: torch.nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd keeps for backward during one forward of ``model`` on this process.

    Parameters that matmuls save are not activations and are left out; a tensor saved
    twice counts once. Compare plans (checkpointing, sequence parallel) by this number;
    it is not Korthikanti's per-layer formula, which also counts dropout masks.
    """
    return sum(activation_placement(model, *inputs))


def activation_placement(model: torch.nn.Module, *inputs: torch.Tensor) -> tuple[int, int]:
    """``(device, host)``: the bytes one forward saves for backward on the device, and those
    activation offloading (meshlab.parallel.offload) moves to host memory, as it moves them."""
    offloads: list[Any] = [cast(Any, m).activation_offload for m in model.modules()
                           if hasattr(m, "activation_offload")]
    for hooks in offloads:
        hooks.moved = 0
    params = {_data_ptr(local_shard(p)) for p in model.parameters()}
    seen: set[tuple[int, int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        local = local_shard(t)
        ptr = _data_ptr(local)
        key = (ptr, int(local.storage_offset()), local.numel())
        # FSDP2's gathered parameters are not the shards in ``params``: known by their type
        if not (is_parameter(t) or ptr in params or key in seen or local.device.type == "meta"):
            seen.add(key)
            total += local.numel() * local.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    finally:  # a forward without backward leaves FSDP2's root gathered: undo it
        reshard(model)
    return total, sum(hooks.moved for hooks in offloads)


def is_parameter(t: torch.Tensor) -> bool:
    """Whether ``t`` is a parameter or a view of one (the transposed weight a linear layer
    saves for backward), FSDP2's gathered parameters included: no activation, and resident
    anyway, so not worth offloading."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def reshard(model: torch.nn.Module) -> tuple[list[str], bool]:
    """Reshard every FSDP2 module in ``model`` a forward left unsharded: (their names, ""
    for ``model`` itself; whether a step that raised had to be reset first).

    FSDP2 does not reshard the root after forward (backward would gather it again), so a
    forward without backward leaves the module's parameters as full, unsharded tensors that
    are not the ones the optimizer holds. Resharding puts the sharded parameters back; the
    next forward gathers them again as usual. A forward or backward that raised leaves FSDP
    mid-step, where resharding does nothing: torch's recovery, ``reset_iter_state()`` on the
    root (which the next step needs anyway; the failed step's gradients are dropped), comes
    first. A no-op for anything else.
    """
    if not torch.distributed.is_available():
        return [], False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return [], False
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    # FSDP2 says whether a unit is gathered, and whether a step is under way, here only
    states = [(name, m, m._get_fsdp_state()) for name, m in units]
    gathered = [name for name, _, state in states
                if any(g.is_unsharded for g in getattr(state, "_fsdp_param_groups", []))]
    aborted = any(state._training_state.name != "IDLE" for _, _, state in states)
    roots = [m for _, m, state in states if state._is_root]
    reset = aborted and bool(roots) and hasattr(roots[0], "reset_iter_state")
    if reset:
        roots[0].reset_iter_state()
    for _, module in units:
        module.reshard()
    return gathered, reset


def gathered_note(names: Iterable[str], reset: bool = False) -> str:
    """What to say of FSDP units ``reshard`` found gathered ("" if none)."""
    units = sorted(set(names))
    if not units:
        return ""
    shown = ", ".join(n or "the model itself" for n in units[:3]) + (
        f" and {len(units) - 3} more" if len(units) > 3 else "")
    if reset:
        return (f"FSDP held {shown} gathered, mid-step after a forward or backward that "
                "raised: meshlab called torch's recovery, reset_iter_state() on the model "
                "(the next step needs it; that step's gradients are dropped), and read the "
                "shards")
    return (f"FSDP held {shown} gathered (a forward not followed by its backward): "
            "resharded before reading, as the next forward would find them")


def _data_ptr(t: torch.Tensor) -> int:
    # FSDP frees the storage of unsharded parameters between uses: no pointer to compare
    try:
        return int(t.untyped_storage().data_ptr())
    except RuntimeError:
        return -1
