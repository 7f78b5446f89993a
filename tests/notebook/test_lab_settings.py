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
