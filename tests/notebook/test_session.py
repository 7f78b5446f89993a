"""meshlab.Session from a plain Python program: everything the magics do, without IPython."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshlab.notebook.session import Session, SessionError

# A whole session, run by a plain interpreter (no IPython shell, no magics): start, init, run,
# schedule, pipeline, step, checkpoint, restart (which binds and steps the pipeline again),
# export. It prints what the test checks.
PROGRAM = """
import sys
from pathlib import Path
import meshlab
from IPython import get_ipython

out = Path(sys.argv[2])
with meshlab.Session(4, profile=sys.argv[1]) as s:
    s.init("pp=2 dp=2")
    s.run('''
from meshlab.models import ModelConfig, Transformer, global_batch
from meshlab.models.llama import loss_fn
cfg = ModelConfig(n_layers=4)
model = Transformer(cfg).double()
batch = global_batch(step=0, batch=8, seq=16, vocab=cfg.vocab_size)
reference_loss = loss_fn(Transformer(cfg).double()(batch[0]), batch[1]).item()
step = 0
''')
    schedules, table, frame = s.schedule(["1f1b", "gpipe"], stages=2, microbatches=4)
    print("schedules", list(table.index))
    s.pipeline("model", "1f1b", microbatches=4)
    s.step(3)
    s.step(None)
    print("loss", s.bound_pipeline.loss, "reference", s.pull("reference_loss")[0])
    print(s.checkpoint("save", out / "ckpt", ["step"]))
    s.run("step += 1")
    s.restart(progress=lambda line: print("restart:", line))
    print("after restart step", s.pull("step")[0], "loss", s.bound_pipeline and
          s.bound_pipeline.loss)
    written = s.export(out / "train.py", sbatch=True)
    print("wrote", sorted(p.name for p in written))
    print("shell", get_ipython(), "magics", "meshlab.magics" in sys.modules)
    print(s.stop())
"""


@pytest.mark.cluster
def test_a_whole_session_runs_from_plain_python(test_profile: Path, tmp_path: Path) -> None:
    program = tmp_path / "session.py"
    program.write_text(textwrap.dedent(PROGRAM))
    done = subprocess.run([sys.executable, str(program), str(test_profile), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "schedules ['1f1b', 'gpipe']" in out
    loss, reference = (float(w) for w in out.split("loss ")[1].split()[:3:2])
    assert loss == pytest.approx(reference, abs=1e-6)  # float64: the same sums in another order
    assert "saved step to" in out and (tmp_path / "ckpt" / "meshlab.json").exists()
    # the restart replays the cells (step ends at 1 again), binds and steps the pipeline again
    assert "after restart step 1 loss" in out
    restored_loss = float(out.split("after restart step 1 loss ")[1].split()[0])
    assert restored_loss == pytest.approx(loss, abs=1e-12)
    assert "In [" in out and "%mesh pipeline model" in out and "%mesh step" in out
    assert "wrote ['job.sbatch', 'launch.sh', 'train.py']" in out
    script = (tmp_path / "train.py").read_text()
    assert "bind(model, mesh," in script and "step += 1" in script
    assert "shell None magics False" in out
    assert re.search(r"stopped 4 ranks and their controller in \d+\.\d s", out)


def test_a_session_without_a_cluster_says_how_to_start_one() -> None:
    s = Session()
    for call in (lambda: s.run("1"), lambda: s.init("dp=2"), lambda: s.status(),
                 lambda: s.export("train.py"), lambda: s.step(1)):
        with pytest.raises(SessionError, match=r"no cluster is running: %mesh start N|no "
                                               r"pipeline is bound"):
            call()


def test_planning_and_schedules_need_no_cluster() -> None:
    s = Session()
    schedules, table, _ = s.schedule(["gpipe"], stages=2, microbatches=2)
    assert schedules[0].name == "gpipe" and table.index[0] == "gpipe"
    with pytest.raises(SessionError, match="how many GPUs"):
        s.plan("llama3-8b")
    assert s.plan("llama3-8b", gpus=8, top=1).best.layout.gpus == 8
