"""The recovery table: failure scenarios run on a real cluster, each ending either with a
working process group by itself (within the process-group timeout plus one cell) or with
meshlab naming `%mesh restart` (then a restart must give a working cluster). None may leave
the cluster broken without naming the fix.

Add a scenario by appending a ``Scenario`` to ``SCENARIOS``: ``provoke`` does what the user
did on the session and returns what they were shown (``say`` collects it); the table then
runs one all_reduce cell and classifies the outcome. Recovery times are printed, never
asserted (the machine is shared).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from meshlab import ClusterError, MeshError, Session

pytestmark = pytest.mark.cluster

PG_TIMEOUT = 5  # seconds: short, so waited-out collectives fail soon; above every
# time limit a scenario gives its cell, so the limit, not the timeout, ends that cell
PROFILE = f"""
[cluster]
launcher = "local"
backend = "gloo"
pg_timeout = {PG_TIMEOUT}
start_timeout = 120
"""
ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
FIX = "%mesh restart"


def say(action: Callable[[], object]) -> str:
    """What the user sees from one action: its result and notes, or its error."""
    try:
        out = action()
    except (MeshError, ClusterError) as e:
        return f"{type(e).__name__}: {e}"
    notes = getattr(out, "notes", [])
    return "\n".join([str(out), *notes])


@contextlib.contextmanager
def ctrl_c_after(seconds: float) -> Iterator[None]:
    """Press Ctrl-C once, ``seconds`` into the block (never after it)."""
    armed = threading.Event()

    def handler(signum: int, frame: object) -> None:
        if armed.is_set():
            armed.clear()
            raise KeyboardInterrupt

    old = signal.signal(signal.SIGINT, handler)
    armed.set()
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        yield
    finally:
        armed.clear()
        timer.cancel()
        timer.join()
        time.sleep(0.2)  # a signal already sent meets the disarmed handler
        signal.signal(signal.SIGINT, old)


@dataclass(frozen=True)
class Scenario:
    name: str
    provoke: Callable[[Session], str]
    """Does what the user did; returns what they were shown."""


def _loop_with_memory_error(s: Session) -> str:
    return say(lambda: s.run(
        "for i in range(400):\n    t = torch.ones(1000)\n    dist.all_reduce(t)\n"
        "    if rank == 2 and i == 10:\n        raise MemoryError('out of memory')", timeout=120))


def _barrier_on_rank_0(s: Session) -> str:
    return say(lambda: s.run("if rank == 0:\n    dist.barrier()", timeout=120))


def _hang_stopped_by_time_limit(s: Session) -> str:
    return say(lambda: s.run("if rank != 0:\n    dist.all_reduce(torch.ones(1))", timeout=2))


def _hang_stopped_by_ctrl_c(s: Session) -> str:
    with ctrl_c_after(2):
        return say(lambda: s.run("if rank != 0:\n    dist.all_reduce(torch.ones(1))"))


def _uneven_then_new_group(s: Session) -> str:
    return say(lambda: s.run("if rank < 2:\n    g = dist.new_group([0, 1])")) + say(
        lambda: s.run("g = dist.new_group([0, 1, 2, 3])", timeout=60))


def _uneven_then_init(s: Session) -> str:
    return say(lambda: s.run("if rank < 2:\n    g = dist.new_group([0, 1])")) + say(
        lambda: s.init("dp=2 tp=2"))


# `getattr` hides the call from meshlab's look at the cell's text
HIDDEN_NEW_GROUP = "getattr(dist, 'new_' + 'group')"


def _hidden_uneven_then_init(s: Session) -> str:
    return say(lambda: s.run(f"if rank < 2:\n    g = {HIDDEN_NEW_GROUP}([0, 1])")) + say(
        lambda: s.init("dp=2 tp=2"))


def _hidden_uneven_then_hidden_new_group(s: Session) -> str:
    return say(lambda: s.run(f"if rank < 2:\n    g = {HIDDEN_NEW_GROUP}([0, 1])")) + say(
        lambda: s.run(f"g = {HIDDEN_NEW_GROUP}([0, 1, 2, 3])", timeout=3))


def _ctrl_c_during_init(s: Session) -> str:
    with ctrl_c_after(0.3):
        return say(lambda: s.init("dp=2 tp=2"))


def _destroy(s: Session) -> str:
    return say(lambda: s.run("dist.destroy_process_group()"))


def _destroy_then_restart(s: Session) -> str:
    shown = say(lambda: s.run("x = 1")) + say(lambda: s.run("dist.destroy_process_group()"))
    lines: list[str] = []
    return shown + say(lambda: s.restart(progress=lines.append)) + "\n".join(lines)


def _exit_code(s: Session) -> str:
    return say(lambda: s.run("import os\nif rank == 3:\n    os._exit(3)\n"
                             "dist.all_reduce(torch.ones(1))", timeout=60))


def _sigkill(s: Session) -> str:
    return say(lambda: s.run("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), "
                             "signal.SIGKILL)\ndist.all_reduce(torch.ones(1))", timeout=60))


def _unpicklable_last_value(s: Session) -> str:
    return say(lambda: s.run("import threading\nthreading.Lock() if rank == 2 else rank",
                             keep_values=True))


def _unpicklable_push(s: Session) -> str:
    return say(lambda: s.push({"lock": threading.Lock()}))


def _output_flood(s: Session) -> str:
    return say(lambda: s.run("for i in range(50_000):\n    print('line', i)").truncated())


SCENARIOS = [
    Scenario("MemoryError on rank 2 inside all_reduce loop, waited out", _loop_with_memory_error),
    Scenario("barrier on rank 0 only, waited out", _barrier_on_rank_0),
    Scenario("hung collective stopped by the cell time limit", _hang_stopped_by_time_limit),
    Scenario("hung collective stopped by Ctrl-C", _hang_stopped_by_ctrl_c),
    Scenario("new_group on ranks 0-1 only, then new_group on all", _uneven_then_new_group),
    Scenario("new_group on ranks 0-1 only, then %mesh init", _uneven_then_init),
    Scenario("hidden new_group on ranks 0-1, then %mesh init", _hidden_uneven_then_init),
    Scenario("hidden new_group on ranks 0-1, then hidden new_group on all",
             _hidden_uneven_then_hidden_new_group),
    Scenario("Ctrl-C during %mesh init", _ctrl_c_during_init),
    Scenario("dist.destroy_process_group()", _destroy),
    Scenario("dist.destroy_process_group(), then %mesh restart replays", _destroy_then_restart),
    Scenario("rank 3 exits with os._exit(3)", _exit_code),
    Scenario("rank 1 killed by SIGKILL", _sigkill),
    Scenario("unpicklable last value on rank 2 (-o)", _unpicklable_last_value),
    Scenario("%mesh push of an unpicklable object", _unpicklable_push),
    Scenario("output flood: 50,000 lines on every rank", _output_flood),
]


@dataclass
class Outcome:
    scenario: str
    verdict: str  # recovered | named the fix | broken
    seconds: float
    """From the failing action's start to a working all_reduce (or to the fix named)."""
    detail: str = ""


