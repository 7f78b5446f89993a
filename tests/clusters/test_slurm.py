"""Real Slurm: the exported job.sbatch reproduces the session, and a cluster on Slurm engines.

They need the single-node Slurm that `tests/machine/up.sh` installs and starts (the README's
command 2 runs it); without it they skip, naming it (tests/conftest.py).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from IPython.utils.capture import capture_output
from sbatch_job import TRAIN, submit

from meshlab.notebook.export import Journal

pytestmark = pytest.mark.slurm

@pytest.mark.cluster
def test_the_exported_sbatch_job_reproduces_the_sessions_losses(
        shell: Any, tmp_path: Path) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    session.journal = Journal(4, session.cluster.backend)
    for cell in ["%mesh init dp=4", TRAIN, f"%mesh export {tmp_path / 'train.py'} --sbatch"]:
        assert shell.run_cell(cell, store_history=True).success, cell
    interactive = shell.run_line_magic("mesh", "pull losses")[0]
    job = tmp_path / "job.sbatch"
    assert "#SBATCH --nodes=1" in job.read_text()
    _, printed, log = submit(job)
    assert printed == [interactive], log[-4000:]


@pytest.mark.cluster
def test_mesh_start_with_the_slurm_profile_runs_a_collective(shell: Any) -> None:
    session = shell.magics_manager.registry["MeshMagics"].session
    shared, journal = session.cluster, session.journal
    session.cluster = None  # the session's local cluster steps aside, untouched
    try:
        with capture_output() as cap:
            shell.run_line_magic("mesh", "start 2 --profile slurm")
        assert "2 ranks ready" in cap.stdout and "profile slurm" in cap.stdout
        assert shell.run_cell("%%mesh -o reduced\nimport os\nx = torch.ones(1) * (rank + 1)\n"
                              "dist.all_reduce(x)\nx.item(), os.environ['SLURM_JOB_ID']").success
        values = shell.user_ns["reduced"]
        assert sorted(values) == [0, 1]
        assert {v[0] for v in values.values()} == {3.0}  # 1 + 2, across the two engines
        job = {v[1] for v in values.values()}
        assert len(job) == 1  # both engines are tasks of one Slurm job
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True)
        assert job <= set(queue.stdout.split())
        shell.run_line_magic("mesh", "stop")
    finally:
        if session.cluster is not None:
            session.cluster.stop()
        session.cluster, session.journal = shared, journal
