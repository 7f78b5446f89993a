"""Step time and tokens/s of each parallel strategy on one CPU cluster, beside plain DDP.

Every strategy trains the same model on the same global batch (8 x 64 tokens) in the same
cluster, one after another; the median of the timed steps is reported. On CPU ranks these
figures say what the strategies cost in communication and bookkeeping, not GPU speed.

$ python benchmarks/strategies.py               # 4 ranks, 10 timed steps each
"""

from __future__ import annotations

import argparse

from meshlab import Cluster

STRATEGIES = [  # (name, mesh, plan, model config)
    ("DDP", "dp=4", "data_parallel='ddp'", ""),
    ("ZeRO-1", "dp=4", "data_parallel='zero1'", ""),
    ("ZeRO-2 (FSDP2)", "dp=4", "data_parallel='zero2'", ""),
    ("ZeRO-3 (FSDP2)", "dp=4", "data_parallel='zero3'", ""),
    ("HSDP 2x2", "dp_replicate=2 dp=2", "data_parallel='zero3'", ""),
    ("TP2 x DP2", "dp=2 tp=2", "data_parallel='zero3', sequence_parallel=False", ""),
    ("TP2+SP x DP2", "dp=2 tp=2", "data_parallel='zero3'", ""),
    ("PP2 x DP2 (1F1B)", "pp=2 dp=2", "data_parallel='zero3', microbatches=2", ""),
    ("CP2 x DP2", "dp=2 cp=2", "data_parallel='zero3', seq_len=64", ""),
    ("EP4 (MoE)", "dp=4 ep=4", "data_parallel='none'", "n_experts=4"),
    ("DDP (MoE)", "dp=4", "data_parallel='ddp'", "n_experts=4"),
]

CELL = """
import time, statistics
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, parallelize, build_optimizer
from meshlab.mesh import axis_size
from meshlab.parallel.pipeline import split_stage, build_schedule, pipeline_step
from meshlab.parallel.context import sequence_slice
from meshlab.parallel.verify import data_rank
cfg = ModelConfig(max_seq_len=64, {model})
plan = ParallelPlan({plan})
r, n = data_rank(mesh)
pp = axis_size(mesh, "pp") > 1
model = Transformer(cfg)
model = parallelize(split_stage(model, mesh) if pp else model, mesh, plan)
opt = build_optimizer(model, mesh, plan)
sched = build_schedule(model, mesh, microbatches=2, loss_fn=loss_fn) if pp else None
times = []
for step in range({steps} + 2):
    x, y = local_batch(step=step, batch=8, seq=64, vocab=256, rank=r, ranks=n)
    if axis_size(mesh, "cp") > 1:
        x, y = sequence_slice(x, mesh), sequence_slice(y, mesh)
    dist.barrier()
    start = time.perf_counter()
    opt.zero_grad()
    if pp:
        pipeline_step(sched, mesh, x, y)
    else:
        loss_fn(model(x), y).backward()
    opt.step()
    dist.barrier()
    times.append(time.perf_counter() - start)
statistics.median(times[2:])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    tokens = 8 * 64
    rows = []
    with Cluster(4) as cluster:
        for name, spec, plan, model in STRATEGIES:
            cluster.init_mesh(spec)
            result = cluster.run(CELL.format(plan=plan, model=model, steps=args.steps),
                                 keep_values=True, timeout=600)
            rows.append((name, spec, max(result.values.values())))
    base = {"": rows[0][2], "MoE": rows[-1][2]}
    print(f"{'strategy':<18} {'mesh':<20} {'step ms':>8} {'tokens/s':>9} {'time/DDP':>9}")
    for name, spec, seconds in rows:
        ref = base["MoE"] if "MoE" in name else base[""]
        print(f"{name:<18} {spec:<20} {seconds * 1e3:>8.1f} {tokens / seconds:>9.0f} "
              f"{seconds / ref:>9.2f}")


if __name__ == "__main__":
    main()