def run_scenario(s: Session, scenario: Scenario) -> Outcome:
    s.journal = None  # each scenario replays only its own cells on a restart
    started = time.perf_counter()
    shown = scenario.provoke(s)
    check = say(lambda: s.run(ALL_REDUCE, timeout=PG_TIMEOUT * 6))
    if "Out[ranks 0-3]: 4.0" in check:
        return Outcome(scenario.name, "recovered", time.perf_counter() - started)
    if FIX not in shown + check:
        return Outcome(scenario.name, "broken", time.perf_counter() - started, shown + check)
    s.journal = None
    s.restart(progress=lambda line: None)
    after = say(lambda: s.run(ALL_REDUCE, timeout=PG_TIMEOUT * 6))
    verdict = "named the fix" if "Out[ranks 0-3]: 4.0" in after else "broken"
    return Outcome(scenario.name, verdict, time.perf_counter() - started, shown + check + after)


def test_no_scenario_leaves_the_cluster_broken_without_naming_the_fix(tmp_path: Path) -> None:
    profile = tmp_path / "recovery.toml"
    profile.write_text(PROFILE)
    outcomes = []
    with Session(4, profile=profile) as s:
        for scenario in SCENARIOS:
            outcome = run_scenario(s, scenario)
            outcomes.append(outcome)
            print(f"{outcome.verdict:>14}  {outcome.seconds:6.1f} s  {outcome.scenario}")
            if outcome.verdict != "recovered":
                print("    " + outcome.detail.replace("\n", "\n    "))
    fine = sum(o.verdict != "broken" for o in outcomes)
    broken = len(outcomes) - fine
    print(f"{len(outcomes)} scenarios, {fine} recovered or named the fix, "
          f"{broken} left the cluster broken")
    assert broken == 0, [o.scenario for o in outcomes if o.verdict == "broken"]
