"""A tour notebook run once a session: nbclient's test checks what it printed, the browser
test opens the same executed copy in JupyterLab (notebook 11 took 27 s in nbclient and 43 s
again in the browser's Run All).

The runs go ahead of the tests: from the session's first test on, one background thread
executes every notebook this session's parametrized tests name, in the order they will ask,
at a low CPU priority (NICE, which its kernels and their ranks inherit). The tests before the
tour leave a core idle about a third of the time (waiting out timeouts, links pulled, kernels
killed): the notebooks' 7 minutes of runs fill it instead of holding up the tour. A test waits
only for its own notebook."""

from __future__ import annotations

import inspect
import os
import shutil
import tempfile
from collections.abc import Callable
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
        # the test's own arguments: a test that reads notebooks only through a fixture (the
        # docs site reads them all) must not queue its parameters
        function = getattr(item, "function", None)
        if function is None or not hasattr(item, "callspec") \
                or "executed" not in inspect.signature(function).parameters:
            continue
        for value in item.callspec.params.values():
            name = Path(str(value)).name
            name = name if name.endswith(".ipynb") else f"{name}.ipynb"
            if (NOTEBOOKS / name).exists() and name not in AHEAD:
                AHEAD.append(name)


NICE = 10
"""The runs' CPU priority, added to the tests' (Linux keeps it per thread; what the thread
starts inherits it). Low enough that a test beside them keeps its pace; not 19, where a
notebook's 4 ranks importing torch beside the model matrix's could miss the 120 s start
limit."""


class Runs:
    """``runs(name)``: the notebook run once this session and the path of its saved executed
    copy (outputs and widget state as nbclient stored them); ``ahead()`` queues the rest."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="meshlab-tour-"))
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tour-notebooks",
                                       initializer=os.nice, initargs=(NICE,))
        self.runs: dict[str, Future[tuple[nbformat.NotebookNode, Path]]] = {}

    def _run(self, name: str) -> tuple[nbformat.NotebookNode, Path]:
        cwd = Path(tempfile.mkdtemp(prefix="cwd-", dir=self.folder))
        nb = execute(name, cwd)
        path = Path(tempfile.mkdtemp(prefix="executed-", dir=self.folder)) / name
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
        shutil.rmtree(self.folder, ignore_errors=True)


RUNS: list[Runs] = []
"""The session's runs, made when first needed."""


def session_runs() -> Runs:
    if not RUNS:
        RUNS.append(Runs())
    return RUNS[0]


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    if AHEAD and not session.config.option.collectonly:
        session_runs().ahead()


def pytest_sessionfinish(session: pytest.Session) -> None:
    while RUNS:
        RUNS.pop().close()


@pytest.fixture(scope="session")
def executed() -> Executed:
    """``executed(name)``: the notebook run once this session, and its saved copy's path."""
    return session_runs()
