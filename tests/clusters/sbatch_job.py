"""The training cell both Slurm tests run in the notebook, and its exported job submitted:
the job's printed losses must be the notebook's."""

from __future__ import annotations

import ast
import re
import subprocess
import time
from pathlib import Path
from typing import Any

TRAIN = """%%mesh
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank, train

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


# states a job ends in (COMPLETING is not one: its epilog runs, its output may be unwritten)
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
         "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def submit(job: Path, *sbatch_args: str) -> tuple[str, list[Any], str]:
    """Submit the job from its folder and wait for it to end: (job id, the losses it printed,
    its log). Polled every half second: ``sbatch --wait`` polls at 2, 10 and 42 s, so a job
    of 12 s took 42 s there."""
    done = subprocess.run(["sbatch", "--parsable", *sbatch_args, str(job)],
                          cwd=job.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"sbatch: {done.stderr}"
    job_id = done.stdout.strip().split(";")[0]
    deadline, state, shown = time.monotonic() + 600, "", ""
    while state not in ENDED:
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            raise AssertionError(f"job {job_id} did not end within 600 s: {shown}")
        time.sleep(0.5)
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                               text=True, timeout=30).stdout  # kept MinJobAge (60 s) after
        found = re.search(r"\bJobState=(\S+)", shown)
        state = found[1] if found else state
    out = job.parent / f"train-{job_id}.out"
    log = out.read_text() if out.exists() else "(no output file)"
    assert state == "COMPLETED" and re.search(r"\bExitCode=0:0\b", shown), \
        f"job {job_id} ended {state}: {shown}\n{log[-4000:]}"
    printed = [ast.literal_eval(line.removeprefix("losses ")) for line in log.splitlines()
               if line.startswith("losses ")]
    return job_id, printed, log
