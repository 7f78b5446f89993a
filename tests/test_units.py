"""Pure-Python pieces: rank sets, profiles, output grouping, package layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import meshlab
from meshlab.notebook import profiles
from meshlab.notebook.output import (
    CellResult,
    RankError,
    RankOutput,
    clean_traceback,
    render_groups,
)
from meshlab.notebook.ranks import format_ranks, label, parse_ranks


def test_parse_ranks_accepts_lists_and_ranges() -> None:
    assert parse_ranks("0,2-3", 4) == [0, 2, 3]
    assert parse_ranks(None, 3) == [0, 1, 2]
    assert parse_ranks([3, 1, 1], 4) == [1, 3]


@pytest.mark.parametrize("spec, message", [
    ("5", "out of range: the cluster has ranks 0-3"),
    ("a", "bad rank set 'a'"),
    ("3-1", "bad rank set '3-1'"),
    ("", "empty"),
])
def test_parse_ranks_rejects_bad_sets_with_the_fix(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_ranks(spec, 4)


def test_format_ranks_compresses_runs() -> None:
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert label([2]) == "[rank 2]" and label([0, 1, 2, 3]) == "[ranks 0-3]"


def test_builtin_local_profile_loads() -> None:
    p = profiles.load("local")
    assert (p.launcher, p.backend, p.ranks, p.cell_timeout) == ("local", "auto", None, None)


def test_unknown_profile_lists_the_available_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster profile 'nope'.*available profiles "
                                         r"are local"):
        profiles.load("nope")


def test_profile_from_a_user_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[cluster]\nranks = 2\npg_timeout = 5\n[env]\nOMP_NUM_THREADS = 1\n')
    p = profiles.load(path)
    assert (p.name, p.ranks, p.pg_timeout, p.env) == ("mine", 2, 5, {"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("text, message", [
    ("[cluster]\nrnaks = 2\n", r"unknown \[cluster\] key\(s\) \['rnaks'\]"),
    ('[cluster]\nbackend = "mpi"\n', "backend 'mpi' is not one of"),
    ("[clusters]\n", r"unknown table\(s\)"),
])
def test_bad_profiles_name_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        profiles.load(path)


def test_identical_output_collapses_and_different_output_groups_by_rank() -> None:
    assert render_groups({0: "x\n", 1: "x\n", 2: "x\n", 3: "x\n"}) == "[ranks 0-3] x"
    assert render_groups({0: "a\n", 1: "b\n", 2: "a\n", 3: ""}) == "[ranks 0,2] a\n[rank 1] b"
    assert render_groups({0: "a\nb\n", 1: "a\nb\n"}) == "[ranks 0-1]\na\nb"


def test_summary_groups_ranks_with_the_same_error() -> None:
    outputs = {r: RankOutput(r, status="ok") for r in range(4)}
    for r in (1, 3):
        outputs[r] = RankOutput(r, status="error", error=RankError("ValueError", "bad"))
    summary = CellResult([0, 1, 2, 3], outputs).summary()
    assert summary.splitlines() == ["2 of 4 ranks failed:", "  [ranks 1,3] ValueError: bad"]


def test_clean_traceback_drops_internal_frames() -> None:
    chunks = ["ValueError  Traceback", "Cell In[2], line 1\n----> 1 f()",
              "File /x/site-packages/ipyparallel/engine/kernel.py:10, in run\n  ...",
              "File /work/model.py:3, in f\n  raise ValueError", "ValueError: bad"]
    assert clean_traceback(chunks) == [chunks[0], chunks[1], chunks[3], chunks[4]]


# What a rank may not import: the notebook stack, and pandas only when a function needs it.
NOTEBOOK_STACK = ("IPython", "ipyparallel", "ipywidgets", "anywidget", "altair", "pandas",
                  "meshlab.notebook", "meshlab.magics", "meshlab.extension")


def rank_side_modules() -> list[str]:
    """Every module under meshlab/ outside meshlab/notebook/, found on disk (not a list)."""
    root = Path(meshlab.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if "notebook" in parts or parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_rank_side_is_found_on_disk() -> None:
    modules = rank_side_modules()
    assert {"meshlab.runtime", "meshlab.checkpoint", "meshlab.calibrate",
            "meshlab.calibrate.host_costs", "meshlab.plan.estimate"} <= set(modules)
    assert not any(m.startswith("meshlab.notebook") for m in modules)


def test_rank_side_modules_do_not_import_the_notebook_stack() -> None:
    # one fresh interpreter imports every rank-side module, then names each culprit
    code = ("import importlib, sys\n"
            f"modules = {rank_side_modules()!r}\n"
            f"stack = {NOTEBOOK_STACK!r}\n"
            "bad = {}\n"
            "for m in modules:\n"
            "    before = set(sys.modules)\n"
            "    importlib.import_module(m)\n"
            "    new = [n for n in set(sys.modules) - before if n.split('.')[0] in stack\n"
            "           or any(n == s or n.startswith(s + '.') for s in stack)]\n"
            "    if new: bad[m] = sorted(new)[:3]\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_magics_and_extension_install_under_the_meshlab_namespace(tmp_path: Path) -> None:
    import meshlab.extension
    import meshlab.magics

    assert callable(meshlab.extension.load_ipython_extension)
    assert hasattr(meshlab.magics, "MeshMagics")
    # Outside the checkout (where the folders themselves are importable), only meshlab is.
    code = "import importlib.util as u; print(u.find_spec('magics'), u.find_spec('extension'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path)
    assert done.stdout.split() == ["None", "None"], done.stdout + done.stderr


def test_every_package_is_in_the_wheel() -> None:
    # setuptools installs only the packages listed: a missing one works in an editable
    # checkout and fails in `pip install .` on the cluster the exported script runs on
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "meshlab").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
