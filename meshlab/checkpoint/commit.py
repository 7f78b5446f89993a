"""A checkpoint's last act, all or nothing: once every rank has written its shards into the
partial folder, rank 0 writes the manifest (with the files' checksums) and swaps the folder
into place; a failure anywhere is reported the same on every rank, saying what became of the
partial folder. Saves talk over a gloo group of their own (meshlab.checkpoint.sharded)."""

from __future__ import annotations

import datetime
import glob
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from meshlab.checkpoint import failures as failure
from meshlab.checkpoint import integrity
from meshlab.checkpoint.failures import CheckpointError

MANIFEST = "meshlab.json"
"""Written last, by rank 0: a folder without it is a save that did not finish."""

_group_cache: tuple[Any, Any] | None = None  # (default group, its checkpoint group)


def check_replaceable(target: Path) -> None:
    """Refuse to swap away a folder that is not a checkpoint (it would be deleted)."""
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"{target} is a file, not a checkpoint folder: choose another path")
    if not any(target.iterdir()) or (target / MANIFEST).exists() or (target / ".metadata"
                                                                     ).exists():
        return
    raise ValueError(f"{target} exists and is not a checkpoint (no {MANIFEST}); saving would "
                     "replace it: choose another path or remove it")


def commit(partial: Path, target: Path, info: dict[str, Any], group: Any, rank: int,
            modes: tuple[int, int]) -> None:
    """After every rank's shards are written: rank 0 gives the folder and its files their
    ``modes``, writes the manifest and swaps the folder in; every rank returns only then, or
    raises the same error."""
    failed: tuple[str, str] | None = None  # (the step, what went wrong)
    if rank == 0:
        # any failure: the other ranks wait for the outcome below
        try:
            os.chmod(partial, modes[0])
            for shard in partial.iterdir():
                os.chmod(shard, modes[1])
            info["saved_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
            info[integrity.DIGESTS] = integrity.digests(partial, MANIFEST)  # checked at load
            with os.fdopen(os.open(partial / MANIFEST, os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                   modes[1]), "w") as f:
                json.dump(info, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
        except Exception as e:
            failed = ("manifest", f"{failure.reason_of(e)} writing {partial / MANIFEST}")
        else:
            try:
                _swap(partial, target)
            except Exception as e:
                failed = ("swap", f"{failure.reason_of(e)} moving {partial} into place")
    failed = from_rank0(failed, group)
    if failed is None:
        return
    step, what = failed
    if step == "manifest":
        raise not_saved({0: what}, target, partial, group, rank)
    # the manifest is written: the partial folder is a whole checkpoint, so it stays
    raise CheckpointError(f"checkpoint {target} not saved: {what} on rank 0; {partial} is "
                          f"complete (it has {MANIFEST}): load it from there, or move it to "
                          f"{target}")


def _swap(partial: Path, target: Path) -> None:
    """Put the finished folder at ``target``; the old one is moved aside first, then deleted.
    A crash between the two renames leaves nothing at ``target``, never a mix."""
    old = target.with_name(f"{target.name}.old-{partial.name.rsplit('-', 1)[1]}")
    if target.exists():
        os.rename(target, old)
    os.rename(partial, target)
    _fsync_dir(target.parent)
    # leftovers of this or earlier interrupted saves: target now holds a newer checkpoint
    name = glob.escape(target.name)
    for stale in [old, *target.parent.glob(f"{name}.partial-*"),
                  *target.parent.glob(f"{name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory: the rename is still atomic
    finally:
        os.close(fd)


# -- when a save fails ------------------------------------------------------------------------

def not_saved(failures: dict[int, str], target: Path, partial: Path, group: Any,
               rank: int) -> CheckpointError:
    """The error every rank raises when ranks agree a save failed; its first line names the
    target, the first failure and the partial folder.

    Rank 0 removes the partial folder: a save that failed can never be loaded from it, and
    after ENOSPC it is what keeps the disk full (on every host of a shared file system, where
    the user would have to find it). What it could tell (the failing file, how much was
    written) is in the message. Every rank has stopped writing once DCP reports the failure,
    so nothing writes into the folder as it goes. A killed rank leaves no one to agree: then
    the folder stays, and the next save to ``target`` removes it."""
    outcome: tuple[str, str] | None = None
    if rank == 0:
        outcome = (failure.removed(partial), f"{target} still holds the previous checkpoint"
                   if (target / MANIFEST).is_file() else f"nothing was saved at {target}")
    left, before = from_rank0(outcome, group)
    first, *others = sorted(failures)
    lines = [f"checkpoint {target} not saved: {failures[first]} on rank {first}; {left}",
             f"{before}"]
    lines += [f"rank {r} failed too: {failures[r]}" for r in others[:3]]
    if len(others) > 3:
        lines.append(f"and {len(others) - 3} more ranks")
    return CheckpointError("\n".join(lines))


# -- collectives ------------------------------------------------------------------------------

def checkpoint_group() -> Any:
    """A gloo group over the default group's ranks, made once per default group (None without
    torch.distributed). Background saves talk over it while cells use the default group."""
    global _group_cache
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.group.WORLD
    if _group_cache is None or _group_cache[0] is not default:
        try:  # the default group's timeout (a dead peer is noticed as fast as in a cell)
            timeout = default._get_backend(torch.device("cpu")).options._timeout  # type: ignore[union-attr]
        except (RuntimeError, AttributeError):
            timeout = None
        _group_cache = (default, dist.new_group(backend="gloo", timeout=timeout))
    return _group_cache[1]


def from_rank0(value: Any, group: Any) -> Any:
    """Rank 0's ``value`` on every rank of ``group``."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
