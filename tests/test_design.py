"""The rules of shared/DESIGN.md, checked on the tree as it is (not on a list of modules)."""

from __future__ import annotations

import ast
import re
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
    assert {"meshlab.runtime", "meshlab.checkpoint.sharded", "meshlab.calibrate",
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


# -- the rules of shared/DESIGN.md, read off the source -----------------------------------------

REPO = Path(__file__).resolve().parents[1]
AXIS_NAMES = {"pp", "dp_replicate", "dp_shard", "cp", "tp"}


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_every_magic_makes_one_session_call() -> None:
    from meshlab.notebook import commands

    magics = next(n for n in _tree(REPO / "magics" / "__init__.py").body
                  if isinstance(n, ast.ClassDef) and n.name == "MeshMagics")
    methods = {f.name: f for f in magics.body if isinstance(f, ast.FunctionDef)}
    for name in [*commands.SUBCOMMANDS, "cell"]:
        calls = [c for c in ast.walk(methods[f"_{name}"]) if isinstance(c, ast.Call)
                 and isinstance(c.func, ast.Attribute) and ast.unparse(c.func.value)
                 == "self.session"]
        assert len(calls) == 1, f"%mesh {name} makes {len(calls)} Session calls: make it one"


def test_widgets_charts_and_tables_never_call_torch_distributed() -> None:
    notebook = REPO / "meshlab" / "notebook"
    drawn = [*(notebook / "charts").glob("*.py"), *(notebook / "widgets").glob("*.py"),
             *(notebook / "tables").glob("*.py")]
    for path in drawn:
        for node in ast.walk(_tree(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "torch" or n.startswith("torch.") for n in names), (
                f"{path.relative_to(REPO)} imports {names}: ranks send data, the notebook draws")


def test_only_the_mesh_module_spells_out_the_mesh_axes() -> None:
    for path in (REPO / "meshlab").rglob("*.py"):
        if path.name == "mesh.py" and path.parent.name == "meshlab":
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Tuple | ast.List | ast.Set):
                spelled = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert len(spelled & AXIS_NAMES) < 3, (
                    f"{path.relative_to(REPO)}:{node.lineno} lists mesh axes: import AXES "
                    "from meshlab.mesh")


def test_one_parallelism_per_file() -> None:
    for path in sorted((REPO / "meshlab" / "parallel").glob("*.py")):
        verbs = [n.name for n in _tree(path).body
                 if isinstance(n, ast.FunctionDef) and n.name.startswith("apply_")]
        assert len(verbs) <= 1, f"{path.name} defines {verbs}: one parallelism per file"


def test_no_benchmark_is_named_after_a_standard_library_module() -> None:
    # `python benchmarks/X.py` puts benchmarks/ first on sys.path: benchmarks/profile.py
    # shadowed the standard library's `profile`, and dryrun.py's cProfile failed importing it
    shadowing = [p.name for p in (REPO / "benchmarks").glob("*.py")
                 if p.stem in sys.stdlib_module_names]
    assert not shadowing, shadowing


# -- import paths: the documented ones work, the moved ones still do ---------------------------

DOCUMENTED = [REPO / "README.md", *(REPO / "docs").rglob("*.md"),
              *(REPO / "notebooks").glob("*.ipynb")]
IMPORT = re.compile(r"(?:^|\\n|[\s`;\"])from (meshlab[\w.]*) import \(?([\w, ]+)"
                    r"|(?:^|\\n|[\s`;\"])import (meshlab[\w.]*)")


def documented_imports() -> dict[str, set[str]]:
    """Every module the guides, the README and the notebooks import from, with the names."""
    found: dict[str, set[str]] = {}
    for path in DOCUMENTED:
        for m in IMPORT.finditer(path.read_text()):
            module = m.group(1) or m.group(3)
            names = {n.split(" as ")[0].strip() for n in (m.group(2) or "").split(",")}
            found.setdefault(module.rstrip("."), set()).update(n for n in names if n)
    return found


def test_every_import_path_the_docs_and_notebooks_use_imports() -> None:
    found = documented_imports()
    assert "meshlab.verify.compare" in found and "meshlab.parallel" in found
    # one fresh interpreter: each module imported, each name looked up
    code = ("import importlib, sys\n"
            f"found = {found!r}\n"
            "bad = []\n"
            "for module, names in sorted(found.items()):\n"
            "    try:\n"
            "        m = importlib.import_module(module)\n"
            "    except ImportError as e:\n"
            "        bad.append(f'{module}: {e}'); continue\n"
            "    bad += [f'{module}.{n}' for n in sorted(names) if not hasattr(m, n)\n"
            "            and importlib.util.find_spec(f'{module}.{n}') is None]\n"
            "print(bad); sys.exit(1 if bad else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr[-2000:]


def test_a_moved_module_imports_at_its_old_path_as_the_same_module() -> None:
    from meshlab.moved import MOVED

    code = ("import importlib, sys\n"
            "import meshlab.comms\n"  # the attribute path users write after it
            "from meshlab.parallel.verify import compare_with_single_process\n"
            "from meshlab.dry_run import dryrun\n"
            "from meshlab.checkpoint import save\n"
            f"moved = {MOVED!r}\n"
            "same = [importlib.import_module(o) is importlib.import_module(n)\n"
            "        and sys.modules[n].__spec__.name == n for o, n in moved.items()]\n"
            "print(meshlab.comms.start.__module__, all(same))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["meshlab.measure.comms", "True"], done.stdout + done.stderr


def test_meshlab_itself_imports_no_moved_path() -> None:
    from meshlab.moved import MOVED

    old = re.compile(r"(?<![\w.])(" + "|".join(re.escape(o) for o in MOVED) + r")(?![\w])")
    for path in [*(REPO / "meshlab").rglob("*.py"), *(REPO / "magics").rglob("*.py")]:
        if path.name == "moved.py":
            continue
        for node in ast.walk(_tree(path)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            stale = [n for n in names if old.fullmatch(n)]
            assert not stale, f"{path.relative_to(REPO)} imports {stale}: see meshlab.moved"


# -- which folder may import which, read off every import (lazy ones too) -------------------------

def _imports(path: Path) -> list[tuple[str, int]]:
    """The meshlab modules ``path`` imports, anywhere in it but under TYPE_CHECKING."""
    tree = _tree(path)
    typing_only = {id(k) for n in ast.walk(tree) if isinstance(n, ast.If)
                   and "TYPE_CHECKING" in ast.unparse(n.test)
                   for m in n.body for k in ast.walk(m)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
    return [(name, line) for name, line in found if name.startswith("meshlab.")]


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _reaches(imported: str, package: str) -> bool:
    return imported == package or imported.startswith(package + ".")


# (folder, what it may never import, why)
NEVER = [
    ("meshlab.parallel", ("meshlab.replicas", "meshlab.verify", "meshlab.dry_run"),
     "strategies sit below replica modes, the check and the dry run: reach them through "
     "meshlab.parallel.replica_modes"),
    ("meshlab.replicas", ("meshlab.dry_run",), "replica modes run on ranks, not fake ones"),
    ("meshlab.plan", ("meshlab.parallel", "meshlab.replicas", "meshlab.verify",
                      "meshlab.rank", "meshlab.checkpoint"),
     "the planner is pure Python: it reads a dry run's plain data, never runs strategies"),
    ("meshlab.measure", ("meshlab.rank", "meshlab.replicas", "meshlab.verify",
                         "meshlab.dry_run"), "what a rank measures sits below what it runs"),
    ("meshlab.rank", ("meshlab.parallel", "meshlab.replicas", "meshlab.verify",
                      "meshlab.dry_run", "meshlab.plan"),
     "an engine's machinery knows nothing of strategies"),
]
RANK_SIDE = [p for p in (REPO / "meshlab").rglob("*.py") if "notebook" not in p.parts]


def test_folders_import_only_what_they_may() -> None:
    for path in (REPO / "meshlab").rglob("*.py"):
        module = _module(path)
        for folder, forbidden, why in NEVER:
            if not _reaches(module, folder):
                continue
            bad = [(n, line) for n, line in _imports(path)
                   if any(_reaches(n, f) for f in forbidden)]
            assert not bad, f"{path.relative_to(REPO)} imports {bad}: {why}"


def test_the_rank_side_never_imports_the_notebook_side_even_lazily() -> None:
    notebook = ("meshlab.notebook", "meshlab.magics", "meshlab.extension")
    for path in RANK_SIDE:
        bad = [(n, line) for n, line in _imports(path) if any(_reaches(n, f) for f in notebook)]
        if _module(path) == "meshlab":  # load_ipython_extension: %load_ext's own entry
            bad = [(n, line) for n, line in bad if not _reaches(n, "meshlab.extension")]
        assert not bad, (f"{path.relative_to(REPO)} imports {bad}: ranks send data, the "
                         "notebook draws")


# Schedule.simulate() and .lower(): a schedule's own methods, importing their module when called
FACADES = {("meshlab.schedules.actions", "meshlab.schedules.simulate"),
           ("meshlab.schedules.actions", "meshlab.schedules.validate")}


def test_no_module_imports_itself_through_others() -> None:
    files = {_module(p): p for p in (REPO / "meshlab").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name, _ in _imports(path):
            while name and name not in files:  # `from pkg import name`: the module pkg
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + ".") \
                    and (module, name) not in FACADES:
                targets.add(name)
        graph[module] = targets
    # a depth-first walk; a module met again on the current path closes a circle
    state: dict[str, int] = {}
    path_now: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path_now.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                circle = [*path_now[path_now.index(n):], n]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if n not in state:
                visit(n)
        path_now.pop()
        state[m] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_no_source_file_is_over_400_lines() -> None:
    long = {str(p.relative_to(REPO)): n for folder in ("meshlab", "magics", "extension")
            for p in (REPO / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split by concern: {long}"


def test_every_folder_says_what_lives_there() -> None:
    for init in (REPO / "meshlab").rglob("__init__.py"):
        doc = ast.get_docstring(_tree(init))
        assert doc, f"{init.relative_to(REPO)}: one docstring line: what lives here, who imports it"
