"""`meshlab lab-settings`: the JupyterLab setting that saves widget state, installed where an
editable install cannot put it (the README's command 1 runs it; tests/tour/test_browser.py
then saves and reopens notebooks with it)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshlab.notebook import lab_settings
from meshlab.notebook.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_the_setting_is_the_one_the_wheel_installs() -> None:
    assert json.loads((REPO / "jupyter-config" / "meshlab.json").read_text()) == \
        lab_settings.SETTINGS


def test_it_goes_where_this_jupyterlab_reads_default_settings(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    from jupyterlab_server.settings_utils import _get_overrides

    monkeypatch.setenv("JUPYTERLAB_DIR", str(tmp_path / "lab"))
    assert main(["lab-settings"]) == 0
    overrides, error = _get_overrides(str(tmp_path / "lab" / "settings"))
    assert not error and overrides == lab_settings.SETTINGS
    assert os.stat(tmp_path / "lab/settings/overrides.d/meshlab.json").st_mode & 0o777 == 0o644


def test_a_second_run_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    path, changed = lab_settings.install(tmp_path)
    assert changed
    before = path.stat().st_mtime_ns
    assert main(["lab-settings", "--folder", str(tmp_path)]) == 0
    assert "already there" in capsys.readouterr().out and path.stat().st_mtime_ns == before


def test_a_link_in_its_place_is_replaced_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim.json"
    victim.write_text("{}")
    (tmp_path / "overrides.d").mkdir()
    (tmp_path / "overrides.d" / "meshlab.json").symlink_to(victim)
    path, changed = lab_settings.install(tmp_path / "overrides.d")
    assert changed and not path.is_symlink() and victim.read_text() == "{}"


def test_an_unwritable_folder_is_named_with_the_fix(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["lab-settings", "--folder", str(blocker / "overrides.d")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(blocker) in err and "--folder" in err and "Traceback" not in err


def test_the_plugin_goes_where_jupyterlab_finds_plugins(tmp_path: Path) -> None:
    from jupyterlab_server.config import get_federated_extensions

    assert main(["lab-settings", "--folder", str(tmp_path / "o"), "--plugins",
                 str(tmp_path / "labextensions")]) == 0
    found = get_federated_extensions([str(tmp_path / "labextensions")])
    plugin = found[lab_settings.PLUGIN_NAME]
    load = plugin["jupyterlab"]["_build"]["load"]  # the entry JupyterLab loads
    assert (Path(plugin["ext_path"]) / load).is_file()
    assert os.stat(Path(plugin["ext_path"]) / "package.json").st_mode & 0o777 == 0o644
    _, changed = lab_settings.install_plugin(tmp_path / "labextensions")
    assert not changed  # a second run changes nothing


def test_an_older_plugin_or_a_link_in_its_place_is_replaced_whole(tmp_path: Path) -> None:
    old = tmp_path / lab_settings.PLUGIN_NAME
    (old / "static").mkdir(parents=True)
    (old / "static" / "remoteEntry.old.js").write_text("old")
    path, changed = lab_settings.install_plugin(tmp_path)
    assert changed and not (path / "static" / "remoteEntry.old.js").exists()
    victim = tmp_path / "victim"
    victim.mkdir()
    os.rename(path, tmp_path / "moved")
    path.symlink_to(victim)
    path, changed = lab_settings.install_plugin(tmp_path)
    assert changed and not path.is_symlink() and list(victim.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meshlab-lab", "moved", "victim"]


def test_an_unwritable_plugins_folder_is_named_with_the_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as e:
        main(["lab-settings", "--folder", str(tmp_path / "o"), "--plugins",
              str(blocker / "labextensions")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert str(blocker) in err and "--plugins" in err and "Traceback" not in err


def test_the_shipped_plugin_is_built_from_its_sources() -> None:
    """labextension/build.sh records the sources it built from; an edit there without a
    rebuild would ship the old plugin."""
    import hashlib

    source = REPO / "labextension"
    recorded = dict(line.split()[::-1] for line in
                    (source / "built-from.sha256").read_text().splitlines())
    now = {name: hashlib.sha256((source / name).read_bytes()).hexdigest()
           for name in recorded}
    assert now == recorded, "labextension/ changed since its build: run labextension/build.sh"
    built = json.loads((lab_settings.PLUGIN / "package.json").read_text())
    assert (lab_settings.PLUGIN / built["jupyterlab"]["_build"]["load"]).is_file()
    assert sorted(recorded) == sorted(
        ["package.json", "package-lock.json",
         *(str(p.relative_to(source)) for p in (source / "src").glob("*.js")),
         *(str(p.relative_to(source)) for p in (source / "style").glob("*.css"))])
