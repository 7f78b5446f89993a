"""The README's set-up is what CI runs, and a machine without the system pieces says so.

CI (.ci/run) reads the README's two commands and runs them as written in a brand-new venv;
tests that need Slurm, the test hosts or Chromium skip without them, naming the command that
brings them up, in the run's last line, and fail instead under MESHLAB_REQUIRE_MACHINE=1."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    spec = importlib.util.spec_from_file_location("readme_commands",
                                                  ROOT / ".ci" / "readme_commands.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.setup_commands((ROOT / "README.md").read_text()))


def test_the_readme_set_up_is_two_commands_that_bring_up_everything_the_tests_need() -> None:
    install, tests = readme_commands()
    assert install.startswith("pip install torch==2.13.0 -e . &&")
    assert "meshlab lab-settings" in install  # widgets saved with the notebook
    assert "01-quickstart.ipynb" in install
    assert tests.startswith('pip install torch==2.13.0 -e ".[test]" &&')
    assert "tests/machine/up.sh" in tests and tests.endswith("python -m pytest -q")
    assert os.access(ROOT / "tests" / "machine" / "up.sh", os.X_OK)


def test_ci_runs_the_readme_in_a_new_venv_and_takes_no_step_of_its_own() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py README.md" in ci and "MESHLAB_REQUIRE_MACHINE=1" in ci
    code = [line.split("#")[0] for line in ci.splitlines()]
    assert not any("--system-site-packages" in line or "apt-get" in line or "up.sh" in line
                   for line in code)
    # the one pip install of its own is the oldest versions', in a venv over the new one
    installs = [line for line in code if "pip install" in line]
    assert installs == ['"$oldest/bin/python" -m pip install -q -r .ci/oldest.txt'], installs


def _slurm_test_without_slurm(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """One Slurm test, on a PATH where no Slurm command can be found."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
         "tests/clusters/test_slurm.py::test_mesh_start_with_the_slurm_profile_runs_a_collective"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PATH": str(tmp_path), "MESHLAB_REQUIRE_MACHINE": "", **env})


def test_a_missing_piece_skips_naming_the_command_in_the_last_line(tmp_path: Path) -> None:
    done = _slurm_test_without_slurm(tmp_path)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and "1 skipped" in lines[-2], done.stdout
    assert lines[-1].startswith("1 test skipped: Slurm is not up (1)"), lines[-1]
    assert "tests/machine/up.sh" in lines[-1]


def test_ci_turns_that_skip_into_a_failure(tmp_path: Path) -> None:
    done = _slurm_test_without_slurm(tmp_path, MESHLAB_REQUIRE_MACHINE="1")
    assert done.returncode == 1 and "1 error" in done.stdout, done.stdout  # in its setup
    assert "Slurm is not up: run tests/machine/up.sh (as root); MESHLAB_REQUIRE_MACHINE=1 " \
           "refuses to skip it" in done.stdout
