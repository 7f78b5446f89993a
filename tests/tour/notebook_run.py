"""Running a tour notebook in a real kernel (nbclient), for the notebook and browser tests."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).parents[2] / "notebooks"


def execute(name: str, cwd: Path) -> nbformat.NotebookNode:
    """Run a tour notebook in a real kernel; nbclient raises on any unexpected error.

    ``cwd`` stands for notebooks/: run there, a notebook must leave it as it found it (what
    it writes goes to a scratch folder it names and removes)."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    before = set(cwd.iterdir())
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(cwd)}}).execute()
    left = sorted(p.name for p in set(cwd.iterdir()) - before)
    assert not left, f"{name} left {left} in its folder: write them under a scratch folder"
    return nb
