"""A tour notebook run once a session: nbclient's test checks what it printed, the browser
test opens the same executed copy in JupyterLab (notebook 11 took 27 s in nbclient and 43 s
again in the browser's Run All).

The runs go ahead of the tests: from the first tour test on, one background thread executes
every notebook this session's parametrized tests name, in the order they will ask, so a
kernel runs the next notebook while the browser drives JupyterLab (about 7 minutes of the
two, each leaving a core idle a good part of the time). A test waits only for its own."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from notebook_run import NOTEBOOKS, execute

Executed = Callable[[str], tuple[nbformat.NotebookNode, Path]]
AHEAD: list[str] = []
"""The notebooks the collected tests name in their parameters, in the order they ask."""


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # after -k, -m and the like have deselected theirs
        # the test's own arguments: every tour test requests `executed` through the autouse
        # fixture below, and a test that reads no notebook must not queue its parameters
        function = getattr(item, "function", None)
        if function is None or not hasattr(item, "callspec") \
                or "executed" not in inspect.signature(function).parameters:
            continue
        for value in item.callspec.params.values():
            name = Path(str(value)).name
            name = name if name.endswith(".ipynb") else f"{name}.ipynb"
            if (NOTEBOOKS / name).exists() and name not in AHEAD:
                AHEAD.append(name)


class Runs:
    """``runs(name)``: the notebook run once this session and the path of its saved executed
    copy (outputs and widget state as nbclient stored them); ``ahead()`` queues the rest."""

    def __init__(self, tmp: pytest.TempPathFactory) -> None:
        self.tmp = tmp
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tour-notebooks")
        self.runs: dict[str, Future[tuple[nbformat.NotebookNode, Path]]] = {}

    def _run(self, name: str) -> tuple[nbformat.NotebookNode, Path]:
        nb = execute(name, self.tmp.mktemp("cwd"))
        path = self.tmp.mktemp("executed") / name
        nbformat.write(nb, path)
        return nb, path

    def _queue(self, name: str) -> Future[tuple[nbformat.NotebookNode, Path]]:
        if name not in self.runs:  # only the tests' thread queues
            self.runs[name] = self.pool.submit(self._run, name)
        return self.runs[name]

    def ahead(self) -> None:
        for name in AHEAD:
            self._queue(name)

    def __call__(self, name: str) -> tuple[nbformat.NotebookNode, Path]:
        return self._queue(name).result()

    def close(self) -> None:
        # the queued runs are dropped; one under way finishes (its kernel and ranks shut down)
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="session")
def executed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Executed]:
    """``executed(name)``: the notebook run once this session, and its saved copy's path."""
    runs = Runs(tmp_path_factory)
    yield runs
    runs.close()


@pytest.fixture(autouse=True)
def _tour_notebooks_run_ahead(executed: Runs) -> None:
    executed.ahead()
