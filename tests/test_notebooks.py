"""The tour notebooks, executed end to end in a real kernel with nbclient."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from meshlab.output import strip_ansi

pytestmark = pytest.mark.notebook
NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def texts(cell: nbformat.NotebookNode) -> str:
    """Everything a cell showed, as plain text."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
        else:
            parts.append(out.get("data", {}).get("text/plain", ""))
    return strip_ansi("\n".join(parts))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_are_committed_without_outputs(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), \
        f"strip the outputs of {path.name} before committing"


def test_quickstart_runs_end_to_end(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = {i: texts(c) for i, c in enumerate(nb.cells) if c.cell_type == "code"}
    everything = "\n".join(shown.values())
    assert "4 ranks ready" in everything
    assert "[ranks 0-3] tensor([10., 10., 10., 10.])" in everything
    assert "[rank 0] only rank 0 runs this\n[rank 2] only rank 2 runs this" in everything
    assert "1 of 4 ranks failed:\n  [rank 1] ValueError: rank 1 got a bad batch" in everything
    assert "[ranks 0,2-3] this rank is fine" in everything
    assert "{0: 0.0003, 1: 0.0006, 2: 0.0009, 3: 0.0012}" in everything
    assert "[rank 3] still running after the 1 s time limit" in everything
