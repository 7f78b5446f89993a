"""The training cell both Slurm tests run in the notebook, and its exported job submitted:
the job's printed losses must be the notebook's."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path
from typing import Any

TRAIN = """%%mesh
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.parallel.verify import data_rank, train

torch.manual_seed(0)
cfg = ModelConfig()
plan = ParallelPlan(data_parallel="zero2")
model = parallelize(Transformer(cfg), mesh, plan)
optimizer = build_optimizer(model, mesh, plan, lr=0.01)
dp_rank, dp_ranks = data_rank(mesh)
batches = [local_batch(step=s, batch=8, seq=16, vocab=cfg.vocab_size, rank=dp_rank,
                       ranks=dp_ranks) for s in range(3)]
losses = train(model, optimizer, batches, average_over=mesh["dp"].get_group())
if rank == 0:
    print("losses", losses)
"""


def submit(job: Path, *sbatch_args: str) -> tuple[str, list[Any], str]:
    """``sbatch --wait`` the job from its folder: (job id, the losses it printed, its log)."""
    done = subprocess.run(["sbatch", "--wait", "--parsable", *sbatch_args, str(job)],
                          cwd=job.parent, capture_output=True, text=True, timeout=600)
    job_id = done.stdout.strip().split(";")[0]
    out = job.parent / f"train-{job_id}.out"
    log = out.read_text() if out.exists() else "(no output file)"
    assert done.returncode == 0, f"sbatch: {done.stderr}\n{log[-4000:]}"
    printed = [ast.literal_eval(line.removeprefix("losses ")) for line in log.splitlines()
               if line.startswith("losses ")]
    return job_id, printed, log
