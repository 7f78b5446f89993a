"""A rank runs a cell as IPython's run_cell would, taking IPython's own steps itself where
it can: each cell here runs on two fresh shells, once by the lean path and once through
``shell.run_cell``, and everything the notebook or the user's namespace sees must match."""

from __future__ import annotations

import io
import os
import re
import signal
from typing import Any

import pytest
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from meshlab.rank import cell_exec

# (cell, does the lean path run it?)
CELLS = [
    ("x = 1\nx + 1", True),
    ("x + 1;", True),  # a trailing semicolon hides the value
    ("print('out')\nimport sys\nprint('err', file=sys.stderr)", True),
    ("ys = [i * i for i in range(3)]\nys", True),
    ("%time z = 2", True),  # a line magic: IPython's transform, then plain Python
    ("%%capture captured\nprint('hidden')", True),
    ("listing = !echo hi\nlisting", True),
    ("1/0", True),
    ("def f():\n    return 1 / 0\n\nf()", True),
    ("raise SystemExit(3)", True),
    ("from __future__ import annotations\ndef g(a: Undefined) -> None: ...\ng.__annotations__",
     True),
    ("    indented = 3\n    indented", True),  # IPython dedents a cell
    ("In [3]: 7", True),  # and strips a pasted prompt
    ("who_ls", True),  # automagic: the one-line prefilter, asked every time
    ("who_ls = 5\nwho_ls", True),
    ("who_ls", True),  # now a name in the namespace: no magic
    ("_i", True),
    ("_ + 1", True),
    ("# only a comment", True),
    ("import asyncio\nawait asyncio.sleep(0)\n5", False),  # top-level await: IPython's
    ("x = (", False),  # a syntax error: IPython words it
    ("", False),
]


def _shell() -> Any:
    config = Config()
    config.HistoryManager.hist_file = ":memory:"
    config.InteractiveShell.colors = "NoColor"
    return InteractiveShell(config=config)


def _plain(text: str) -> str:
    """Memory addresses and %time's figures (and their units) out of the way."""
    return re.sub(r"0x[0-9a-f]+|\d[\d.e+]*( ?[nµum]?s\b)?", "#", text)


@pytest.fixture(scope="module")
def shells() -> tuple[Any, Any, list[str]]:
    lean, ipython, fell_back = _shell(), _shell(), []
    run_cell = lean.run_cell

    def counted(code: str, **kwargs: Any) -> Any:
        fell_back.append(code)
        return run_cell(code, **kwargs)

    lean.run_cell = counted
    return lean, ipython, fell_back


@pytest.mark.parametrize("number", range(len(CELLS)))
def test_a_cell_runs_as_ipython_runs_it(shells: tuple[Any, Any, list[str]], number: int,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    lean, ipython, fell_back = shells
    code, lean_path = CELLS[number]
    seen = []
    for shell in (lean, ipython):
        if shell is ipython:  # the reference: every cell through shell.run_cell
            monkeypatch.setattr(cell_exec, "_compile", lambda *_: None)
        streams = {"stdout": io.StringIO(), "stderr": io.StringIO()}
        with pytest.warns(UserWarning) if "SystemExit" in code else _nothing():
            header, blobs = cell_exec.run_cell(shell, code, number + 1, True, streams)
        seen.append(({k: [_plain(line) for line in v] if k == "traceback" else v
                      for k, v in header.items() if k != "seconds"},  # how long: its own
                     len(blobs),
                     _plain(streams["stdout"].getvalue()), _plain(streams["stderr"].getvalue()),
                     {k: repr(shell.user_ns.get(k)) for k in ("_", "_i", "_i1", "x", "ys")},
                     shell.execution_count))
    assert seen[0] == seen[1]
    assert (code not in fell_back) == lean_path


def test_the_lean_path_says_what_went_wrong_in_the_cell(
        shells: tuple[Any, Any, list[str]]) -> None:
    lean = _shell()
    header, _ = cell_exec.run_cell(lean, "def f():\n    return 1 / 0\nf()", 7, False,
                                   {"stdout": io.StringIO(), "stderr": io.StringIO()})
    assert header["status"] == "error" and header["ename"] == "ZeroDivisionError"
    text = "".join(header["traceback"])
    # the cell's own lines, under its name for In [7] ("Cell In[7]" on an engine's shell)
    assert "----> 3 f()" in text and "----> 2     return 1 / 0" in text
    assert text.count("ipython-input-7-") == 2
    assert "cell_exec" not in text  # meshlab's own frame is not the user's business


def test_listeners_on_every_cell_get_ipythons_own_path() -> None:
    """autoreload and the like listen on pre_run_cell: their cells go through run_cell."""
    shell, seen = _shell(), []
    shell.events.register("pre_run_cell", lambda info: seen.append(info.raw_cell))
    header, _ = cell_exec.run_cell(shell, "40 + 2", 1, False,
                                   {"stdout": io.StringIO(), "stderr": io.StringIO()})
    assert header["result"] == "42" and seen == ["40 + 2"]


def test_a_cell_that_catches_ctrl_c_is_ended_by_the_stop_signal_which_it_cannot_catch() -> None:
    """meshlab's stop signal raises CellStopped, which `except KeyboardInterrupt` and
    `except Exception` let through; between cells the signal is ignored, not fatal."""
    plain = "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)"
    caught = ("import os, signal, time\ntry:\n    os.kill(os.getpid(), signal.SIGINT)\n"
              "    time.sleep(5)\nexcept KeyboardInterrupt:\n    pass\n"
              f"os.kill(os.getpid(), {int(cell_exec.STOP_SIGNAL)})\nwhile True:\n    try:\n"
              "        time.sleep(5)\n    except (KeyboardInterrupt, Exception):\n        pass")
    shell, streams = _shell(), {"stdout": io.StringIO(), "stderr": io.StringIO()}
    before = signal.getsignal(cell_exec.STOP_SIGNAL)
    try:
        header, _ = cell_exec.run_cell(shell, plain, 1, False, streams)
        assert header["ename"] == "KeyboardInterrupt"
        header, _ = cell_exec.run_cell(shell, caught, 2, False, streams)
        assert header["ename"] == "CellStopped"
        assert "meshlab stopped the cell with SIGUSR2" in header["evalue"]
        assert signal.getsignal(cell_exec.STOP_SIGNAL) is signal.SIG_IGN
        os.kill(os.getpid(), cell_exec.STOP_SIGNAL)  # an idle engine: nothing happens
    finally:
        signal.signal(cell_exec.STOP_SIGNAL, before)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        return None
