"""Sharded checkpoints of named objects on every rank: complete, or reported incomplete.

Every rank writes its own shards with torch.distributed.checkpoint (DCP) into a folder beside
the target, ``<path>.partial-<id>``. Once every rank has written, rank 0 adds ``meshlab.json``
and swaps the folder into place, so a folder at ``path`` either is a whole checkpoint or has
no manifest and is refused. Modules and optimizers go through DCP's state_dict API: their keys
are the plain model's names (no DDP/FSDP wrappers) and their tensors DTensor shards, so a
checkpoint loads into another mesh shape or world size (FSDP2 on 4 ranks -> TP on 2).

    save("ckpt/step100", {"model": model, "optimizer": optimizer, "step": step})
    globals().update(load("ckpt/step100", {"model": model, "optimizer": optimizer, "step": None}))

A save that fails says so in its first line, the same on every rank: the target, the OS error
(``no space left on device (ENOSPC)``), the file and how much of it was written, and what became
of the partial folder. A background save's failure is raised, under its own path, by the next
``save``, ``load`` or ``wait``.

Plain torch only: this also runs inside exported torchrun scripts.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pickle
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from meshlab.checkpoint import failures as failure
from meshlab.checkpoint import integrity
from meshlab.checkpoint.commit import (
    MANIFEST,
    check_replaceable,
    checkpoint_group,
    commit,
    from_rank0,
    not_saved,
)
from meshlab.checkpoint.failures import CheckpointError

FORMAT = 1

# without torch.distributed we pass no_dist=True on purpose; DCP warns about it all the same
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled.*single process")

__all__ = ["MANIFEST", "CheckpointError", "load", "manifest", "save", "wait"]


_pending: tuple[Future[None], Path] | None = None  # this rank's background save and its target
_background: ThreadPoolExecutor | None = None


# -- public API -------------------------------------------------------------------------------

def save(path: str | os.PathLike[str], objects: dict[str, Any], *, async_save: bool = False,
         extra: dict[str, Any] | None = None, group_readable: bool = False) -> None:
    """Save named objects; every rank calls it (a collective).

    Modules and optimizers are saved sharded (each rank its own shards); an optimizer is
    saved against the smallest module among ``objects`` holding all its parameters. Any other
    value (a step counter, a small dict) is saved once, as rank 0 holds it. ``extra`` (JSON)
    goes into the manifest. The folder is 0700 and its files 0600 (a checkpoint holds the
    weights and pickled values): ``group_readable`` makes them 0750 and 0640. With
    ``async_save`` the state is copied now and written in the
    background: call ``wait()`` to know it finished (``save`` and ``load`` wait first, and
    raise its error instead of starting: it is the earlier save that failed, not this one).

    A failed save raises CheckpointError on every rank, naming the OS error, the file and
    what was written, and removes its partial folder (see ``_not_saved``).
    """
    global _pending
    target = Path(path)
    _wait_before(f"saving {target}")
    kinds = _kinds(objects)
    pairs = _models_of(objects, kinds)
    # pickled on every rank so a value that cannot be saved fails everywhere, before any
    # collective (only rank 0's copy is written)
    blobs = {n: pickle.dumps(objects[n]) for n, k in kinds.items() if k == "value"}
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra={extra!r} must be JSON (plain dicts, lists, strings, "
                         f"numbers): {e}") from None
    check_replaceable(target)
    group = checkpoint_group()
    rank = dist.get_rank() if group is not None else 0
    token = from_rank0(uuid.uuid4().hex[:12], group)  # one folder name on every rank
    partial = target.with_name(f"{target.name}.partial-{token}")
    state = _state_dict(objects, kinds, pairs)
    if rank == 0:
        state.update(blobs)
    info = {"format": FORMAT, "names": list(kinds), "kinds": kinds, "optimizers": pairs,
            "world_size": dist.get_world_size() if group is not None else 1,
            "torch": torch.__version__, "extra": extra or {}}
    modes = (0o750, 0o640) if group_readable else (0o700, 0o600)
    # made private before DCP writes into it (under the default umask its files are 0644)
    with contextlib.suppress(OSError):  # DCP's writer meets it too, and names it per rank
        os.makedirs(partial, modes[0], exist_ok=True)
    writer = failure.Writer(partial)
    if not async_save:
        try:
            dcp.save(state, storage_writer=writer, process_group=group, no_dist=group is None)
        except CheckpointException as e:  # a BaseException: `except Exception` misses it
            # DCP's own text is every failing rank's whole traceback (~14,000 characters)
            raise not_saved(failure.failures(e), target, partial, group, rank) from None
        commit(partial, target, info, group, rank, modes)
        return
    # the tensors are copied to CPU here; writing runs on a background thread, whose
    # collectives go over the checkpoint group, never the group the cells use
    try:
        upload = dcp.async_save(state, storage_writer=writer, process_group=group,
                                no_dist=group is None)
    except CheckpointException as e:
        raise not_saved(failure.failures(e), target, partial, group, rank) from None
    done = upload.upload_completion if isinstance(upload, AsyncSaveResponse) else upload

    def finish() -> None:
        try:
            done.result()  # DCP has written every rank's shards and its .metadata
        except CheckpointException as e:
            raise not_saved(failure.failures(e), target, partial, group, rank) from None
        commit(partial, target, info, group, rank, modes)

    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshlab-checkpoint")
    _pending = (_background.submit(finish), target)


def wait() -> None:
    """Block until this rank's background save is done; raise its error, which names the
    checkpoint that was not saved."""
    global _pending
    if _pending is None:
        return
    pending, target = _pending
    try:
        pending.result()
    except CheckpointError:
        raise
    except Exception as e:  # not a failure DCP reported: a dead peer, a bug
        raise CheckpointError(f"checkpoint {target} not saved: the background save failed with "
                              f"{type(e).__name__}: {e}") from e
    finally:
        if pending.done():  # Ctrl-C while waiting leaves it pending: wait() again
            _pending = None


def _wait_before(doing: str) -> None:
    """Finish the background save before ``doing``; its failure is raised instead, under its
    own name, and ``doing`` does not start (the user reruns it)."""
    try:
        wait()
    except CheckpointError as e:
        raise CheckpointError(f"{e}\n(that was a background save, reported here; {doing} did "
                              "not start: run it again)") from None


def load(path: str | os.PathLike[str], objects: dict[str, Any], *,
         trusted: bool = False) -> dict[str, Any]:
    """Load a checkpoint into the live objects named in ``objects``, in place; every rank
    calls it. Returns ``{name: value}`` for each name: the same module or optimizer, or the
    saved plain value (so a plain name may map to None, or anything, before the load).

    Modules and optimizers are resharded to whatever mesh and world size they live on now;
    build them first (the same model and optimizer, any parallel plan). A checkpoint another
    account could have written, or whose files changed since the save, is refused before
    anything is read (meshlab.checkpoint.integrity); ``trusted=True`` loads the former.
    """
    _wait_before(f"loading {path}")
    info = manifest(path)
    group = checkpoint_group()
    rank = dist.get_rank() if group is not None else 0
    why = integrity.problem(Path(path), info, MANIFEST, trusted) if rank == 0 else None
    why = from_rank0(why, group)  # rank 0 hashes the files once; every rank hears it
    if why is not None:
        raise CheckpointError(f"not loaded: {why}")
    saved: dict[str, str] = info["kinds"]
    unknown = [n for n in objects if n not in saved]
    if unknown:
        raise CheckpointError(f"{path} holds no {', '.join(map(repr, unknown))}: it holds "
                              f"{', '.join(saved)}; ask for those names")
    wanted = {n: saved[n] for n in objects}
    unbuilt = [n for n, k in wanted.items() if k != "value" and objects[n] is None]
    if unbuilt:
        raise CheckpointError(
            f"nothing to load {', '.join(map(repr, unbuilt))} into: a saved module or "
            "optimizer loads into a live one; build it first (same model and optimizer, any "
            "parallel plan), then load")
    mismatched = [f"{n!r} is saved as a {k} but given a {type(objects[n]).__name__}"
                  for n, k in wanted.items() if k != "value" and _kind(n, objects[n]) != k]
    if mismatched:
        raise CheckpointError(f"{path}: {'; '.join(mismatched)}; pass the matching objects")
    pairs = _models_of(objects, wanted)
    for name, kind in wanted.items():
        if kind == "optimizer" and not objects[name].state:
            # DCP creates a fresh optimizer's state (to load into) only when no gradient is set
            objects[name].zero_grad(set_to_none=True)
    state = _state_dict(objects, wanted, pairs)
    state.update({n: b"" for n, k in wanted.items() if k == "value"})  # DCP fills these in
    try:
        dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    except Exception as e:
        raise CheckpointError(f"loading {path} into {', '.join(wanted)} failed (the live "
                              "objects need the saved ones' parameter names and full shapes): "
                              f"{e}") from e
    for name, kind in wanted.items():
        if kind == "module":
            set_model_state_dict(objects[name], state[name])
        elif kind == "optimizer":
            set_optimizer_state_dict(objects[pairs[name]], objects[name], state[name])
    return {n: pickle.loads(state[n]) if k == "value" else objects[n] for n, k in wanted.items()}


def manifest(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A checkpoint's meshlab.json: names, kinds, world size, when, torch version, extra.

    The one reader of the manifest (the notebook's restore reads it here too): a missing
    folder raises FileNotFoundError, a folder without the manifest CheckpointError."""
    folder = Path(path)
    if not folder.is_dir():  # a file is no checkpoint either, not a half-written one
        aside = sorted(folder.parent.glob(f"{glob.escape(folder.name)}.old-*"))
        hint = (f"; a save was interrupted while replacing it: the previous checkpoint is "
                f"{aside[-1]}" if aside else "")
        raise FileNotFoundError(f"no checkpoint at {folder}{hint}")
    file = folder / MANIFEST
    if not file.is_file():
        raise CheckpointError(f"{folder} is an incomplete checkpoint (no {MANIFEST}): a save "
                              "was interrupted; use an earlier checkpoint")
    try:
        data = json.loads(file.read_text())
        why = ("" if isinstance(data, dict) and isinstance(data.get("names"), list) else
               "not a meshlab manifest")
    except (ValueError, UnicodeDecodeError) as e:  # cut short, or not JSON at all
        why = str(e)
    if why:
        raise CheckpointError(f"{file} is damaged ({why}): it is the checkpoint's record of "
                              "what it holds and its checksums; load an earlier checkpoint")
    return dict(data)


