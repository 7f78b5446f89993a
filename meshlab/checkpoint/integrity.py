"""What a checkpoint must show before meshlab reads it: that no other account could have
written it, and that no file changed since it was saved.

DCP's ``.metadata`` and meshlab's saved values are pickles, and reading a pickle runs code:
a checkpoint whose folder or files another account owns, or could write, is refused unless
the user says it is trusted. Every file's SHA-256, written in the manifest at save, is checked
at load, so a changed, truncated or missing shard is refused naming the file (DCP names its
shards by rank: ``__2_0.distcp`` is rank 2's) before DCP reads any of it. Plain Python: ranks
use it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

DIGESTS = "sha256"  # the manifest's key: {file name: hex digest}
TRUST = ("if you trust whoever could write it, load it with trusted=True (%mesh checkpoint "
         "load DIR --trust)")


def digests(folder: Path, manifest: str) -> dict[str, str]:
    """Every file's SHA-256 in ``folder``, the manifest's own aside."""
    return {p.name: _sha256(p) for p in sorted(folder.iterdir())
            if p.is_file() and p.name != manifest}


def problem(folder: Path, info: dict[str, Any], manifest: str, trusted: bool) -> str | None:
    """Why ``folder`` must not be read, or None."""
    if not trusted:
        for path in [folder, *sorted(folder.iterdir())]:
            owner = path.lstat()
            if stat.S_ISLNK(owner.st_mode):
                return (f"{path} is a link (to {os.readlink(path)}): a checkpoint's files are "
                        f"its own; {TRUST}")
            if owner.st_uid != os.getuid():
                return (f"{path} belongs to another account (uid {owner.st_uid}), and loading "
                        f"a checkpoint reads pickles, which run code: {TRUST}")
            if owner.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return (f"{path} can be written by other accounts (mode "
                        f"{stat.S_IMODE(owner.st_mode):o}), and loading a checkpoint reads "
                        f"pickles, which run code: {TRUST}")
    expected: dict[str, str] | None = info.get(DIGESTS)
    if expected is None:
        return None if trusted else (
            f"{folder} was saved without checksums (by an older meshlab), so a changed shard "
            f"could not be told: {TRUST}")
    found = digests(folder, manifest)
    for name, digest in expected.items():
        if name not in found:
            return f"{folder / name} is missing: the checkpoint is incomplete; use another"
        if found[name] != digest:
            return (f"{folder / name} changed since it was saved (its SHA-256 is not the one "
                    "the save wrote): it is corrupt or was altered; use another checkpoint")
    extra = sorted(set(found) - set(expected))
    if extra:
        return (f"{folder / extra[0]} was not part of the checkpoint when it was saved: "
                "remove it, or use another checkpoint")
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
