"""The rules of shared/DESIGN.md, checked on the tree as it is (not on a list of modules)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import meshlab

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

    root = Path(__file__).resolve().parents[1]  # the checkout
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {".".join(p.parent.relative_to(root).parts)
             for p in (root / "meshlab").rglob("__init__.py")}
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"
