"""What fused kernels keep for the backward, for a dry run on fake tensors.

Run op by op, a model keeps every tensor its ops save: RMSNorm's fp32 copy of its input and
its normalized output before the scale, SiLU's output beside SwiGLU's product, keys and
values repeated to the query heads for the attention. A GPU run with fused kernels
(FlashAttention with grouped keys, fused norms and SwiGLU, torch.compile's blocks) keeps the
inputs such a kernel reads and recomputes the rest in its backward. Within ``fused_memory()``
a step holds what those kernels hold, by three rules on each tensor autograd saves:

1. **A copy is read from its source**: a tensor made by a copy (``_to_copy``: a dtype
   widened; ``clone``: GQA's repeat of an expanded view, a transposed tensor made
   contiguous) whose source takes no more bytes is held as the source. RMSNorm's fp32 copy
   is held as the 16-bit input; repeated keys and values as the projected ones; the
   attention's output, made contiguous for its projection, as the attention's output.
2. **Pointwise chains are recomputed**: a pointwise op's output saved by a pointwise op is
   held as the chain's inputs, followed back through pointwise ops with one full-size input
   (the smaller ones, a norm's per-token statistic or a scale, held as they are), where
   that adds fewer bytes than the tensor. SiLU's output is held as its input (the gate,
   which SiLU keeps anyway); RMSNorm's normalized output as its input and statistic.
3. Everything else is held as eager torch holds it: a matmul's input, the attention's
   output and log-sum-exp, a loss's log-probabilities.

A tensor not held comes back from the backward as an empty one of its shape (its values
are never read: fake tensors only); the backward allocates it there, as a fused kernel
computes it there. Activation checkpointing's recomputation holds what the rules decide
too. Plain torch, rank side.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import defaultdict
from collections.abc import Iterator
from functools import partial
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}
LOOKS = {torch.ops.aten.detach.default, torch.ops.prim.device.default}
"""Ops that look at a tensor without computing on it (a checkpoint's recomputation detaches
what it saves): not the op that saved it."""
PENDING_OPS = 64
"""Ops a saved input waits for the op that saved it to read it (a DTensor's own first)."""
FOLLOWED = 16
"""Pointwise ops followed back from a saved tensor at most (a norm's chain is six)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's shard on this rank


def _nbytes(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().nbytes()


def _tensors(values: tuple[Any, ...] | list[Any]) -> list[torch.Tensor]:
    """The tensors among an aten op's arguments or results: tensors, and lists of them
    (its schema nests no deeper; torch's pytree walk costs more than the op's own work)."""
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (tuple, list)):
            out += [t for t in v if isinstance(t, torch.Tensor)]
    return out


def _leaves(values: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]


def _pointwise(func: Any) -> bool:
    return torch.Tag.pointwise in getattr(func, "tags", ())


class Saved:
    """One saved tensor: the tensor itself, or what it is recomputed from (``held``) and
    the shape it comes back as."""

    __slots__ = ("held", "like", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.held: list[torch.Tensor] = []
        self.like: tuple[Any, ...] = ()

    def hold(self, held: list[torch.Tensor]) -> None:
        t = self.tensor
        assert t is not None
        spec = ((getattr(t, "device_mesh"), getattr(t, "placements"))  # noqa: B009 (a DTensor)
                if hasattr(t, "_local_tensor") else None)
        local = _local(t)
        self.like = (local.size(), local.stride(), local.dtype, local.device, spec,
                     t.size(), t.stride())
        self.held, self.tensor = held, None

    def unpack(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        size, stride, dtype, device, spec, whole, whole_stride = self.like
        local = torch.empty_strided(size, stride, dtype=dtype, device=device)
        if spec is None:
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, spec[0], spec[1], run_check=False, shape=whole,
                                  stride=whole_stride)


class Made(NamedTuple):
    """How a tensor's memory was made: the op, and its tensor inputs as (the input's own
    record, or -1 for one made before; its elements; its storage's owner and its storage,
    weakly)."""

    func: Any
    inputs: list[tuple[int, int, weakref.ref[torch.Tensor], weakref.ref[Any]]]


class FusedMemory(TorchDispatchMode):
    """Records which op made each tensor's memory and decides what each saved tensor is
    held as (the module's docstring). Records outlive their tensors (a chain runs through
    temporaries); a storage maps to its record only while it lives."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Made] = []
        self.record_of: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> record
        self.held: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storages held by saves
        # a forward's repeat (a copy of an expanded view) keeps its source while it lives
        # (GQA's repeat drops the keys' only other name): rule 1 holds it in the copy's place
        self.repeated: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.pending: list[tuple[Saved, int]] = []  # saved inputs, ops since
        # a live tensor on each storage seen: a recomputation reads tensors through aliases
        # that go before their storage does
        self.owner: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        aten = isinstance(func, torch._ops.OpOverload)  # a higher-order op nests deeper
        inputs = [_local(t) for t in (_tensors((*args, *(kwargs or {}).values())) if aten
                                      else _leaves((args, kwargs)))]
        storages = [t.untyped_storage() for t in inputs]
        if self.pending:
            # autograd saves an op's inputs before the op runs: the first op to read a
            # pending tensor saved it (a DTensor's own ops come first and read none); an
            # output an op saved itself (the attention's, a softmax's) is decided by its
            # first reader, where a tensor of a fused chain would be recomputed too
            waiting = []
            for saved, age in self.pending:
                st = _local(saved.tensor).untyped_storage() if saved.tensor is not None else None
                if st is not None and any(st is s for s in storages) and func not in LOOKS:
                    self._decide(saved, func)
                elif age < PENDING_OPS:
                    waiting.append((saved, age + 1))
                else:
                    self._decide(saved, None)  # never read: held as it is
            self.pending = waiting
        out = func(*args, **(kwargs or {}))
        bases = [t if t._base is None else t._base for t in inputs]
        for base, st in zip(bases, storages, strict=True):
            self._own(st, base)
        made: Made | None = None
        for t in (_tensors(out if isinstance(out, (tuple, list)) else (out,)) if aten
                  else _leaves(out)):
            local = _local(t)
            st = local.untyped_storage()
            self._own(st, local if local._base is None else local._base)
            if all(st is not s for s in storages):  # not a view of an input: new memory
                if made is None:
                    made = Made(func, [(self.record_of.get(s, -1), t.numel(), weakref.ref(b),
                                        weakref.ref(s))
                                       for t, b, s in zip(inputs, bases, storages, strict=True)])
                    self.records.append(made)
                self.record_of[st] = len(self.records) - 1
                if (func in COPIES and torch.is_grad_enabled() and 0 in inputs[0].stride()
                        and storages[0].nbytes() < st.nbytes()):
                    self.repeated[st] = self._alive(made.inputs[0])
        return out

    def pack(self, t: torch.Tensor) -> Saved:
        saved = Saved(t)
        if not _fake(t):
            return saved
        st = _local(t).untyped_storage()
        source = self._copied_from(st)
        if source is not None:
            saved.hold([source])
            self.held[source.untyped_storage()] = True
        else:  # decided by the first op to read it (an op saves its inputs before it runs)
            self.pending.append((saved, 0))
        return saved

    def _copied_from(self, st: Any) -> torch.Tensor | None:
        """Rule 1: the source of a copy that takes no more bytes than ``st``."""
        if st in self.repeated:
            return self.repeated[st]
        record = self.record_of.get(st)
        if record is None or self.records[record].func not in COPIES:
            return None
        source = self._alive(self.records[record].inputs[0])
        return source if source is not None and _nbytes(source) <= st.nbytes() else None

    def _decide(self, saved: Saved, saver: Any) -> None:
        """Rule 2 for a tensor ``saver`` saved; rule 3 where it does not apply."""
        t = saved.tensor
        if t is None:
            return
        st = _local(t).untyped_storage()
        record = self.record_of.get(st)
        held = (self._chain_inputs(record, _local(t).numel(), FOLLOWED)
                if _pointwise(saver) and record is not None else None)
        if held is not None:
            added = sum(h.untyped_storage().nbytes()
                        for h in {id(h.untyped_storage()): h for h in held}.values()
                        if h.untyped_storage() not in self.held)
            if added < st.nbytes():
                saved.hold(held)
                for h in held:
                    self.held[h.untyped_storage()] = True
                return
        self.held[st] = True

    def _own(self, storage: Any, owner: torch.Tensor) -> None:
        """``owner`` among ``storage``'s live aliases."""
        known = self.owner.get(storage)
        if known is None:
            self.owner[storage] = [weakref.ref(owner)]
        elif all(ref() is not owner for ref in known):  # a new alias: the dead ones go
            self.owner[storage] = [ref for ref in known if ref() is not None] + [
                weakref.ref(owner)]

    def _alive(self, made_input: tuple[int, int, Any, Any]) -> torch.Tensor | None:
        """The tensor an op read, or a live one on its storage where that alias is gone."""
        tensor, storage = made_input[2](), made_input[3]()
        if tensor is None and storage is not None:
            tensor = next((t for ref in self.owner.get(storage, ()) if (t := ref()) is not None),
                          None)
        return tensor

    def _chain_inputs(self, record: int, numel: int, budget: int
                      ) -> list[torch.Tensor] | None:
        """What a fused kernel reads to recompute the tensor ``record`` made (``numel``
        elements): back through pointwise ops (and copies) with one full-size input; None
        where a pointwise op did not make it, or a tensor it needs is gone."""
        made = self.records[record]
        if budget == 0 or not (_pointwise(made.func) or made.func in COPIES):
            return None
        full = [i for i in made.inputs if i[1] == numel]
        if len(full) != 1:
            return None
        small = [self._alive(i) for i in made.inputs if i[1] != numel]
        back = full[0][0]
        chain = self._chain_inputs(back, numel, budget - 1) if back >= 0 else None
        if chain is None:
            chain = [self._alive(full[0])]  # type: ignore[list-item]
        held = chain + small
        return None if any(h is None for h in held) else held  # type: ignore[return-value]


