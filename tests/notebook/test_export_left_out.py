"""The export tells the truth about the cells it leaves out (issue 61): it needs a failed cell
only for a name a later cell reads before binding it, and lists the failed cells it leaves
out."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshlab.mesh import MeshSpec
from meshlab.notebook.export import (
    ExportError,
    Journal,
    Layout,
    export,
    script,
)
from meshlab.notebook.export.names import free_reads


def journal(*cells: tuple[int, str], failed: tuple[tuple[int, str], ...] = ()) -> Journal:
    """A dp=4 session at In [1], then the cells (number, code)."""
    j = Journal(world_size=4, backend="gloo")
    j.record_mesh(MeshSpec.parse("dp=4"), 1)
    for number, code in cells:
        j.record_cell(code, number)
    for number, code in failed:
        j.record_failure(code, number)
    return j


# -- a name a cell binds before it reads it is not taken from a failed cell ----------------

TP_PLAN = "%%mesh\ntp_plan = {'attn.q': 'colwise'}\nmodel = parallelize(model, mesh, tp_plan)"


def test_a_cell_that_assigns_a_name_before_reading_it_needs_no_failed_cell_for_it() -> None:
    j = journal((14, "%%mesh\nmodel = build()"), (16, TP_PLAN),
                failed=((15, "%%mesh\ntp_plan = make_plan()\nraise ValueError"),))
    assert "model = parallelize(model, mesh, tp_plan)" in script(j, Layout(1, 4))


@pytest.mark.parametrize("reader", [
    "%%mesh\nif big:\n    tp_plan = {}\nmodel = parallelize(model, mesh, tp_plan)",  # a branch
    "%%mesh\ntp_plan = tp_plan | {'mlp': 'rowwise'}",  # read on the right first
    "%%mesh\nfor layer in layers:\n    tp_plan = {}\nprint(tp_plan)",  # a loop may not run
    "%%mesh\ndef shard():\n    return tp_plan\nshard()\ntp_plan = {}",  # called before bound
])
def test_a_name_a_cell_may_read_before_binding_it_still_needs_the_failed_cell(
        reader: str) -> None:
    j = journal((16, reader), failed=((15, "%%mesh\ntp_plan = make_plan()"),))
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
    j = journal((3, "%%mesh\nx = 1"), (6, "%%mesh\nprint(x)"),
                failed=((4, "%%mesh\nprint(undefined)"), (5, "%%mesh\n1 / 0")))
    written = export(j, tmp_path / "train.py")
    assert written.notes == ["Left out, having failed: In [4], In [5]."]
    top = (tmp_path / "train.py").read_text().split("import torch")[0]
    assert "# Left out, having failed: In [4], In [5]." in top
    # cells outside --cells are not the export's to mention
    assert export(j, tmp_path / "train.py", cells="6").notes == []
