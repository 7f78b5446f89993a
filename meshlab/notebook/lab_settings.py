"""``meshlab lab-settings``: the JupyterLab default setting that saves widget state with a
notebook, so a notebook saved and reopened draws meshlab's widgets again, and meshlab's
JupyterLab plugin (``labextension/``: such a notebook is not marked modified by reopening it).

JupyterLab reads default settings from ``<app dir>/settings/overrides.d/*.json`` (the app dir
is ``{sys.prefix}/share/jupyter/lab`` unless ``JUPYTERLAB_DIR`` says otherwise) and prebuilt
plugins from ``{sys.prefix}/share/jupyter/labextensions/<name>``. A wheel puts both there
(pyproject's data-files); an editable install cannot, as setuptools skips data files there, so
the README's set-up runs this command instead.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

# the same as jupyter-config/meshlab.json, which the wheel installs (a test holds them equal)
SETTINGS = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True}}
FILE_NAME = "meshlab.json"
PLUGIN = Path(__file__).parents[1] / "labextension"
"""The plugin as built (``labextension/build.sh``), shipped inside the package."""
PLUGIN_NAME = "meshlab-lab"


def overrides_folder() -> Path:
    """Where this environment's JupyterLab reads default-setting overrides."""
    from jupyterlab.commands import get_app_dir

    return Path(get_app_dir()) / "settings" / "overrides.d"


def install(folder: Path | None = None) -> tuple[Path, bool]:
    """Write the setting into ``folder`` (default: this JupyterLab's); (its path, whether it
    changed anything). Written whole, then renamed into place, never through a link."""
    path = (folder or overrides_folder()) / FILE_NAME
    try:
        if json.loads(path.read_text()) == SETTINGS and not path.is_symlink():
            return path, False
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".meshlab-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(SETTINGS, f, indent=2)
            f.write("\n")
        os.chmod(tmp, 0o644)  # JupyterLab may run as another user on a shared install
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path, True


def plugins_folder() -> Path:
    """Where this environment's JupyterLab finds prebuilt plugins (a wheel puts meshlab's
    there too)."""
    return Path(sys.prefix) / "share" / "jupyter" / "labextensions"


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def install_plugin(folder: Path | None = None) -> tuple[Path, bool]:
    """Copy the built plugin into ``folder`` (default: this environment's plugins folder);
    (its path, whether it changed anything). Copied whole beside it, then renamed into place:
    JupyterLab never reads half a plugin, and a link in its place is replaced, not followed."""
    path = (folder or plugins_folder()) / PLUGIN_NAME
    if not path.is_symlink() and path.is_dir() and _files(path) == _files(PLUGIN):
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{PLUGIN_NAME}-"))
    old = new.with_name(new.name + "-old")
    try:
        shutil.copytree(PLUGIN, new, dirs_exist_ok=True)
        for p in [new, *new.rglob("*")]:
            os.chmod(p, 0o755 if p.is_dir() else 0o644)  # a shared install: others read it
        if path.is_symlink() or path.exists():
            os.rename(path, old)
        try:
            os.rename(new, path)
        except OSError:
            if old.is_symlink() or old.exists():
                os.rename(old, path)  # the plugin as it was, rather than none
            raise
    finally:
        shutil.rmtree(new, ignore_errors=True)
        if old.is_symlink():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
    return path, True


def add_command(commands: Any) -> None:
    """``meshlab lab-settings``"""
    cmd = commands.add_parser(
        "lab-settings", help="make JupyterLab save meshlab's widgets with a notebook",
        description="Install the JupyterLab default setting that saves widget state with a "
                    "notebook, and meshlab's JupyterLab plugin, which keeps a notebook "
                    "reopened untouched from reading as modified (a wheel installs both; an "
                    "editable install needs this).")
    cmd.add_argument("--folder", type=Path,
                     help="the overrides.d folder to write to (default: this environment's "
                          "JupyterLab's)")
    cmd.add_argument("--plugins", type=Path,
                     help="the labextensions folder to put the plugin in (default: "
                          "{sys.prefix}/share/jupyter/labextensions)")
    cmd.set_defaults(run=run_command)


def run_command(args: Any, parser: Any) -> int:
    for put, folder, fix, done in (
            (install, args.folder, "pass --folder DIR, or set JUPYTERLAB_DIR to a JupyterLab "
             "app folder you can write", "JupyterLab saves widget state with notebooks; "
             "restart a running JupyterLab to pick it up"),
            (install_plugin, args.plugins, "pass --plugins DIR, a labextensions folder "
             "JupyterLab reads (see `jupyter --paths`) that you can write",
             "meshlab's JupyterLab plugin: a notebook reopened untouched is not marked "
             "modified")):
        try:
            path, changed = put(folder)
        except OSError as e:
            parser.exit(2, f"meshlab lab-settings: cannot write {e.filename or folder}: "
                           f"{e.strerror or e}; {fix}\n")
        print(f"{'wrote' if changed else 'already there'}: {path} ({done})")
    return 0
