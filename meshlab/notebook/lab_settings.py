"""``meshlab lab-settings``: the JupyterLab default setting that saves widget state with a
notebook, so a notebook saved and reopened draws meshlab's widgets again.

JupyterLab reads default settings from ``<app dir>/settings/overrides.d/*.json`` (the app dir
is ``{sys.prefix}/share/jupyter/lab`` unless ``JUPYTERLAB_DIR`` says otherwise). A wheel puts
``jupyter-config/meshlab.json`` there (pyproject's data-files); an editable install cannot,
as setuptools skips data files there, so the README's set-up runs this command instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

# the same as jupyter-config/meshlab.json, which the wheel installs (a test holds them equal)
SETTINGS = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True}}
FILE_NAME = "meshlab.json"


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


def add_command(commands: Any) -> None:
    """``meshlab lab-settings``"""
    cmd = commands.add_parser(
        "lab-settings", help="make JupyterLab save meshlab's widgets with a notebook",
        description="Install the JupyterLab default setting that saves widget state with a "
                    "notebook (a wheel installs it; an editable install needs this).")
    cmd.add_argument("--folder", type=Path,
                     help="the overrides.d folder to write to (default: this environment's "
                          "JupyterLab's)")
    cmd.set_defaults(run=run_command)


def run_command(args: Any, parser: Any) -> int:
    try:
        path, changed = install(args.folder)
    except OSError as e:
        parser.exit(2, f"meshlab lab-settings: cannot write {e.filename or args.folder}: "
                       f"{e.strerror or e}; pass --folder DIR, or set JUPYTERLAB_DIR to a "
                       "JupyterLab app folder you can write\n")
    print(f"{'wrote' if changed else 'already there'}: {path} (JupyterLab saves widget "
          "state with notebooks; restart a running JupyterLab to pick it up)")
    return 0
