"""A tour notebook run once a session: nbclient's test checks what it printed, the browser
test opens the same executed copy in JupyterLab (notebook 11 took 27 s in nbclient and 43 s
again in the browser's Run All)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from notebook_run import execute


@pytest.fixture(scope="session")
def executed(tmp_path_factory: pytest.TempPathFactory
             ) -> Callable[[str], tuple[nbformat.NotebookNode, Path]]:
    """``executed(name)``: the notebook run once this session, and the path of the saved
    executed copy (outputs and widget state as nbclient stored them)."""
    done: dict[str, tuple[nbformat.NotebookNode, Path]] = {}

    def run(name: str) -> tuple[nbformat.NotebookNode, Path]:
        if name not in done:
            nb = execute(name, tmp_path_factory.mktemp("cwd"))
            path = tmp_path_factory.mktemp("executed") / name
            nbformat.write(nb, path)
            done[name] = nb, path
        return done[name]

    return run
