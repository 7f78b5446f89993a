"""Why a checkpoint save failed, as its first line says: the OS error behind it, the file,
how much reached the disk, and what became of the partial folder.

DCP pickles a rank's error to rank 0 and back, which drops the OSError it came from, so the
writer here catches a failure on the rank that wrote and keeps what it knew as plain data.
Plain torch only (meshlab.checkpoint.sharded's companion; it runs in exported scripts too).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete or does not fit what was asked; the message says why."""


class FileFailed(CheckpointError):
    """One rank's failed file operation, as plain data: DCP pickles a rank's error to rank 0
    and back, which drops the OSError it came from."""

    def __init__(self, doing: str, path: str, reason: str, written: int | None) -> None:
        super().__init__(doing, path, reason, written)  # pickling rebuilds it from these
        self.doing, self.path, self.reason, self.written = doing, path, reason, written

    def __str__(self) -> str:
        after = "" if self.written is None else f" after {size_text(self.written)}"
        return f"{self.reason} {self.doing} {self.path}{after}"


class ReportingFileSystem(FileSystem):
    """DCP's local file system, whose failures name the OS error, the file and how much of it
    reached the disk. Caught here, on the rank that wrote, while the OSError is still there."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as e:
            raise FileFailed("writing", str(path), reason_of(e), file_size(path)) from e

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        try:
            super().mkdir(path)
        except Exception as e:
            raise FileFailed("creating", str(path), reason_of(e), None) from e

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        try:
            super().rename(path, new_path)
        except Exception as e:
            raise FileFailed("renaming", f"{path} to {new_path}", reason_of(e), None) from e


class Writer(dcp.FileSystemWriter):
    """DCP's writer on ``ReportingFileSystem``."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.fs = ReportingFileSystem()


def reason_of(error: BaseException) -> str:
    """The OS error behind ``error``, as ``no space left on device (ENOSPC)``; else its class
    and first line.

    A short write inside torch.save surfaces as ``[enforce fail at inline_container.cc]
    unexpected pos 704 vs 598``, a RuntimeError without errno; the OSError the file's write
    raised (ENOSPC, EFBIG) is that error's __context__, found here by walking the chain."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        code = cause.errno if isinstance(cause, OSError) else None
        if code is not None and code in errno.errorcode:
            text = os.strerror(code)
            return f"{text[:1].lower()}{text[1:]} ({errno.errorcode[code]})"
        cause = cause.__cause__ or cause.__context__
    first = str(error).strip().splitlines()
    return f"{type(error).__name__}: {first[0]}" if first else type(error).__name__


def failures(error: CheckpointException) -> dict[int, str]:
    """What failed on each rank that failed, from DCP's exception (the same on every rank)."""
    return {r: str(e) if isinstance(e, FileFailed) else reason_of(e)
            for r, (e, _) in error.failures.items()}


def removed(partial: Path) -> str:
    """Remove the partial folder of a failed save; say what became of it."""
    if not partial.exists():
        return "no partial folder was left"
    size = size_text(bytes_in(partial))
    try:
        shutil.rmtree(partial)
    except OSError as e:
        return (f"the partial folder {partial} holds {size} and could not be removed "
                f"({reason_of(e)}): remove it to free the space")
    return f"the partial folder {partial} ({size} written) is removed"


def file_size(path: str | os.PathLike[str]) -> int | None:
    try:
        return os.path.getsize(path)
    except OSError:
        return None


def bytes_in(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            total += file_size(os.path.join(root, name)) or 0
    return total


def size_text(n: int) -> str:
    """Bytes as people read them: ``598 B``, ``4.0 kB``, ``1.2 MB``."""
    for unit, scale in (("GB", 2**30), ("MB", 2**20), ("kB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
