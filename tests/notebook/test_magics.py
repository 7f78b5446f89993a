"""The %mesh magics in a real IPython shell, on the shared cluster."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from IPython.core.completer import provisionalcompleter
from IPython.utils.capture import capture_output

from meshlab.notebook.output import strip_ansi


def run(shell: Any, cell: str) -> tuple[Any, str]:
    """Run a cell; return IPython's result and everything it showed, as plain text."""
    with capture_output() as cap:
        result = shell.run_cell(cell)
    shown = [cap.stdout, cap.stderr] + [o.data.get("text/plain", "") for o in cap.outputs]
    return result, strip_ansi("\n".join(shown))


def test_cell_output_is_grouped_by_rank(shell: Any) -> None:
    result, shown = run(shell, "%%mesh\nprint('same')\nprint('rank', rank)\nrank * 0")
    assert result.success
    assert "[rank 0]\nsame\nrank 0" in shown and "[rank 3]\nsame\nrank 3" in shown
    assert "Out[ranks 0-3]: 0" in shown


def test_ranks_option_runs_a_subset(shell: Any) -> None:
    _, shown = run(shell, "%%mesh --ranks 1,3\nprint('hi')")
    assert "[ranks 1,3] hi" in shown


def test_failed_cell_shows_a_summary_and_one_traceback(shell: Any) -> None:
    result, shown = run(shell, "%%mesh\nprint('ok', rank)\nassert rank != 2, 'rank two'")
    assert not result.success
    assert "1 of 4 ranks failed:\n  [rank 2] AssertionError: rank two" in shown
    assert "Traceback from rank 2:" in shown and "[rank 0] ok 0" in shown


def test_timeout_option_ends_a_stuck_cell(shell: Any) -> None:
    result, shown = run(shell, "%%mesh --ranks 0 --timeout 1\nimport time\ntime.sleep(60)")
    assert not result.success
    assert "[rank 0] still running after the 1 s time limit" in shown and "time.sleep" in shown
    assert run(shell, "%%mesh\nrank")[0].success  # interrupted cleanly: usable at once


def run_numbered(shell: Any, cell: str) -> tuple[int, str]:
    """Run a cell as a notebook does (its input kept as In [n]) after the ranks ran cells
    the notebook did not count; return n and what the cell showed."""
    cluster = shell.magics_manager.registry["MeshMagics"].session.cluster
    for _ in range(3):  # each rank's own count of cells runs ahead of the notebook's
        cluster.run("pass")
    with capture_output() as cap:
        shell.run_cell(cell, store_history=True)
    shown = [cap.stdout, cap.stderr] + [o.data.get("text/plain", "") for o in cap.outputs]
    return len(shell.history_manager.input_hist_raw) - 1, strip_ansi("\n".join(shown))


def test_a_ranks_traceback_names_the_notebooks_cell(shell: Any) -> None:
    number, shown = run_numbered(shell, "%%mesh\ndef inner():\n    raise KeyError(rank)\n"
                                        "inner()")
    # lines count from the first line under %%mesh, which is the rank's whole cell
    assert f"Cell In[{number}], line 3" in shown and f"Cell In[{number}], line 2, in inner" \
        in shown, shown


def test_a_timeout_stack_names_the_notebooks_cell(shell: Any) -> None:
    number, shown = run_numbered(shell, "%%mesh --ranks 0 --timeout 1\nimport time\n"
                                        "def wait_here():\n    time.sleep(60)\nwait_here()")
    assert "still running after the 1 s time limit" in shown
    assert f"Cell In[{number}], line 4, in <module>" in shown, shown
    assert f"Cell In[{number}], line 3, in wait_here" in shown and ".py" not in shown, shown


