"""A model built on the meta device, given memory only after it is sharded.

``parallelize`` takes a model built under ``torch.device("meta")`` (no memory behind its
weights), shards it, then allocates only this rank's shards and fills them as one process
fills the whole model: module by module, the model's own init (transformers'
``_init_weights``, else the module's ``reset_parameters()``) runs on full-size copies of
that one module's tensors, seeded by the seed and the module's name, and each rank keeps its
part of the result (DeepSpeed's zero.Init also builds one module whole at a time). So no
rank holds more of the model than its shards and its largest module, every rank agrees on
the values whatever part it holds (a pipeline stage, an expert slice, a TP shard, a tied
weight on another stage), and ``materialize`` of the unsharded model in one process gives
the same numbers.

Why not DTensor's offset-based RNG, which needs no full-size copy: it serves CUDA's Philox
generator only; CPU ranks draw from a Mersenne Twister, which cannot skip ahead.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from meshlab.parallel.agree import agree
from meshlab.parallel.blocks import clean_name

Init = Callable[[nn.Module], None]

_SLICES = "_meshlab_slices"
_fake: Any = None  # the FakeTensorMode of fake_tensors(), while it is active


def on_meta(model: nn.Module) -> bool:
    """Whether any of the model's parameters or buffers has no memory yet (the meta device)."""
    return any(t.device.type == "meta" for t in _tensors(model))


def mark_slice(module: nn.Module, attr: str, *, dim: int, start: int) -> None:
    """``module.<attr>`` now holds rows ``start:`` (along ``dim``) of the full tensor (an
    expert-parallel rank's experts): ``materialize`` cuts the same rows from the init."""
    module.__dict__.setdefault(_SLICES, {})[attr] = (dim, start)


def marked_slice(module: nn.Module, attr: str) -> tuple[int, int] | None:
    """``(dim, start)`` of the part ``module.<attr>`` holds, as ``mark_slice`` noted; None if
    it holds the whole tensor."""
    cut = getattr(module, _SLICES, {}).get(attr)
    return None if cut is None else (int(cut[0]), int(cut[1]))


@dataclass(slots=True)
class Origins:
    """The unsharded model, taken before sharding changes it: which module initializes each
    tensor (a tied weight: the module that holds it first), at what full shape, and how."""

    modules: dict[str, nn.Module]
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]]
    """Module name -> its own tensors' full shapes and dtypes."""
    origin: dict[str, tuple[str, str]]
    """Every tensor's name (each name of a tied one) -> (module name, attribute)."""
    inits: dict[str, Init]


def record(model: nn.Module, init: Init | None = None) -> Origins:
    """The model's ``Origins``; ValueError names a module on meta that nothing can
    initialize (before any rank shards or allocates anything, so all refuse alike)."""
    modules = dict(model.named_modules(remove_duplicate=False))
    shapes: dict[str, dict[str, tuple[torch.Size, torch.dtype]]] = {}
    origin: dict[str, tuple[str, str]] = {}
    first: dict[int, tuple[str, str]] = {}
    for name, module in modules.items():
        for attr, t in _own(module):
            key = f"{name}.{attr}" if name else attr
            where = first.setdefault(id(t), (name, attr))
            origin[key] = where
            if where == (name, attr):
                shapes.setdefault(name, {})[attr] = (t.shape, t.dtype)
    inits: dict[str, Init] = {}
    lacking = []
    for name in shapes:
        found = init or _model_init(modules, name)
        if found is None and _fake is not None:
            found = _nothing  # a dry run's fake tensors are filled by nothing
        if found is None:
            lacking.append(f"{name or 'the model'} ({type(modules[name]).__name__}: "
                           f"{', '.join(shapes[name])})")
        else:
            inits[name] = found
    if lacking:
        raise ValueError(f"the model is on the meta device and meshlab cannot initialize "
                         f"{'; '.join(lacking[:3])}: the module has no reset_parameters() and "
                         "is not part of a transformers model (whose _init_weights would "
                         "do): give it a reset_parameters(), pass parallelize(..., "
                         "init=fn) with fn(module) filling a module's own tensors, or build "
                         "the model off the meta device")
    return Origins(modules, shapes, origin, inits)


def _model_init(modules: dict[str, nn.Module], name: str) -> Init | None:
    """transformers' init of the nearest model around ``name`` (its ``smart_apply`` picks
    the same), else the module's own ``reset_parameters``."""
    parts = name.split(".") if name else []
    for i in range(len(parts), -1, -1):
        owner = modules.get(".".join(parts[:i]))
        if callable(getattr(owner, "_init_weights", None)) and hasattr(owner, "config"):
            return owner._init_weights  # type: ignore[union-attr,return-value]
    if callable(getattr(modules[name], "reset_parameters", None)):
        return _reset
    return None


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


