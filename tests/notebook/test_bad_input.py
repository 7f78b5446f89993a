"""Bad input, tried: every malformed %mesh line gets a clear error naming the value and the fix,
and the cluster still runs a collective after each one.

One table, run in order on the shared 4-rank cluster; the run prints how many cases were
tried and passed.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from meshlab.notebook.export import Journal

# (what is typed, a pattern the error must match: the bad value and the way out)
CASES = [
    ("%mesh export {tmp}/train.py", r"no %%mesh cell to export: run some"),  # before any cell
    ("%mesh frobnicate", r"unknown subcommand 'frobnicate': use one of start, stop"),
    ("%mesh", r"%mesh needs a subcommand: start, stop"),
    ("%mesh start", r"already running.*%mesh stop first, or %mesh restart"),
    ("%mesh start 0", r"at least 1 rank, got 0"),
    ("%mesh start 2 --profile nosuch", r"unknown cluster profile 'nosuch': available profiles"),
    ("%mesh start 2 --backend mpi", r"argument --backend: invalid choice: 'mpi'"),
    ("%%mesh --ranks 9\nx = 1", r"rank\(s\) 9 out of range: the cluster has ranks 0-3"),
    ("%%mesh --ranks 2-1\nx = 1", r"'2-1' runs backwards; write 1-2"),
    ("%%mesh --ranks zero\nx = 1", r"'zero'"),
    # checked before a range is built (this one OOM-killed the kernel at 9.9 GB)
    ("%%mesh --ranks 0-99999999999\nx = 1", r"rank\(s\) 0-99999999999 out of range"),
    ("%%mesh --ranks 0-\nx = 1", r"'0-' is not a rank or a range"),
    ("%%mesh --ranks 1,\nx = 1", r"'' is not a rank or a range"),
    # refused before the cell runs, so the journal holds exactly what the ranks ran
    ("%%mesh --profile-dir /proc/meshlab-nowhere\nran_anyway = 1",
     r"--profile-dir '/proc/meshlab-nowhere': cannot make the folder"),
    ("%mesh pull ran_anyway", r"'ran_anyway' is not defined on rank\(s\) 0-3"),
    ("%%mesh --timeout soon\nx = 1", r"argument --timeout: 'soon' is not a finite number"),
    ("%%mesh --timeout -1\nx = 1", r"argument --timeout: '-1' is not a finite number above 0"),
    ("%%mesh --timeout nan\nx = 1", r"argument --timeout: 'nan' is not a finite number"),
    ("%%mesh --max-lines 0\nx = 1", r"argument --max-lines: '0' is not a whole number above"),
    ("%mesh plan llama3-8b --gpus 8 --top 0", r"argument --top: '0' is not a whole number"),
    ("%mesh plan llama3-8b --gpus 8 --verify -1", r"argument --verify: '-1' is not a whole"),
    ("%mesh plan llama3-8b --gpus 8 --tokens=-1e12", r"argument --tokens: '-1e12' is not a"),
    ("%%mesh --bogus\nx = 1", r"unrecognized arguments: --bogus"),
    ("%mesh init dp=3", r"dp_shard=3 = 3, but the cluster has 4 ranks: make the product 4"),
    ("%mesh init dp=2 xx=2", r"unknown mesh axis 'xx=2': write NAME=SIZE with NAME one of pp"),
    ("%mesh init dp=two", r"'dp=two': the size of dp_shard must be an integer"),
    ("%mesh pull never_defined", r"'never_defined' is not defined on rank\(s\) 0-3: define it"),
    ("%%mesh --ranks 0\nonly_on_zero = 1\n%mesh pull only_on_zero",
     r"'only_on_zero' is not defined on rank\(s\) 1-3"),
    ("%mesh inspect never_defined",
     r"cannot inspect 'never_defined':\n  \[ranks 0-3\] NameError"),
    ("%mesh memory never_defined",
     r"cannot measure 'never_defined':\n\[ranks 0-3\] NameError: name 'never_defined' is not"),
    ("%mesh push not_in_notebook", r"not defined in the notebook: not_in_notebook"),
    ("%mesh auto maybe", r"invalid choice: 'maybe'"),
    ("%mesh schedule nosuch", r"unknown schedule 'nosuch': choose one of gpipe, 1f1b"),
    ("%mesh schedule 1f1b --stages 0", r"ranks=0: pass a whole number >= 1"),
    ("%mesh schedule 1f1b --costs 1,x", r"costs '1,x': give F,B"),
    ("%mesh pipeline model --schedule 1f1b", r"no pp axis: %mesh init pp=N"),
    ("%mesh step", r"no pipeline is bound: %mesh pipeline MODEL --schedule NAME"),
    ("%mesh bench rmsnorm --sizes a,b", r"--sizes 'a,b': give row lengths like 256,1024"),
    ("%mesh bench rmsnorm --dtype float128", r"dtype='float128' is not a torch dtype: use float32"),
    ("%mesh bench no_such_kernel", r"\[ranks 0-3\] NameError: name 'no_such_kernel' is not"),
    ("%mesh checkpoint load {tmp}/missing", r"no checkpoint at .*missing: save one"),
    ("%mesh checkpoint save", r"arguments are required: path"),
    ("%mesh restart --upto 999", r"--upto 999: no recorded cell ran as In \[999\]"),
    ("%mesh restart --from-checkpoint {tmp}/missing", r"no checkpoint at"),
    ("%mesh debug 9", r"rank\(s\) 9 out of range: the cluster has ranks 0-3"),
    ("%mesh stacks --ranks 7", r"rank\(s\) 7 out of range"),
]


def error_of(shell: Any, typed: str) -> str | None:
    """The error text the notebook shows for the last cell of ``typed`` (None if it passed)."""
    *setup, last = typed.split("\n%mesh ") if "\n%mesh " in typed else [typed]
    for cell in setup:
        assert shell.run_cell(cell).success, cell
    result = shell.run_cell(("%mesh " + last) if setup else last)
    error = result.error_in_exec or result.error_before_exec
    return None if error is None else f"{type(error).__name__}: {error}"


@pytest.mark.cluster
def test_bad_magic_lines_name_the_value_and_the_fix(shell: Any, tmp_path: Any,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, "gloo")  # nothing recorded: export and restart have no cells
    session.cluster.init_mesh("dp=4")
    failures = []
    for typed, pattern in CASES:
        typed = typed.replace("{tmp}", str(tmp_path))
        shown = error_of(shell, typed)
        if shown is None or not re.search(pattern, shown, re.S):
            failures.append(f"{typed!r}\n    shown: {shown}\n    wanted: {pattern}")
        alive = session.cluster.run("t = torch.ones(1)\ndist.all_reduce(t)\nt.item()",
                                   keep_values=True)
        if alive.values != {r: 4.0 for r in range(4)}:
            failures.append(f"after {typed!r} the cluster no longer reduces: {alive.values}")
    with capsys.disabled():
        print(f"\nbad input: {len(CASES)} cases tried, {len(CASES) - len(failures)} gave a clear "
              "error and left the cluster working")
    assert not failures, "\n".join(failures)


@pytest.mark.cluster
def test_more_local_ranks_than_the_machine_holds_are_refused_before_any_fork() -> None:
    # Session(100000) forked until the machine gave out, then an unclear nanny error
    from meshlab import Session

    with pytest.raises(ValueError, match=r"100000 ranks on this machine need about \d+ GiB "
                                         r"before any cell \(256 MiB each\), and it has .* "
                                         r"available: start at most \d+, or spread them"):
        Session(100000).start()


@pytest.mark.cluster
def test_calibrate_refuses_an_output_it_cannot_write_before_measuring(shell: Any,
                                                                       tmp_path: Any) -> None:
    # it measured for 24 s, then a bare PermissionError, and the measurements were lost
    from IPython.core.error import UsageError

    link = tmp_path / "calibrated.toml"
    link.symlink_to(tmp_path / "elsewhere.toml")
    for target, said in [(link, r"calibrated\.toml is a link \(to .*elsewhere\.toml\)"),
                         (tmp_path, r"is a folder: remove it, or write elsewhere")]:
        with pytest.raises(UsageError, match=said):
            shell.run_line_magic("mesh", f"calibrate -o {target} --quick")
    assert not (tmp_path / "elsewhere.toml").exists()
