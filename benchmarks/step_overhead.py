"""One training step inside a %%mesh cell beside the same step in the exported torchrun script.

The session (a DDP or ZeRO-3 step of the reference transformer on 4 CPU ranks) is recorded in
a meshlab Journal and written by meshlab.notebook.export, as `%mesh export` does; the script
runs under `torchrun --standalone`. Both time each step on the ranks (barrier, step, barrier)
and rounds alternate between the two, so both see the same machine. Printed: the median step
in each, their ratio (goal <= 1.03), and what a notebook user pays on top when every step is
its own %%mesh cell (the round trip to the ranks).

$ python benchmarks/step_overhead.py                  # dp=4, DDP, 3 rounds of 20 steps
$ python benchmarks/step_overhead.py --mesh "dp=2 tp=2" --strategy zero3
"""

from __future__ import annotations

import argparse
import ast
import statistics
import subprocess
import tempfile
from pathlib import Path

from meshlab import Cluster
from meshlab.measure.timing import step_times
from meshlab.mesh import MeshSpec
from meshlab.notebook.export import Journal, export

SETUP = """
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank
from meshlab.models.llama import loss_fn

torch.manual_seed(0)
cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384, max_seq_len=64)
plan = ParallelPlan(data_parallel={strategy!r}, seq_len=64)
model = parallelize(Transformer(cfg), mesh, plan)
optimizer = build_optimizer(model, mesh, plan, lr=1e-3)
dp_rank, dp_ranks = data_rank(mesh)
inputs, targets = local_batch(step=0, batch=8, seq=64, vocab=cfg.vocab_size, rank=dp_rank,
                              ranks=dp_ranks)

def train_step():
    optimizer.zero_grad()
    loss_fn(model(inputs), targets).backward()
    optimizer.step()
"""

TIMED = """
from meshlab.measure.timing import step_times
# every rank starts each step together; a step ends when the slowest rank is done
times = step_times(train_step, {steps}, warmup=2, before=dist.barrier, after=dist.barrier)
if rank == 0:
    print("times", times)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default="dp=4")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    spec = MeshSpec.parse(args.mesh)
    setup, timed = SETUP.format(strategy=args.strategy), TIMED.format(steps=args.steps)
    folder = Path(tempfile.mkdtemp(prefix="meshlab-step-"))
    cell: list[float] = []
    script: list[float] = []
    per_cell: list[float] = []
    with Cluster(spec.size) as cluster:
        cluster.init_mesh(spec)
        cluster.run(setup)
        journal = Journal(cluster.world_size, cluster.backend, source="step_overhead.py")
        journal.record_mesh(spec, 1)
        journal.record_cell(setup, 2)
        journal.record_cell(timed, 3)
        export(journal, folder / "train.py")
        for _ in range(args.rounds):
            values = cluster.run(timed + "times", keep_values=True).values
            cell += values[0]
            done = subprocess.run(["bash", str(folder / "launch.sh")], capture_output=True,
                                  text=True, check=True)
            script += next(ast.literal_eval(line.removeprefix("times "))
                           for line in done.stdout.splitlines() if line.startswith("times "))
            # one cell per step, timed from the notebook side
            per_cell += step_times(lambda: cluster.run("train_step()"), args.steps)
    ms = {name: 1e3 * statistics.median(t) for name, t in
          [("cell", cell), ("script", script), ("per_cell", per_cell)]}
    print(f"{args.strategy} on {spec} ({spec.size} CPU ranks), {args.rounds} x {args.steps} "
          "steps each, medians")
    print(f"  step inside one %%mesh cell     {ms['cell']:8.2f} ms")
    print(f"  step inside the exported script {ms['script']:8.2f} ms")
    print(f"  ratio cell / script             {ms['cell'] / ms['script']:8.3f}   (goal <= 1.03)")
    print(f"  one %%mesh cell per step        {ms['per_cell']:8.2f} ms   "
          f"({ms['per_cell'] - ms['cell']:.1f} ms of round trip to the ranks)")


if __name__ == "__main__":
    main()