def _nothing(module: nn.Module) -> None:
    pass


@contextmanager
def fake_tensors() -> Iterator[Any]:
    """Inside, ``materialize`` allocates fake tensors (shapes, no memory) in the
    FakeTensorMode it yields and initializes nothing: a dry run (meshlab.dry_run.run) then runs
    a step in that mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    global _fake
    mode = _fake = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        yield mode
    finally:
        _fake = None


def materialize(model: nn.Module, origins: Origins | None = None, *,
                device: torch.device | str | None = None, seed: int = 0) -> nn.Module:
    """Allocate the model's meta tensors on ``device`` (default: this rank's) and fill them
    with the model's own init, seeded by ``seed`` and each module's name; tensors already
    in memory are kept. ``origins``: recorded before sharding (default: of ``model`` as it
    is, unsharded)."""
    from meshlab import runtime

    meta = {clean_name(n) for n, t in _named_tensors(model) if t.device.type == "meta"}
    if not meta:
        if _fake is None:
            _agree(None)  # a pipeline stage with nothing left to fill still takes part
        return model
    origins = origins or record(model)
    device = torch.device(device) if device is not None else runtime.device()
    if _fake is not None:
        with _fake:
            _allocate(model, device)
        return model
    _allocate(model, device)
    problem = None
    try:
        _fill(model, origins, meta, device, seed)
    except ValueError as e:
        problem = str(e)
    _agree(problem)
    return model


def _allocate(model: nn.Module, device: torch.device) -> None:
    """Memory for the meta tensors. FSDP2's units need ``to_empty`` (it re-pads their
    shards), which reallocates everything, so the tensors that had memory are put back."""
    from torch.distributed.fsdp import FSDPModule

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        kept = {id(t): (t, _local(t).detach().clone()) for t in _tensors(model)
                if t.device.type != "meta"}
        names = {n: id(t) for n, t in _named_tensors(model) if id(t) in kept}
        model.to_empty(device=device)
        with torch.no_grad():
            for name, t in _named_tensors(model):
                if name in names:
                    _local(t).copy_(kept[names[name]][1])
        return
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for attr, t in table.items():
                if t is None or t.device.type != "meta":
                    continue
                if id(t) not in made:
                    made[id(t)] = (_give_memory(t, device) if isinstance(t, nn.Parameter)
                                   else _empty(t, device))
                table[attr] = made[id(t)]


def _give_memory(param: nn.Parameter, device: torch.device) -> nn.Parameter:
    """Memory for a meta parameter, keeping what parallelisms put on it (expert parallel's
    gradient-averaging hooks and marks): the same object where it can be (swap_tensors), a
    new one carrying them in a fake mode (whose tensors swap_tensors refuses)."""
    hooks = list((getattr(param, "_backward_hooks", None) or {}).values())
    after = list((getattr(param, "_post_accumulate_grad_hooks", None) or {}).values())
    kept = {k: v for k, v in param.__dict__.items()
            if k not in ("_backward_hooks", "_post_accumulate_grad_hooks")}
    new = nn.Parameter(_empty(param, device), param.requires_grad)
    if _fake is None:
        # the Python object stays, the new memory moves in; the autograd hooks stay with
        # the old memory, so they are registered again
        torch.utils.swap_tensors(param, new)
        new = param
        new.__dict__.clear()  # the swap brought the new tensor's (empty) attributes
    new.__dict__.update(kept)
    new._backward_hooks = new._post_accumulate_grad_hooks = None  # type: ignore[assignment]
    for hook in hooks:
        new.register_hook(hook)
    for hook in after:
        new.register_post_accumulate_grad_hook(hook)
    return new


def _empty(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Memory shaped like ``t``, made without passing ``t`` in (a fake mode would keep a
    weak reference to it, and swap_tensors refuses tensors that have one)."""
    local = _local(t)
    memory = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device=device)
    if not _is_dtensor(t):
        return memory
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(memory, t.device_mesh, t.placements,  # type: ignore[attr-defined]
                              run_check=False, shape=t.shape, stride=t.stride())


