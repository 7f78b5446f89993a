"""breakpoint() in a cell: a live pdb on that rank, driven from the notebook (through a
Session and the prompt), on the shared 4-rank cluster. Each cell batches several checks."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

from meshlab.notebook.cluster import Cluster
from meshlab.notebook.debug_prompt import Prompt
from meshlab.notebook.debugger import Debugger, DebuggerTimeout
from meshlab.notebook.output import MeshError
from meshlab.notebook.session import Session

# the others wait for rank 1 in a collective: in a group whose timeout outlasts the test's
# pg_timeout of 6 s (NCCL's default is 10 minutes)
ONE_RANK_STOPS = """\
import datetime
patient = dist.new_group(timeout=datetime.timedelta(seconds=120))
x = rank * 10
y = torch.ones(1) * rank
if rank == 1:
    breakpoint()
    x = x + 1
dist.all_reduce(y, group=patient)
z = x
"""


def _until(check: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (found := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def test_one_rank_stops_is_stepped_and_goes_on_while_the_others_wait(session: Session) -> None:
    seen: dict[str, Any] = {}

    def drive(debugger: Debugger) -> None:
        stopped = debugger.stopped()
        seen["stopped"] = stopped
        seen["list"] = debugger.list()
        # the others reach the collective rank 1 has not: the debugger says where they wait
        waiting = "waiting in `dist.all_reduce(y, group=patient)`"
        seen["others"] = _until(lambda: (o := debugger.others()) and all(
            text.startswith(waiting) for text in o.values()) and o)
        seen["x"] = debugger.send("p x")
        seen["next"] = debugger.send("n")
        seen["after"] = debugger.stopped()
        seen["x again"] = debugger.send("p x")
        with pytest.raises(ValueError, match="rank 0 is not stopped in the debugger: "
                                             r"stopped: \[rank 1\]"):
            debugger.attach(0)
        debugger.cont()
        seen["after continue"] = debugger.stopped()

    result = session.run(ONE_RANK_STOPS, on_breakpoint=drive)
    assert result.ok
    stop = seen["stopped"][1]
    assert list(seen["stopped"]) == [1]
    assert stop["file"].startswith("Cell In[") and stop["line"] == 7
    assert stop["code"] == "x = x + 1"
    assert list(seen["list"].index) == [1] and seen["list"].loc[1, "where"] == (
        f"{stop['file']}, line 7")
    assert sorted(seen["others"]) == [0, 2, 3]
    assert seen["x"] == "10\n"
    assert f"> {stop['file']}(8)<module>()" in seen["next"]  # pdb's own line, cell named
    assert seen["after"][1]["code"] == "dist.all_reduce(y, group=patient)"
    assert seen["x again"] == "11\n"
    assert seen["after continue"] == {}
    assert session.pull("z") == {0: 0, 1: 11, 2: 20, 3: 30}


def test_every_rank_stops_cast_answers_each_and_quit_ends_their_cells(session: Session) -> None:
    seen: dict[str, Any] = {}

    def drive(debugger: Debugger) -> None:
        seen["stopped"] = sorted(_until(lambda: len(debugger.stopped()) == 4
                                        and debugger.stopped()))
        seen["cast"] = debugger.cast("0-3", "p rank * 2")
        seen["attach"] = debugger.attach(2)
        seen["send"] = debugger.send("p rank")
        seen["half"] = debugger.cast([0, 1], "continue")
        seen["left"] = sorted(debugger.stopped())
        debugger.quit()

    with pytest.raises(MeshError) as info:
        session.run("breakpoint()\nw = rank", on_breakpoint=drive)
    assert seen["stopped"] == [0, 1, 2, 3]
    assert seen["cast"] == {r: f"{r * 2}\n" for r in range(4)}
    assert seen["attach"]["code"] == "w = rank" and seen["send"] == "2\n"
    assert seen["left"] == [2, 3]
    outputs = info.value.result.outputs
    assert [outputs[r].status for r in range(4)] == ["ok", "ok", "error", "error"]
    assert "[ranks 2-3] BdbQuit: quit from the debugger" in info.value.result.summary()
    assert session.pull("w", "0-1") == {0: 0, 1: 1}


def test_the_prompt_reads_pdb_and_mesh_commands_and_without_one_ranks_go_on(
        session: Session, cluster: Cluster) -> None:
    lines = iter(["%mesh debug attach 0", "p x", "%mesh debug list", "%mesh debug cast 0-3 p x",
                  "%mesh debug attach 3", "p x + 1", "%mesh debug attach 9",
                  "%mesh debug frobnicate", "c"])
    shown: list[str] = []
    prompts: list[str] = []

    def read(prompt: str) -> str:
        prompts.append(prompt)
        return next(lines)

    session.init("dp=2 tp=2")
    prompt = Prompt(read=read, write=shown.append)
    session.run("x = rank\nbreakpoint()\nx = -1", on_breakpoint=prompt)
    text = "\n".join(shown)
    assert "[ranks 0-3] stopped at Cell In[" in text and ", in <module>: `x = -1`" in text
    assert "`%mesh debug list` shows the stopped ranks" in text  # said once, at the first stop
    assert prompts[1] == "(Pdb rank 0 dp_shard=0 tp=0) " and prompts[5] == (
        "(Pdb rank 3 dp_shard=1 tp=1) ")
    assert shown[shown.index("0") + 1].split()[:2] == ["coordinates", "host"]
    assert "[rank 0] 0\n[rank 1] 1\n[rank 2] 2\n[rank 3] 3" in text
    assert "4" in shown and "rank 9 is not stopped in the debugger" in text
    assert "not a debugger command: '%mesh debug frobnicate'" in text
    assert "(Pdb rank 0 dp_shard=0 tp=0) p x" in prompt.transcript
    assert session.pull("x") == {r: -1 for r in range(4)}
    # no handler (a replayed cell): the rank goes on, and the result says so
    result = cluster.run("breakpoint()\nv = 1")
    assert "breakpoint() reached and continued" in result.summary() + "\n".join(result.notes)
    assert session.pull("v") == {r: 1 for r in range(4)}


def test_the_time_limit_and_ctrl_c_still_stop_a_cell_at_the_prompt(session: Session) -> None:
    def never(prompt: str) -> str:
        time.sleep(60)
        return "c"

    started = time.monotonic()
    with pytest.raises(MeshError) as info:
        session.run("if rank == 2:\n    breakpoint()\n    u = 1", timeout=3,
                    on_breakpoint=Prompt(read=never, write=lambda text: None))
    assert time.monotonic() - started < 30
    summary = info.value.result.summary()
    assert "[rank 2] was stopped in the debugger at Cell In[" in summary
    assert "line 3 when the 3 s time limit passed" in summary

    def interrupted(debugger: Debugger) -> None:
        raise KeyboardInterrupt

    with pytest.raises(MeshError) as info:
        session.run("if rank == 0:\n    breakpoint()\n    u = 1", on_breakpoint=interrupted)
    assert "[rank 0] was stopped in the debugger at Cell In[" in info.value.result.summary()
    assert "when Ctrl-C came" in info.value.result.summary()
    assert session.run("u = 2").ok  # the cluster is usable after both

    def late(debugger: Debugger) -> None:
        time.sleep(3.5)
        debugger.send("p 1")

    with pytest.raises(MeshError) as info:
        session.run("if rank == 3:\n    breakpoint()\n    u = 1", timeout=3, on_breakpoint=late)
    assert "[rank 3] was stopped in the debugger" in info.value.result.summary()
    assert issubclass(DebuggerTimeout, Exception)


def test_post_mortem_opens_pdb_at_the_failing_frame_of_that_rank(session: Session) -> None:
    with pytest.raises(MeshError):
        session.run("def f(a):\n    b = a * 3\n    return b / (rank - 1)\nf(7)")
    seen: dict[str, Any] = {}

    def drive(debugger: Debugger) -> None:
        seen["where"] = debugger.stopped()
        seen["b"] = debugger.send("p b")
        seen["up"] = debugger.send("up")
        debugger.cont()

    text = session.postmortem(1, live=True, on_breakpoint=drive)
    assert seen["where"][1]["function"] == "f" and seen["where"][1]["code"] == (
        "return b / (rank - 1)")
    assert seen["b"] == "21\n" and "<module>()" in seen["up"]
    assert text == "rank 1: post-mortem debugger closed (ZeroDivisionError: division by zero)"


def test_the_magic_opens_the_prompt_where_input_reads(shell: Any, monkeypatch: Any,
                                                      capsys: Any) -> None:
    from IPython.core.error import UsageError

    answers = iter(["p rank + 100", "c"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    shell.run_cell("%%mesh --ranks 2\nbreakpoint()\nq = 1")
    out = capsys.readouterr().out
    # the session at the prompt is shown again once the cell's live output is replaced
    assert "pdb session:\n[rank 2] stopped at Cell In[" in out
    assert re.search(r"\(Pdb rank 2( dp\S+ tp=\d)?\) p rank \+ 100\n102\n", out)
    with pytest.raises(UsageError, match="typed at the debugger's prompt"):
        shell.run_line_magic("mesh", "debug list")