def _fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(_local(t), FakeTensor)


class _Recomputed(weakref.WeakKeyDictionary):
    """A checkpoint's recomputed tensors, held as the fused kernels' forward would hold them
    (torch's checkpoint saves them under hooks of its own, which the mode's never see)."""

    def __init__(self, mode: FusedMemory) -> None:
        super().__init__()
        self.mode = mode

    def __setitem__(self, handle: Any, tensor: torch.Tensor) -> None:
        super().__setitem__(handle, self.mode.pack(tensor))

    def __getitem__(self, handle: Any) -> torch.Tensor:
        return super().__getitem__(handle).unpack()


@contextlib.contextmanager
def _fused_recomputation(mode: FusedMemory) -> Iterator[None]:
    """Within: activation checkpointing's recomputed forward holds what fused kernels keep
    too. Its check that the recomputed tensors match the saved ones is left out (it would
    allocate each tensor a fused kernel does not keep, to read its shape)."""
    from torch.utils import checkpoint

    frame, hook = checkpoint._CheckpointFrame, checkpoint._recomputation_hook
    original = frame.__init__

    def init(self: Any, recompute_fn: Any, early_stop: Any, unpack_error_cb: Any,
             metadata_fn: Any) -> None:
        original(self, recompute_fn, early_stop, unpack_error_cb, metadata_fn)
        self.recomputed = defaultdict(partial(_Recomputed, mode))
        self.check_recomputed_tensors_match = lambda gid: None

    class Recomputation(hook):  # type: ignore[misc, valid-type]
        """Stores what the recomputation saves in the frame, and nothing in the
        recomputation's own graph, which no backward runs through."""

        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            store: Any = getattr(self, "pack_hook")  # noqa: B009 (set by the base)

            def pack(x: torch.Tensor) -> None:
                store(x)

            self.pack_hook = pack

    frame.__init__ = init  # type: ignore[method-assign]
    setattr(checkpoint, "_recomputation_hook", Recomputation)  # noqa: B010 (a class)
    try:
        yield
    finally:
        frame.__init__ = original  # type: ignore[method-assign]
        setattr(checkpoint, "_recomputation_hook", hook)  # noqa: B010


@contextlib.contextmanager
def fused_memory() -> Iterator[FusedMemory]:
    """Within: autograd saves what fused kernels keep (the module's docstring), in the
    forward and in a checkpoint's recomputation; on fake tensors only (a real tensor is
    saved as it is)."""
    from meshlab.dry_run.fused_attention import FusedAttention

    mode = FusedMemory()
    with mode, torch.autograd.graph.saved_tensors_hooks(mode.pack, Saved.unpack), \
            _fused_recomputation(mode), FusedAttention():
        yield mode
