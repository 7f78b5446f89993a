"""What ``%%mesh --memory``, ``--memory-dir`` and ``--on-oom`` keep of a cell's memory
timelines: the snapshots written (pytorch.org/memory_viz opens them, one file per rank) and
the notes that say where. Notebook side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from meshlab.notebook.output import CellResult
from meshlab.notebook.ranks import format_ranks, label
from meshlab.rank.private_files import subfolder

if TYPE_CHECKING:
    from meshlab.notebook.cluster import Cluster

VIEWER = "pytorch.org/memory_viz opens each (drag it onto the page)"
# the errors of a rank that ran out: torch's (CUDA, and since 2.5 any device), Python's, and
# the CPU allocator's RuntimeError
OOM_NAMES = ("OutOfMemoryError", "MemoryError")
OOM_TEXT = ("can't allocate memory", "out of memory")


def ran_out(result: CellResult) -> list[int]:
    """The ranks whose cell failed for want of memory."""
    return [r for r, out in result.outputs.items()
            if out.error is not None and (out.error.ename in OOM_NAMES
                                          or any(t in out.error.evalue for t in OOM_TEXT))]


def save_all(result: CellResult, folder: Path) -> str:
    """Write every rank's snapshot into ``folder``; the line that says where."""
    for r in sorted(result.memory):
        result.memory[r].save(folder)
    return where_saved(sorted(result.memory), folder)


def where_saved(ranks: list[int], folder: str | Path) -> str:
    """The line that says where ``ranks``' snapshots are."""
    return f"memory snapshots of {label(ranks)}: {folder}/rank<N>.pickle; {VIEWER}" \
        if ranks else ""


def keep(result: CellResult, cluster: Cluster, folder: Path | None, on_oom: bool,
         number: int) -> None:
    """A failed cell's snapshots, said in ``result.notes`` (its error's last lines): every
    rank's into ``folder``; with ``on_oom``, those of the ranks that ran out (into
    ``folder``, else the cluster's private folder, which goes when the cluster stops)."""
    if folder is not None and (line := save_all(result, folder)):
        result.notes.append(line)
    out = [r for r in ran_out(result) if r in result.memory] if on_oom else []
    if not out:
        return
    where = folder or subfolder(cluster.cut_output_folder(), f"memory-cell-{number}")
    if folder is None:
        for r in out:
            result.memory[r].save(where)
    kept = "" if folder is not None else (" (removed when the cluster stops: --memory-dir "
                                          "DIR keeps it)")
    files = ", ".join(str(where / f"rank{r}.pickle") for r in out)
    who = f"rank{'s' if len(out) > 1 else ''} {format_ranks(out)}"
    result.notes.append(f"{who} ran out of memory: its snapshot is {files}{kept}; the chart "
                        "shows its memory up to the failure")