def _fill(model: nn.Module, origins: Origins, names: set[str], device: torch.device,
          seed: int) -> None:
    """The init of every origin module of ``names``, once each, cut to this rank's parts."""
    wanted: dict[str, list[tuple[str, str]]] = {}
    for name in names:
        if name not in origins.origin:
            raise ValueError(f"{name} is on the meta device but was not part of the model "
                             "parallelize was given: a parallelism added it on meta")
        module_name, attr = origins.origin[name]
        wanted.setdefault(module_name, []).append((name, attr))
    held = {clean_name(n): t for n, t in _named_tensors(model)}
    holders = {clean_name(n): m for n, m in model.named_modules(remove_duplicate=False)}
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            torch.no_grad():
        for module_name, targets in wanted.items():
            torch.manual_seed(module_seed(seed, module_name))
            full = _initialized(origins, module_name, device)
            for name, attr in targets:
                target = held[name]
                owner = holders.get(name.rpartition(".")[0])
                _local(target).copy_(_part(target, full[attr], owner, name))
            del full  # before the next module's: one module whole at a time


def module_seed(seed: int, module_name: str) -> int:
    """The seed one module's init draws from: the same on every rank and in one process."""
    digest = hashlib.sha256(f"{seed}:{module_name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _initialized(origins: Origins, name: str, device: torch.device) -> dict[str, torch.Tensor]:
    """Module ``name``'s own tensors at full size, filled by its init; ValueError when the
    init left one unfilled (it starts as NaN, or an integer's largest value)."""
    module = origins.modules[name]
    full = {attr: _unfilled(shape, dtype, device)
            for attr, (shape, dtype) in origins.shapes[name].items()}
    full = {attr: nn.Parameter(t, requires_grad=False) if attr in module._parameters else t
            for attr, t in full.items()}
    saved = {attr: _swap(module, attr, t) for attr, t in full.items()}
    try:
        origins.inits[name](module)
    finally:
        for attr, t in saved.items():
            _swap(module, attr, t)
    for attr, t in full.items():
        if _still_unfilled(t):
            init = origins.inits[name]
            by = (f"{type(module).__name__}.reset_parameters" if init is _reset
                  else getattr(init, "__qualname__", repr(init)))
            raise ValueError(f"{name}.{attr} {tuple(t.shape)} was left uninitialized by "
                             f"{by} (it is on the meta "
                             "device until parallelize fills it): give "
                             f"{type(module).__name__} a reset_parameters() that fills it, or "
                             "pass parallelize(..., init=fn)")
    return full


def _unfilled(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).max, dtype=dtype, device=device)


def _still_unfilled(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(t.isnan().any())
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).max).any())


def _swap(module: nn.Module, attr: str, t: torch.Tensor) -> torch.Tensor:
    """Put ``t`` in as ``module.<attr>``; returns what was there."""
    table = module._parameters if attr in module._parameters else module._buffers
    old = table[attr]
    table[attr] = t  # type: ignore[assignment]
    return old  # type: ignore[return-value]


def _part(target: torch.Tensor, full: torch.Tensor, owner: nn.Module | None, name: str
          ) -> torch.Tensor:
    """This rank's part of ``full`` for ``target``: its DTensor shard, an expert slice
    (``mark_slice``), both (experts split over ep, then over tp), or all of it."""
    if _is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor

        whole = cast(Any, target).shape  # the DTensor's global shape: its experts only, on ep
        if tuple(whole) != tuple(full.shape):
            full = _part(torch.empty(whole, device="meta"), full, owner, name)
        # src_data_rank=None: each rank cuts its own part, nothing is sent
        return distribute_tensor(full, target.device_mesh, target.placements,  # type: ignore[attr-defined]
                                 src_data_rank=None).to_local()
    if target.shape == full.shape:
        return full
    attr = name.rpartition(".")[2]
    cut = marked_slice(owner, attr) if owner is not None else None
    if cut is None:
        raise ValueError(f"{name} holds {tuple(target.shape)} of a {tuple(full.shape)} tensor "
                         "and nothing says which part: a parallelism sliced it without "
                         "meshlab.parallel.materialize.mark_slice")
    dim, start = cut
    return full.narrow(dim, start, target.shape[dim])


def _agree(problem: str | None) -> None:
    agree(problem, "another rank could not initialize its part of the meta-device model (its "
                   "error says which tensor)")


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if _is_dtensor(t) else t  # type: ignore[attr-defined]


def _own(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for table in (module._parameters, module._buffers):
        for attr, t in table.items():
            if t is not None:
                yield attr, t


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _tensors(model: nn.Module) -> Iterator[torch.Tensor]:
    for _, t in _named_tensors(model):
        yield t


__all__ = ["Origins", "fake_tensors", "mark_slice", "materialize", "module_seed", "on_meta",
           "record"]
