"""save_pretrained: the shards out as one save_pretrained folder, gathered a tensor at a
time and streamed into safetensors files by rank 0."""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import struct
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
from meshlab.pretrained.held import INDEX, SINGLE, held_tensors, model_class, reshard_all, unwrap
from meshlab.pretrained.keys import natural_order
from meshlab.pretrained.load import ep_place

MAX_SHARD_BYTES = 5 * 10**9
"""transformers' default shard size ("5GB")."""


def save_pretrained(model: nn.Module, folder: str | os.PathLike[str], *,
                    mesh: DeviceMesh | None = None, config: Any = None,
                    max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``model`` (parallelized or not) as a folder ``from_pretrained`` loads in one
    process; every rank calls it (a collective), rank 0 writes. Keys are the plain model's,
    a tied weight once; safetensors shards of at most ``max_shard_bytes`` (with
    ``model.safetensors.index.json`` when several), and ``config.json`` from ``config`` or the
    model's own. One full tensor at a time on any rank; written into ``<folder>.partial-<id>``
    and moved into place at the end (files of an existing folder that are not weights, a
    tokenizer's, are kept); a failure removes the partial folder and raises CheckpointError
    on every rank naming the file and the OS error. ``mesh``: places expert slices that carry
    no mark of parallelize's (made outside it, or materialized from meta, which drops it)."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be a positive number of "
                         "bytes (transformers' default is 5e9)")
    inner = unwrap(model)
    reshard_all(model)
    target = Path(folder)
    if config is None:
        config = getattr(inner, "config", None)
    if config is None:  # a pipeline stage keeps its causal LM's config there
        config = getattr(inner.__dict__.get("causal_lm"), "config", None)
    together = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if together else 0
    mine = _to_save(model, inner, mesh)
    table = [(name, shape, str(dtype).removeprefix("torch."))
             for name, (_, shape, dtype, _) in mine.items()]
    tables: list[Any] = [table]
    if together:
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, table)
    order, holders, meta = _union(tables, inner)
    writer = _Writer(target, order, meta, max_shard_bytes) if rank == 0 else None
    if writer is not None:
        writer.begin()
    failed = _from_rank0(writer.failed if writer else None, together)
    if failed is not None:
        raise _not_saved(target, failed)
    quiet = logging.getLogger("torch.distributed.tensor._redistribute")  # _StridedShard's notes
    level, quiet.level = quiet.level, logging.ERROR
    try:
        for name in order:
            full = _gather(*mine[name]) if name in mine else None
            sender = 0 if 0 in holders[name] else min(holders[name])
            if sender != 0 and rank == sender:
                assert full is not None
                dist.send(full.contiguous().to(_comm_device()), dst=0)
            elif sender != 0 and writer is not None:
                shape, dtype = meta[name]
                full = torch.empty(shape, dtype=_dtype(dtype), device=_comm_device())
                dist.recv(full, src=sender)
            if writer is not None:
                assert full is not None
                writer.write(name, full)
            del full
    except BaseException:
        if writer is not None:  # not a write that failed (those are kept): leave no folder
            writer.abandon()
        raise
    finally:
        quiet.setLevel(level)
    if writer is not None:
        writer.finish(config, model_class(inner), inner)
    failed = _from_rank0(writer.failed if writer else None, together)
    if failed is not None:
        raise _not_saved(target, failed)


