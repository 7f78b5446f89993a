"""The rank's end of the debugger in one process: pdb on the main thread, driven from another
thread as the probe thread drives it (meshlab.rank.debugger.command)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from meshlab.rank import cell_exec, debugger


@pytest.fixture
def in_a_cell() -> Iterator[None]:
    cell_exec.running = True  # breakpoint() stops only a cell's main thread
    yield
    cell_exec.running = False


def drive(commands: list[str], then: Callable[[], None] | None = None
          ) -> tuple[list[Any], threading.Thread]:
    """Answers to ``commands`` sent from a thread once the main thread stops, and the
    thread (joined for the last answer)."""
    answers: list[Any] = []

    def run() -> None:
        while debugger.stopped() is None:
            time.sleep(0.01)
        answers.append(debugger.stopped())
        answers.extend(debugger.command(c) for c in commands)
        if then is not None:
            then()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return answers, thread


def stepped() -> int:
    x = 1
    debugger.breakpointhook()
    x = x + 1
    return x


def test_commands_answer_what_pdb_writes_and_say_where_it_stopped(in_a_cell: None) -> None:
    answers, thread = drive(["p x", "n", "p x", "p y", "c"])
    assert stepped() == 2
    thread.join(10)
    at, px, step, px2, missing, cont = answers
    assert (at["function"], at["code"]) == ("stepped", "x = x + 1")
    assert px == {"state": "stopped", "output": "1\n", "where": at}
    assert step["state"] == "stopped" and step["where"]["code"] == "return x"
    assert "-> return x" in step["output"]
    assert px2["output"] == "2\n" and "NameError" in missing["output"]
    assert cont == {"state": "running", "output": ""}
    assert debugger.stopped() is None and debugger.command("p x")["state"] == "running"


def test_ctrl_c_at_the_prompt_ends_the_cell_not_the_command(in_a_cell: None) -> None:
    main = threading.main_thread().ident or 0
    drive(["p x"], then=lambda: signal.pthread_kill(main, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):  # pdb's own loop would swallow it and prompt again
        stepped()
    assert debugger.stopped() is None


def test_outside_a_cell_breakpoint_goes_on_and_says_so(capsys: Any) -> None:
    assert stepped() == 2
    assert "breakpoint() skipped" in capsys.readouterr().err
