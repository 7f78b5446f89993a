"""The wheel works without the repository: `python -m build` on a clean copy of the checkout,
the wheel's file list (every package, the widget's JS/CSS, the cluster profiles, py.typed, the
JupyterLab settings override), then the wheel alone in a fresh venv running the quickstart
notebook from a folder outside the repository, in a kernel and on ranks that import meshlab
from the wheel (the repository is installed editable here: its finder must not answer).

Shares nothing with the other tests; marked `wheel` (it builds one) and `cluster` (the
notebook starts engines, in a subprocess)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.wheel

REPO = Path(__file__).resolve().parents[1]
# Source folder -> where its files go in the wheel ([tool.setuptools.package-dir]).
INSTALLED_AS = {"meshlab": "meshlab", "magics": "meshlab/magics",
                "extension": "meshlab/extension", "clusters": "meshlab/clusters"}
OVERRIDES = "share/jupyter/lab/settings/overrides.d/meshlab.json"
CHECK = "WHEEL-CHECK"  # marks the lines the cells added to the quickstart print


def _run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
         cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}"
    return done


def _checkout_copy(dest: Path) -> Path:
    """The files git would commit (tracked, plus new ones not ignored) copied to ``dest``:
    nothing the checkout built or installed (egg-info, build/, caches) goes in, and the build
    writes nothing into the repository."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("builds the wheel from a git checkout")
    listed = _run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                   "--exclude-standard"], timeout=60).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the source copy, the wheel). The sdist is built first and the wheel from it, as
    `python -m build` does; --no-isolation builds with this environment's setuptools instead
    of downloading one."""
    source = _checkout_copy(tmp_path_factory.mktemp("checkout"))
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)],
         timeout=300)
    (wheel,) = dist.glob("meshlab-*-py3-none-any.whl")
    return source, wheel


def test_the_wheel_holds_every_package_and_data_file(built: tuple[Path, Path]) -> None:
    source, wheel = built
    names = set(zipfile.ZipFile(wheel).namelist())
    version = wheel.name.split("-")[1]

    # every file of every package folder, .py or not, found on disk (not from a list)
    expected = {
        f"{INSTALLED_AS[folder]}/{path.relative_to(source / folder).as_posix()}"
        for folder in INSTALLED_AS
        for path in (source / folder).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    missing = sorted(expected - names)
    assert not missing, ("missing from the wheel (add to [tool.setuptools] packages or "
                         f"package-data): {missing}")
    for name in ["meshlab/py.typed", "meshlab/notebook/widgets/sharding.js",
                 "meshlab/notebook/widgets/sharding.css", "meshlab/clusters/local.toml",
                 "meshlab/clusters/slurm.toml", "meshlab/clusters/ssh.toml",
                 "meshlab/clusters/mpi.toml", "meshlab/magics/__init__.py",
                 "meshlab/extension/__init__.py"]:
        assert name in names, name
    packages = {n.removesuffix("/__init__.py") for n in names if n.endswith("/__init__.py")}
    on_disk = {f"{INSTALLED_AS[folder]}/{p.parent.relative_to(source / folder).as_posix()}"
               .removesuffix("/.") for folder in INSTALLED_AS
               for p in (source / folder).rglob("__init__.py")}
    assert on_disk <= packages, sorted(on_disk - packages)
    assert {"meshlab/notebook/export", "meshlab/plan", "meshlab/calibrate"} <= packages

    # the JupyterLab override lands at {prefix}/share/...; nothing else outside meshlab/
    data = f"meshlab-{version}.data/data/{OVERRIDES}"
    assert data in names
    settings = json.loads(zipfile.ZipFile(wheel).read(data))
    assert settings["@jupyter-widgets/jupyterlab-manager:plugin"]["saveState"] is True
    # and meshlab's JupyterLab plugin at {prefix}/share/jupyter/labextensions/meshlab-lab,
    # with the entry its package.json names
    plugin = f"meshlab-{version}.data/data/share/jupyter/labextensions/meshlab-lab"
    built = json.loads(zipfile.ZipFile(wheel).read(f"{plugin}/package.json"))
    assert f"{plugin}/{built['jupyterlab']['_build']['load']}" in names
    tops = {n.split("/")[0] for n in names}
    assert tops == {"meshlab", f"meshlab-{version}.dist-info", f"meshlab-{version}.data"}, tops
    entry_points = zipfile.ZipFile(wheel).read(
        f"meshlab-{version}.dist-info/entry_points.txt").decode()
    assert "meshlab = meshlab.notebook.cli:main" in entry_points


@pytest.fixture(scope="module")
def venv(built: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Path, dict[str, str]]]:
    """A fresh venv holding the wheel's meshlab, and the environment to run it in. The heavy
    dependencies (torch, jupyter, ipyparallel) come from *this* environment's site-packages,
    listed in a .pth file: ``--system-site-packages`` would give the base interpreter's instead,
    which in a user's venv has none of them. meshlab itself is the wheel's (installed into the
    venv, whose site-packages come first); the .pth adds folders only, so this environment's
    editable finder (a .pth of its own there) is never run."""
    _, wheel = built
    root = tmp_path_factory.mktemp("venv") / "venv"
    # --without-pip: pip (and setuptools) come from this environment, not ensurepip's older
    # copies, and the venv is ready in a fraction of a second
    _run([sys.executable, "-m", "venv", "--without-pip", str(root)], timeout=120)
    python = root / "bin" / "python"
    ours = [p for p in sys.path if Path(p).name in {"site-packages", "dist-packages"}]
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                timeout=60).stdout.strip()
    Path(site, "this-environment.pth").write_text("".join(f"{p}\n" for p in ours))
    env = {k: v for k, v in os.environ.items()
           if k not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JUPYTER_PATH"}}
    env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(root)
    # nbconvert's templates and ipykernel's kernelspec are data files of this environment,
    # which a venv's jupyter does not look in (its prefix is the venv's)
    from jupyter_core.paths import jupyter_path

    env["JUPYTER_PATH"] = os.pathsep.join(jupyter_path())
    _run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall",
          "--no-index", "--disable-pip-version-check", "-q", str(wheel)], timeout=300, env=env)
    yield root, env


@pytest.mark.cluster  # the notebook starts 4 engines, in the nbconvert subprocess
def test_the_quickstart_runs_from_the_installed_wheel(venv: tuple[Path, dict[str, str]],
                                                      tmp_path: Path) -> None:
    root, env = venv
    python = str(root / "bin" / "python")
    site = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                timeout=60, env=env, cwd=tmp_path).stdout.strip()
    installed = str(Path(site, "meshlab"))

    # the override sits where this venv's JupyterLab reads default settings from
    assert (root / OVERRIDES).is_file()
    code = ("import json, os; from jupyterlab.commands import get_app_dir; "
            "from jupyterlab_server.settings_utils import _get_overrides; "
            "print(json.dumps(_get_overrides(os.path.join(get_app_dir(), 'settings'))[0]))")
    overrides = json.loads(_run([python, "-c", code], timeout=120, env=env,
                                cwd=tmp_path).stdout)
    assert overrides["@jupyter-widgets/jupyterlab-manager:plugin"] == {"saveState": True}
    _run([str(root / "bin" / "meshlab"), "--help"], timeout=120, env=env, cwd=tmp_path)

    # the quickstart, copied out of the repository, with two cells after `%mesh start`:
    # where the kernel and the ranks import meshlab from, and the data files they find
    nb = nbformat.read(REPO / "notebooks" / "01-quickstart.ipynb", as_version=4)
    start = next(i for i, c in enumerate(nb.cells) if c.source.startswith("%mesh start"))
    nb.cells[start + 1:start + 1] = [
        nbformat.v4.new_code_cell(
            "import sys\nimport meshlab\nfrom meshlab.notebook import profiles\n"
            "from meshlab.notebook.widgets.sharding import ShardingView\n"
            f"print('{CHECK} kernel', sys.executable)\n"
            f"print('{CHECK} meshlab', meshlab.__file__)\n"
            f"print('{CHECK} profiles', *sorted(profiles.available().values()))\n"
            f"print('{CHECK} widget', len(str(ShardingView._esm)), len(str(ShardingView._css)))"),
        nbformat.v4.new_code_cell(
            "%%mesh\nimport sys\nimport meshlab\n"
            f"print('{CHECK} rank', sys.executable, meshlab.__file__)"),
    ]
    nbformat.write(nb, tmp_path / "01-quickstart.ipynb")
    done = _run([python, "-m", "nbconvert", "--execute", "--to", "markdown", "--stdout",
                 "01-quickstart.ipynb"], timeout=240, env=env, cwd=tmp_path)
    shown = done.stdout

    checks = dict(re.findall(rf"^\s*(?:\[ranks 0-3\] )?{CHECK} (\w+) (.*)$", shown, re.M))
    assert checks.keys() == {"kernel", "meshlab", "profiles", "widget", "rank"}, shown
    assert checks["kernel"] == python, "the kernel is not the venv's Python"
    assert checks["meshlab"] == f"{installed}/__init__.py", "the kernel's meshlab is elsewhere"
    assert checks["rank"] == f"{python} {installed}/__init__.py", \
        "the ranks' meshlab is not the wheel's (or a rank printed something else)"
    assert checks["profiles"].split() == [f"{installed}/clusters/{name}.toml"
                                          for name in ["local", "mpi", "ray", "slurm", "ssh"]]
    assert all(int(n) > 100 for n in checks["widget"].split()), checks["widget"]

    assert "4 ranks ready" in shown
    assert "[ranks 0-3] tensor([10., 10., 10., 10.])" in shown
    assert "[rank 1] ValueError: rank 1 got a bad batch" in shown
    assert "stopped 4 ranks" in shown
