"""Sequence parallelism's inputs gathered again in the backward (Megatron-LM's way).

With sequence parallelism a module holding column-parallel projections (the attention, the
MLP) gets the whole sequence, gathered from every tp rank's part. Autograd keeps what the
projections read for their weights' gradients: the gathered input, ``tp`` times the part
each rank holds. Megatron keeps the part instead and gathers it once more in the backward
(Korthikanti et al. 2022, section 4.2.2): one more all-gather a module, and 4h bytes a token
a layer become 4h/tp.

``Regather`` does that around one module's forward: a saved tensor that is the gathered
input, a view of it, or autocast's 16-bit copy of it is kept as this rank's part and made
again (gathered, cast, viewed alike) when the backward unpacks it. Every other saved tensor,
and the part itself, go through whatever hooks were installed outside it (activation
checkpointing's, offload's, the dry run's), so it composes with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

# autograd nodes that make a tensor from the gathered input keeping its values
_SAME_VALUES = frozenset((
    "ViewBackward0", "UnsafeViewBackward0", "TBackward0", "TransposeBackward0",
    "PermuteBackward0", "ReshapeAliasBackward0", "ExpandBackward0", "AliasBackward0",
    "ToCopyBackward0", "_ToTorchTensorBackward", "_FromTorchTensorBackward"))


def _local(t: torch.Tensor) -> torch.Tensor:
    # not measure.memory.local_shard: its to_local() would record an autograd node from
    # inside a pack hook, for a tensor only read for its storage and geometry
    return t._local_tensor if isinstance(t, DTensor) else t


def _storage(t: torch.Tensor) -> int:
    return int(_local(t).untyped_storage()._cdata)


class _Source:
    """One gathered input's part, shared by every saved tensor made from it (q, k and v
    read one input): the whole is gathered again once, at the first of their unpacks, and
    let go at the last."""

    __slots__ = ("left", "part", "unpack", "whole")

    def __init__(self, part: Any, unpack: Any) -> None:
        self.part, self.unpack = part, unpack  # as the outer hooks packed it, and theirs
        self.left = 0  # saved tensors not yet unpacked
        self.whole: torch.Tensor | None = None

    def regathered(self) -> torch.Tensor:
        whole = self.whole
        if whole is None:  # the part as the outer hooks give it back (recomputed, moved back)
            part = self.unpack(self.part) if self.unpack else self.part
            assert isinstance(part, DTensor)
            with torch.no_grad():
                whole = part.redistribute(placements=[Replicate()]).to_local()
        self.left -= 1
        self.whole = whole if self.left > 0 else None
        return whole


@dataclass(frozen=True, slots=True)
class _Packed:
    """A saved tensor kept as its gathered input's part, and how to make it again (not the
    gathered tensor: holding it would keep what this module exists to free)."""

    source: _Source
    dtype: torch.dtype
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # from the start of the gathered input (or of its cast copy)
    spec: tuple[Any, Any] | None  # a saved DTensor's mesh and placements

    def again(self) -> torch.Tensor:
        """The saved tensor, made again: the gathered input, then autocast's cast and the
        view, as the forward made them."""
        local = self.source.regathered()
        if local.dtype != self.dtype:
            local = local.to(self.dtype)
        view = local.as_strided(self.size, self.stride, local.storage_offset() + self.offset)
        if self.spec is None:
            return view
        return DTensor.from_local(view, *self.spec, run_check=False)


class Regather:
    """The saved-tensor hooks of one module's forward (the module docstring)."""

    def __init__(self) -> None:
        self.gathered: list[tuple[torch.Tensor, torch.Tensor]] = []  # (part, whole), running
        self.sources: dict[int, _Source] = {}  # by the gathered input's index
        self.outer: tuple[Any, Any] | None = None
        self.active = False

    def gathered_from(self, part: torch.Tensor, whole: torch.Tensor) -> None:
        self.gathered.append((part.detach(), whole))

    def enter(self) -> None:
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        torch._C._autograd._push_saved_tensors_default_hooks(self.pack, self.unpack)
        self.active = True

    def exit(self) -> None:
        if self.active:
            torch._C._autograd._pop_saved_tensors_default_hooks()
        self.gathered, self.sources, self.outer, self.active = [], {}, None, False

    def pack(self, saved: torch.Tensor) -> Any:
        outer = self.outer
        found = self._source(saved)
        if found is None:
            return outer, (outer[0](saved) if outer else saved)
        index, same_storage = found
        part, whole = self.gathered[index]
        source = self.sources.get(index)
        if source is None:
            source = self.sources[index] = _Source(outer[0](part) if outer else part,
                                                   outer[1] if outer else None)
        source.left += 1
        local = _local(saved)
        offset = int(local.storage_offset()) - (int(_local(whole).storage_offset())
                                                if same_storage else 0)
        spec = (saved.device_mesh, saved.placements) if isinstance(saved, DTensor) else None
        return outer, _Packed(source, saved.dtype, local.size(), local.stride(), offset, spec)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        outer, inner = packed
        if isinstance(inner, _Packed):
            return inner.again()
        return outer[1](inner) if outer else inner

    def _source(self, saved: torch.Tensor) -> tuple[int, bool] | None:
        """Which gathered input ``saved`` is a view of (same storage), or a copy of in
        another dtype (autograd's record of how it was made)."""
        storage = _storage(saved)
        for index, (_, whole) in enumerate(self.gathered):
            if storage == _storage(whole):
                return index, True
        node = saved.grad_fn
        while node is not None:
            for index, (_, whole) in enumerate(self.gathered):
                if node is whole.grad_fn:
                    return index, False
            if type(node).__name__ not in _SAME_VALUES or not node.next_functions:
                return None
            node = node.next_functions[0][0]
        return None