def _to_save(model: nn.Module, inner: nn.Module, mesh: DeviceMesh | None
             ) -> dict[str, tuple[torch.Tensor, tuple[int, ...], torch.dtype, Any]]:
    """This rank's tensors to save: name -> (tensor, global shape, dtype, ep group or None);
    a tied weight once, a pipeline's copy of a tied head not at all."""
    from torch.distributed.tensor import DTensor

    from meshlab.parallel.clip import COPY, PARTS

    names, groups = held_tensors(model)
    aliases = dict(getattr(inner, "all_tied_weights_keys", None) or {})
    ep = ep_place(mesh)
    ep_group = mesh["ep"].get_group() if mesh is not None and ep is not None else None
    out = {}
    for group in groups:
        kept = [n for n in group if n not in aliases] or group  # the embedding, not the head
        name = kept[0]
        tensor = names[name]
        if getattr(tensor, COPY, False):
            continue
        parts = getattr(tensor, PARTS, None)
        if parts is None and ep_group is not None and _is_expert_slice(inner, name):
            parts = ep_group
        shape = list(tensor.shape)
        if parts is not None:
            shape[0] *= dist.get_world_size(parts)
        dtype = tensor.dtype if not isinstance(tensor, DTensor) else tensor.to_local().dtype
        out[name] = (tensor, tuple(shape), dtype, parts)
    return out


def _is_expert_slice(inner: nn.Module, name: str) -> bool:
    """A stacked experts weight in the model's EP plan (for slices no parallelize marked)."""
    from meshlab.parallel.expert import STACKED, _ep_plan, _matches

    return any(style == STACKED and _matches(p, name) for p, style in _ep_plan(inner).items())


def _union(tables: list[Any], inner: nn.Module
           ) -> tuple[list[str], dict[str, list[int]], dict[str, tuple[tuple[int, ...], str]]]:
    """Every rank's tensors: the names in order, who holds each, and its shape and dtype."""
    holders: dict[str, list[int]] = {}
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for r, table in enumerate(tables):
        for name, shape, dtype in table:
            holders.setdefault(name, []).append(r)
            meta.setdefault(name, (tuple(shape), dtype))
    # a tied head whose embedding another stage saves is that embedding
    aliases = dict(getattr(inner, "all_tied_weights_keys", None) or {})
    order = [n for n in sorted(holders, key=natural_order)
             if not (n in aliases and aliases[n] in holders)]
    return order, holders, meta


def _gather(tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, parts: Any
            ) -> torch.Tensor:
    """The whole tensor on every rank holding part of it (one collective per tensor)."""
    from torch.distributed.tensor import DTensor

    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    full = full.detach()
    if parts is not None:
        pieces = [torch.empty_like(full) for _ in range(dist.get_world_size(parts))]
        dist.all_gather(pieces, full.contiguous(), group=parts)
        full = torch.cat(pieces)
    return full


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def _from_rank0(value: Any, together: bool) -> Any:
    if not together:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _not_saved(target: Path, failed: str) -> Exception:
    from meshlab.checkpoint.failures import CheckpointError

    return CheckpointError(f"pretrained folder {target} not saved: {failed}")


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
                      torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
                      torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