def test_a_cell_that_trains_is_known_without_asking_the_ranks_again(
        shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session

    def ask(*args: Any) -> int:
        raise AssertionError("a second round trip to the ranks after the cell")

    monkeypatch.setattr(session.cluster, "optimizer_steps", ask)
    step = "opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)\nopt.step()"
    assert run(shell, f"%%mesh\n{step}")[0].success
    assert session.journal.entries[-1].trained  # the count came back with the cell itself
    assert run(shell, "%%mesh\nx = 1")[0].success
    assert not session.journal.entries[-1].trained


def test_o_stores_per_rank_values(shell: Any) -> None:
    run(shell, "%%mesh -o squares\nrank ** 2")
    assert shell.user_ns["squares"] == {0: 0, 1: 1, 2: 4, 3: 9}


def test_push_pull_and_status(shell: Any) -> None:
    shell.user_ns["lr"] = 3e-4
    run(shell, "%mesh push lr")
    assert shell.run_line_magic("mesh", "pull lr --ranks 0-1") == {0: 3e-4, 1: 3e-4}
    assert list(shell.run_line_magic("mesh", "status").frame["rank"]) == [0, 1, 2, 3]


def test_auto_mode_runs_plain_cells_on_the_ranks(shell: Any) -> None:
    run(shell, "%mesh auto on")
    try:
        _, shown = run(shell, "auto_value = rank + 10\nauto_value")
        assert "Out[rank 3]: 13" in shown
    finally:
        run(shell, "%mesh auto off")
    assert "auto_value" not in shell.user_ns
    assert shell.run_line_magic("mesh", "pull auto_value")[1] == 11


def test_tab_completion_inside_a_mesh_cell_uses_rank_0(shell: Any) -> None:
    run(shell, "%%mesh\nrank_only_tensor = torch.zeros(1)")
    text = "%%mesh\nrank_only_te"
    with provisionalcompleter():
        names = [c.text for c in shell.Completer.completions(text, len(text))]
    assert "rank_only_tensor" in names


@pytest.mark.parametrize("line, message", [
    ("%mesh", "%mesh needs a subcommand"),
    ("%mesh launch 4", "unknown subcommand 'launch'"),
    ("%mesh push not_defined_anywhere", "not defined in the notebook: not_defined_anywhere"),
    ("%mesh pull not_defined_anywhere", "'not_defined_anywhere' is not defined on rank"),
    ("%%mesh --bogus\n1", "unrecognized arguments: --bogus"),
    ("%%mesh --ranks 9\n1", "out of range: the cluster has ranks 0-3"),
    ("%mesh start 2", "already running: %mesh stop first"),
    ("%mesh auto maybe", "invalid choice: 'maybe'"),
])
def test_misuse_names_the_fix(shell: Any, line: str, message: str) -> None:
    result, shown = run(shell, line)
    assert not result.success and message in shown, shown


@contextmanager
def no_cluster(shell: Any) -> Iterator[None]:
    """The shell as it is before `%mesh start`."""
    session = shell.magics_manager.registry["MeshMagics"].session
    cluster, session.cluster = session.cluster, None
    try:
        yield
    finally:
        session.cluster = cluster


def test_mesh_before_start_says_how_to_start(shell: Any) -> None:
    with no_cluster(shell):
        result, shown = run(shell, "%%mesh\n1")
    assert not result.success and "no cluster is running: %mesh start N" in shown


def test_start_with_an_unknown_profile_lists_the_known_ones(shell: Any) -> None:
    with no_cluster(shell):
        result, shown = run(shell, "%mesh start 2 --profile nope")
    assert not result.success
    assert "unknown cluster profile 'nope': available profiles are local" in shown


def test_help_documents_every_subcommand() -> None:
    from meshlab.magics import MeshMagics

    from meshlab.notebook import commands

    def unwrapped(text: str) -> str:  # argparse wraps lines, and words at their hyphens
        return "".join(text.split())

    doc = unwrapped(MeshMagics.mesh.__doc__ or "")
    assert unwrapped("%%mesh [--ranks RANKS]") in doc
    for name, parser in commands.SUBCOMMANDS.items():
        section = doc.split(f"%mesh{name}", 1)[1]  # from its usage line on
        for action in parser.parser._actions:  # every option and argument, with its help
            for flag in action.option_strings:
                assert flag in section, (name, flag)
            if action.help:
                shown = action.help.replace("%%", "%")  # argparse formats help with %
                assert unwrapped(shown) in section, (name, shown)




def test_o_keeps_the_values_that_travel_and_names_the_rank_whose_value_cannot(
        shell: Any) -> None:
    result, shown = run(shell, "%%mesh -o vals\nimport threading\n"
                               "threading.Lock() if rank == 2 else rank")
    assert result.success
    assert shell.user_ns["vals"] == {0: 0, 1: 1, 3: 3}
    assert "[rank 2] value not kept: TypeError: cannot pickle '_thread.lock' object" in shown


def test_push_of_a_value_that_cannot_travel_is_one_line_naming_it(shell: Any) -> None:
    import threading

    shell.user_ns["lock"] = threading.Lock()
    result, shown = run(shell, "%mesh push lock")
    assert not result.success
    assert "cannot push 'lock': a lock cannot be sent to the ranks" in shown
    assert "build it in a %%mesh cell" in shown
    assert "Traceback" not in shown and "ipyparallel" not in shown and len(shown) < 600


def test_a_magic_the_ranks_lack_fails_every_rank_with_its_usage_error(shell: Any) -> None:
    result, shown = run(shell, "%%mesh\n%nosuchmagic")
    assert not result.success
    assert "4 of 4 ranks failed:" in shown and "0 of 4" not in shown
    assert "[ranks 0-3] UsageError: Line magic function `%nosuchmagic` not found" in shown


def test_a_flood_of_output_is_capped_with_a_marker_naming_the_full_output(shell: Any) -> None:
    result, shown = run(shell, "%%mesh --max-lines 100\nfor i in range(5000):\n"
                               "    print('line', i)")
    assert result.success
    assert "line 99\n" in shown and "line 100\n" not in shown
    assert "[ranks 0-3] … 4,900 more stdout lines not shown" in shown, shown[-600:]
    folder = shown.split("full output of each rank: ")[1].split("/rank<N>")[0]
    with open(f"{folder}/rank3.stdout") as f:
        assert f.read().splitlines()[-1] == "line 4999"


def test_a_large_pull_warns_and_offers_ranks(shell: Any) -> None:
    from meshlab.notebook.transfers import PullSizeWarning

    cluster = shell.magics_manager.registry["MeshMagics"].session.cluster
    run(shell, "%%mesh\nbig = torch.zeros(1000)")
    cluster.pull_warn_bytes = 10_000
    try:
        with pytest.warns(PullSizeWarning, match="--ranks"):
            values = shell.run_line_magic("mesh", "pull big")
    finally:
        cluster.pull_warn_bytes = 256 * 2**20
    assert sorted(values) == [0, 1, 2, 3]


@contextmanager
def pull_warns_above(shell: Any, limit: int) -> Iterator[None]:
    cluster = shell.magics_manager.registry["MeshMagics"].session.cluster
    cluster.pull_warn_bytes = limit
    try:
        yield
    finally:
        cluster.pull_warn_bytes = 256 * 2**20


def test_a_large_pull_shown_as_the_cells_result_says_the_output_cache_keeps_it(
        shell: Any) -> None:
    from meshlab.notebook.transfers import PullSizeWarning

    run(shell, "%%mesh\nbig = torch.zeros(1000)")
    with pull_warns_above(shell, 10_000), pytest.warns(PullSizeWarning) as warned, \
            capture_output():
        assert shell.run_cell("%mesh pull big", store_history=True).success
    n = max(shell.user_ns["Out"])  # where IPython keeps it
    assert sorted(shell.user_ns["Out"][n]) == [0, 1, 2, 3]
    assert str(warned[0].message).endswith(
        f"takes fewer. Shown as this cell's result, it also stays in IPython's output cache "
        f"(Out[{n}], _{n}, _) after you drop it: only `%reset -f` (every variable) frees it; "
        "`%reset -f out` keeps hidden references, and `;` after a magic is passed to the "
        "magic. Assign it instead: `big = %mesh pull big`; `del big` then frees it")


@pytest.mark.parametrize("cell", ["kept = %mesh pull big", "%mesh pull big\nNone"])
def test_a_large_pull_not_shown_does_not_mention_the_output_cache(shell: Any,
                                                                    cell: str) -> None:
    from meshlab.notebook.transfers import PullSizeWarning

    run(shell, "%%mesh\nbig = torch.zeros(1000)")
    with pull_warns_above(shell, 10_000), pytest.warns(PullSizeWarning) as warned, \
            capture_output():
        assert shell.run_cell(cell, store_history=True).success
    assert "output cache" not in str(warned[0].message)


def test_a_small_pull_shown_as_the_cells_result_does_not_warn(shell: Any) -> None:
    import warnings

    run(shell, "%%mesh\nsmall = torch.zeros(10)")
    with warnings.catch_warnings(record=True) as warned, capture_output():
        warnings.simplefilter("always")
        assert shell.run_cell("%mesh pull small", store_history=True).success
    assert not [w for w in warned if "pull" in str(w.message)]


def test_ctrl_c_while_a_subcommand_waits_is_one_line_naming_what_to_do(
        shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(session, "init", interrupted)
    result, shown = run(shell, "%mesh init dp=4")
    assert not result.success and "Traceback" not in shown
    assert "%mesh init interrupted. The ranks may still be building the mesh" in shown


def test_loading_the_magics_leaves_charting_until_a_chart_is_drawn() -> None:
    import subprocess
    import sys

    # altair and its JSON schema cost a second or more before a rank could start (issue 61)
    code = ("import sys, meshlab.magics; "
            "print(sorted(m for m in ('altair', 'jsonschema') if m in sys.modules))")
    ran = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert ran.stdout.strip() == "[]", ran.stdout + ran.stderr
