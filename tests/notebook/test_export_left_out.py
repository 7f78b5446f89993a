"""The export tells the truth about the cells it leaves out (issue 61): it needs a failed cell
only for a name a later cell reads before binding it, lists the failed cells it leaves out,
and says when one drew random numbers, so that the script's would differ from the notebook's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
import pytest

from meshlab.mesh import MeshSpec
from meshlab.notebook.export import (
    ExportError,
    Journal,
    Layout,
    export,
    read_notebook,
    script,
)
from meshlab.notebook.export.names import free_reads, seeds_first


def journal(*cells: tuple[int, str, tuple[str, ...] | None],
            failed: tuple[tuple[int, str, tuple[str, ...] | None], ...] = ()) -> Journal:
    """A dp=4 session at In [1], then the cells (number, code, generators drawn)."""
    j = Journal(world_size=4, backend="gloo")
    j.record_mesh(MeshSpec.parse("dp=4"), 1)
    for number, code, drew in cells:
        j.record_cell(code, number, drew=drew)
    for number, code, drew in failed:
        j.record_failure(code, number, drew=drew)
    return j


# -- a name a cell binds before it reads it is not taken from a failed cell ----------------

TP_PLAN = "%%mesh\ntp_plan = {'attn.q': 'colwise'}\nmodel = parallelize(model, mesh, tp_plan)"


def test_a_cell_that_assigns_a_name_before_reading_it_needs_no_failed_cell_for_it() -> None:
    j = journal((14, "%%mesh\nmodel = build()", ()), (16, TP_PLAN, ()),
                failed=((15, "%%mesh\ntp_plan = make_plan()\nraise ValueError", ()),))
    assert "model = parallelize(model, mesh, tp_plan)" in script(j, Layout(1, 4))


@pytest.mark.parametrize("reader", [
    "%%mesh\nif big:\n    tp_plan = {}\nmodel = parallelize(model, mesh, tp_plan)",  # a branch
    "%%mesh\ntp_plan = tp_plan | {'mlp': 'rowwise'}",  # read on the right first
    "%%mesh\nfor layer in layers:\n    tp_plan = {}\nprint(tp_plan)",  # a loop may not run
    "%%mesh\ndef shard():\n    return tp_plan\nshard()\ntp_plan = {}",  # called before bound
])
def test_a_name_a_cell_may_read_before_binding_it_still_needs_the_failed_cell(
        reader: str) -> None:
    j = journal((16, reader, ()), failed=((15, "%%mesh\ntp_plan = make_plan()", ()),))
    with pytest.raises(ExportError, match=r"In \[15\] failed and defines `tp_plan`, used by "
                                          r"In \[16\]: re-run it successfully and In \[16\] "
                                          r"after it, then export --cells N- "):
        script(j, Layout(1, 4))


@pytest.mark.parametrize("code, reads", [
    ("x = 1\nprint(x)", {"print"}),
    ("x = x + 1", {"x"}),
    ("x += 1", {"x"}),
    ("if c:\n    y = 1\nelse:\n    y = 2\nprint(y)", {"c", "print"}),  # bound on every path
    ("try:\n    y = f()\nexcept E:\n    pass\nprint(y)", {"f", "E", "print", "y"}),
    ("with open(p) as fh:\n    data = fh.read()\nprint(data)", {"open", "p", "print"}),
    ("ys = [v * k for v in xs]", {"xs", "k"}),  # a comprehension's own variable
    ("f = lambda a: a + b", {"b"}),
    ("def step():\n    return model(x)\nmodel, x = 1, 2\nstep()", set()),  # called after
    ("def later():\n    return model\n", {"model"}),  # a later cell calls it
    ("def f():\n    y = 1\n    return y + z\n", {"z"}),  # its locals are its own
    ("class A:\n    k = 1\n    j = k + w\n", {"w"}),
    ("if (m := f()):\n    print(m)", {"f", "print"}),
    ("x = 1\ndel x\nprint(x)", {"print", "x"}),
    ("%%mesh --ranks 0\n%time y = 1\nprint(y)", {"print", "y"}),  # a magic line binds nothing
])
def test_a_cells_free_reads_follow_the_order_it_runs_in(code: str, reads: set[str]) -> None:
    assert free_reads(code) == reads


# -- the failed cells left out are listed ---------------------------------------------------

def test_the_failed_cells_left_out_are_listed_by_the_export_and_atop_the_script(
        tmp_path: Path) -> None:
    j = journal((3, "%%mesh\nx = 1", ()), (6, "%%mesh\nprint(x)", ()),
                failed=((4, "%%mesh\nprint(undefined)", ()), (5, "%%mesh\n1 / 0", ())))
    written = export(j, tmp_path / "train.py")
    assert written.notes == ["Left out, having failed: In [4], In [5]."]
    top = (tmp_path / "train.py").read_text().split("import torch")[0]
    assert "# Left out, having failed: In [4], In [5]." in top
    # cells outside --cells are not the export's to mention
    assert export(j, tmp_path / "train.py", cells="6").notes == []


# -- a left-out cell that drew random numbers is named, with a fix that works ---------------

def test_a_failed_cell_that_drew_random_numbers_is_named_with_the_fix(tmp_path: Path) -> None:
    j = journal((2, "%%mesh\ntorch.manual_seed(0)", ("torch",)),
                (3, "%%mesh\nx = torch.randn(4)", ("torch",)),
                (16, "%%mesh\nmodel = torch.nn.Linear(4, 4)", ("torch",)),
                failed=((15, "%%mesh\nw = torch.randn(4)\nboom()", ("torch",)),))
    notes = export(j, tmp_path / "train.py").notes
    assert notes[1].startswith(
        "In [15] failed after drawing random numbers (torch) and is left out: the script "
        "draws different ones from In [16] on")
    assert "export --cells 2-14,N- (N: the seed cell's new number)" in notes[1]
    assert "# In [15] failed after drawing random numbers" in (tmp_path / "train.py").read_text()
    # the fix: the seed cell and the cells after it run again, as In [20] and In [21]
    j.record_cell("%%mesh\ntorch.manual_seed(0)", 20, drew=("torch",))
    j.record_cell("%%mesh\nmodel = torch.nn.Linear(4, 4)", 21, drew=("torch",))
    assert export(j, tmp_path / "train.py", cells="2-14,20-").notes == []


@pytest.mark.parametrize("moved, later, drew", [
    (("torch",), "%%mesh\nprint(x)", ()),  # nothing after it draws
    (("torch",), "%%mesh\nimport torch\nseed = 0\ntorch.manual_seed(seed)\n"
                 "m = torch.nn.Linear(2, 2)", ("torch",)),  # seeds before drawing
    (("random",), "%%mesh\nm = torch.nn.Linear(2, 2)", ("torch",)),  # another generator
])
def test_a_failed_cell_that_drew_is_no_matter_when_nothing_after_it_draws_the_same_unseeded(
        moved: tuple[str, ...], later: str, drew: tuple[str, ...], tmp_path: Path) -> None:
    j = journal((3, "%%mesh\nx = 1", ()), (16, later, drew),
                failed=((15, "%%mesh\nw = torch.randn(4)\nboom()", moved),))
    assert export(j, tmp_path / "train.py").notes == ["Left out, having failed: In [15]."]


def test_a_seed_call_counts_only_before_anything_that_may_draw() -> None:
    assert seeds_first("import torch\nseed = 0\ntorch.manual_seed(seed)") == {"torch", "cuda"}
    assert seeds_first("x = torch.randn(2)\ntorch.manual_seed(0)") == set()
    assert seeds_first("random.seed(1)\ng = torch.cuda.manual_seed_all(1)") == {"random",
                                                                                "cuda"}


def test_a_saved_notebook_cannot_tell_whether_a_failed_cell_drew_and_says_so(
        tmp_path: Path) -> None:
    failed = nbformat.v4.new_code_cell("%%mesh\nw = torch.randn(4)\nboom()", execution_count=2)
    failed.outputs = [nbformat.v4.new_output("error", ename="E", evalue="", traceback=[])]
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("%mesh init dp=4", execution_count=1), failed,
        nbformat.v4.new_code_cell("%%mesh\nm = torch.nn.Linear(2, 2)", execution_count=3)])
    nbformat.write(nb, tmp_path / "s.ipynb")
    notes = export(read_notebook(tmp_path / "s.ipynb"), tmp_path / "train.py").notes
    assert notes[1].startswith("In [2] failed and is left out; meshlab cannot tell whether it "
                               "drew random numbers")
    assert "If it did, the script draws different ones from In [3] on" in notes[1]


# -- on the ranks -----------------------------------------------------------------------------

def test_the_ranks_say_which_failed_cells_drew_and_the_export_names_them(
        shell: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, "gloo")  # this test's cells only
    numbers = []
    for cell in ["%%mesh\nkept = torch.randn(2)",
                 "%%mesh\ndrawn = torch.randn(2)\nraise ValueError('after a draw')",
                 "%%mesh\nraise ValueError('before any draw')",
                 "%%mesh\nlayer = torch.nn.Linear(2, 2)"]:
        shell.run_cell(cell, store_history=True)
        numbers.append(shell.execution_count - 1)
    first, drew, quiet, last = numbers
    assert [e.drew for e in session.journal.failed] == [("torch",), ()]
    capsys.readouterr()
    shell.run_line_magic("mesh", f"export {tmp_path / 'train.py'}")
    printed = capsys.readouterr().out
    assert f"Left out, having failed: In [{drew}], In [{quiet}]." in printed
    assert (f"In [{drew}] failed after drawing random numbers (torch) and is left out: the "
            f"script draws different ones from In [{last}] on") in printed
    assert f"In [{quiet}] failed after" not in printed
    assert f"--cells {first}-{drew - 1},N-" in printed
    top = (tmp_path / "train.py").read_text().split("import torch")[0]
    assert f"# In [{drew}] failed after drawing random numbers (torch)" in top