class _Writer:
    """Rank 0's side of save_pretrained: shards planned from the names, shapes and dtypes
    alone, each tensor streamed into its shard as it arrives; the first failure is kept as
    text (``failed``) and writing stops, while the gathering goes on (the other ranks are
    in it)."""

    def __init__(self, target: Path, order: list[str],
                 meta: dict[str, tuple[tuple[int, ...], str]], max_shard_bytes: int) -> None:
        self.target = target
        self.partial = target.with_name(f"{target.name}.partial-{uuid.uuid4().hex[:12]}")
        self.failed: str | None = None
        self.shards: list[list[str]] = [[]]
        size = 0
        self.nbytes = {}
        for name in order:
            shape, dtype = meta[name]
            n = _dtype(dtype).itemsize
            for s in shape:
                n *= s
            self.nbytes[name] = n
            if self.shards[-1] and size + n > max_shard_bytes:
                self.shards.append([])
                size = 0
            self.shards[-1].append(name)
            size += n
        count = len(self.shards)
        self.files = [SINGLE] if count == 1 else \
            [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.meta = meta
        self.shard_of = {n: i for i, names in enumerate(self.shards) for n in names}
        self.stream: Any = None
        self.current = -1

    def abandon(self) -> None:
        self._close()
        shutil.rmtree(self.partial, ignore_errors=True)

    def begin(self) -> None:
        if self.target.exists() and not self.target.is_dir():
            self.failed = (f"{self.target} is a file, not a folder; pass a folder path "
                           "(it is created)")
            return
        self._do("creating", self.partial, lambda: self.partial.mkdir(parents=True))

    def _do(self, doing: str, path: Path, action: Callable[[], Any]) -> None:
        from meshlab.checkpoint.failures import file_size, reason_of, removed, size_text

        if self.failed is not None:
            return
        try:
            action()
        except Exception as e:
            written = file_size(path) if doing == "writing" else None
            after = f" after {size_text(written)}" if written is not None else ""
            self._close()
            self.failed = f"{reason_of(e)} {doing} {path}{after} on rank 0; {removed(self.partial)}"

    def write(self, name: str, tensor: torch.Tensor) -> None:
        shard = self.shard_of[name]
        path = self.partial / self.files[shard]
        if shard != self.current:
            self._close()
            self.current = shard
            self._do("writing", path, lambda: self._open(shard, path))
        data = tensor.detach().to("cpu", _dtype(self.meta[name][1])).contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy()  # the tensor's own bytes, no copy
        self._do("writing", path, lambda: self.stream.write(raw.data))

    def _open(self, shard: int, path: Path) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        start = 0
        for name in self.shards[shard]:
            shape, dtype = self.meta[name]
            header[name] = {"dtype": SAFETENSORS_DTYPES[_dtype(dtype)], "shape": list(shape),
                            "data_offsets": [start, start + self.nbytes[name]]}
            start += self.nbytes[name]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes
        self.stream = open(path, "wb")  # noqa: SIM115 - closed by _close, across writes
        self.stream.write(struct.pack("<Q", len(raw)) + raw)

    def _close(self) -> None:
        if self.stream is not None:
            stream, self.stream = self.stream, None
            try:
                stream.close()
            except OSError as e:
                if self.failed is None:
                    from meshlab.checkpoint.failures import reason_of

                    self.failed = f"{reason_of(e)} writing {stream.name} on rank 0"

    def finish(self, config: Any, architecture: str, inner: nn.Module) -> None:
        self._close()
        if len(self.files) > 1:
            index = {"metadata": {"total_size": sum(self.nbytes.values())},
                     "weight_map": {n: self.files[self.shard_of[n]] for n in self.shard_of}}
            self._do("writing", self.partial / INDEX, lambda: (self.partial / INDEX).write_text(
                json.dumps(index, indent=2, sort_keys=True) + "\n"))
        if config is not None and hasattr(config, "save_pretrained"):
            config = copy.deepcopy(config)
            config.architectures = [architecture]
            floats = [d for _, d in self.meta.values() if _dtype(d).is_floating_point]
            if floats:
                config.dtype = floats[0]
            self._do("writing", self.partial / "config.json",
                     lambda: config.save_pretrained(self.partial))
            generation = getattr(inner, "generation_config", None)
            can = getattr(inner, "can_generate", None)
            if generation is not None and callable(can) and can():
                self._do("writing", self.partial / "generation_config.json",
                         lambda: generation.save_pretrained(self.partial))
        self._do("moving", self.partial, self._move)

    def _move(self) -> None:
        """The finished folder at ``target``; into an existing folder file by file, its
        weights of an earlier save removed."""
        if not self.target.exists():
            os.rename(self.partial, self.target)
            return
        for path in self.partial.iterdir():
            os.replace(path, self.target / path.name)
        new = set(self.files) | ({INDEX} if len(self.files) > 1 else set())
        for path in [*self.target.glob("model*.safetensors"), self.target / INDEX]:
            if path.name not in new:
                path.unlink(missing_ok=True)
        shutil.rmtree(self.partial, ignore_errors=True)
