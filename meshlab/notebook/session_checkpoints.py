"""Sharded checkpoints from a Session: save and load named objects on every rank, recorded in
the journal for restart to replay. Mixed into Session."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from meshlab.notebook import restore
from meshlab.notebook.errors import SessionError
from meshlab.notebook.output import MeshError, size_text

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster
    from meshlab.notebook.export import Journal


class Checkpoints:
    """checkpoint."""

    optimizer_steps: int
    cell_number: Callable[[], int]
    need_cluster: Callable[[], Cluster]
    need_journal: Callable[[], Journal]

    def checkpoint(self, action: str, path: str | Path, names: Sequence[str] = (), *,
                   background: bool = False, trusted: bool = False,
                   group_readable: bool = False) -> str:
        """Save (or load) named objects on every rank as a sharded checkpoint in ``path``;
        returns what was done. Default names: those of model, optimizer, step defined.
        ``trusted``: load one another account could have written (it runs their pickles).
        ``group_readable``: save it 0750/0640 (default 0700/0600: only you read it)."""
        cluster, journal = self.need_cluster(), self.need_journal()
        if action not in ("save", "load"):
            raise SessionError(f"checkpoint action {action!r}: use 'save' or 'load'")
        path, number = os.path.abspath(path), self.cell_number()
        names = list(names) or (cluster.defined(list(restore.DEFAULT_NAMES)) if action == "save"
                                else restore.read_manifest(path)["names"])
        if not names:
            raise SessionError("nothing to save: none of model, optimizer, step is defined on "
                               "rank 0; name the objects: %mesh checkpoint save DIR model "
                               "optimizer")
        code = (restore.save_code(path, names, journal, number, background=background,
                                  group_readable=group_readable)
                if action == "save" else restore.load_code(path, names, trusted))
        try:
            cluster.run(code)  # a failure shows as any cell's would
        except MeshError as e:
            for left in sorted(Path(path).parent.glob(f"{glob.escape(Path(path).name)}.partial-*")):
                e.add_note(f"{left} holds the shards written before the save stopped "
                           f"({size_text(_bytes_in(left))}): the next save to {path} removes it")
            raise
        journal.record_checkpoint(code, number, action, path)
        # loading a fresh optimizer's state takes a zero-lr step: not the next cell's training
        self.optimizer_steps = cluster.optimizer_steps()
        done = "saving" if background else "saved" if action == "save" else "loaded"
        # the background save's error comes later, in another command: say which
        later = (" in the background (if it fails, the next checkpoint save, load or wait "
                 "says so)" if background else "")
        return (f"{done} {', '.join(names)} {'to' if action == 'save' else 'from'} {path} on "
                f"{cluster.world_size} ranks{later}")


def _bytes_in(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