# -- what is saved ----------------------------------------------------------------------------

def _kind(name: str, value: Any) -> str:
    """module, optimizer or value (saved once, from rank 0)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        if type(value).__name__ == "ZeroRedundancyOptimizer":
            raise ValueError(f"{name!r} is a ZeroRedundancyOptimizer (zero1), which DCP's "
                             "state_dict API cannot shard; use data_parallel='zero2' or "
                             "'zero3' (FSDP2) to checkpoint sharded optimizer states")
        return "optimizer"
    if isinstance(value, DTensor):
        raise ValueError(f"{name!r} is a DTensor outside a module: only rank 0's shard would be "
                         f"saved; save {name}.full_tensor(), or the module that holds it")
    return "value"


def _kinds(objects: dict[str, Any]) -> dict[str, str]:
    if not objects:
        raise ValueError("nothing to save: pass {name: object}, e.g. {'model': model, "
                         "'optimizer': optimizer, 'step': step}")
    bad = [n for n in objects if not isinstance(n, str) or not n or "." in n]
    if bad:
        raise ValueError(f"names {bad!r}: use non-empty strings without dots (DCP joins keys "
                         "with dots)")
    return {n: _kind(n, v) for n, v in objects.items()}


def _models_of(objects: dict[str, Any], kinds: dict[str, str]) -> dict[str, str]:
    """optimizer name -> the module it updates: the smallest among ``objects`` that holds every
    parameter of the optimizer (its state is keyed by that module's parameter names).

    FSDP2 modules a forward left unsharded (no backward after it) are resharded first: until
    then their parameters are gathered copies, not the sharded ones the optimizer updates."""
    from meshlab.measure.memory import reshard

    for n, k in kinds.items():
        if k == "module":
            reshard(objects[n])
    params = {n: {id(p) for p in objects[n].parameters()}
              for n, k in kinds.items() if k == "module"}
    pairs = {}
    for name, kind in kinds.items():
        if kind != "optimizer":
            continue
        updated = {id(p) for group in objects[name].param_groups for p in group["params"]}
        holders = [m for m, ids in params.items() if updated <= ids]
        if not holders:
            raise ValueError(
                f"optimizer {name!r} updates parameters of none of the modules given "
                f"({', '.join(map(repr, params)) or 'none'}): its state is keyed by its model's "
                f"parameter names, so pass the model too, e.g. {{'model': model, {name!r}: "
                f"{name}}}")
        pairs[name] = min(holders, key=lambda m: len(params[m]))
    return pairs


def _state_dict(objects: dict[str, Any], kinds: dict[str, str], pairs: dict[str, str]
                ) -> dict[str, Any]:
    """DCP's view of the modules and optimizers: plain names, sharded tensors."""
    state: dict[str, Any] = {}
    for name, kind in kinds.items():
        if kind == "module":
            state[name] = get_model_state_dict(objects[name])
        elif kind == "optimizer":
            state[name] = get_optimizer_state_dict(objects[pairs[name]], objects[name])
    return state


# -- complete or nothing ----------------------------------------------------------------------
