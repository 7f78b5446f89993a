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
    ("DDP, accum 2", "dp=4", "data_parallel='ddp', grad_accum=2", ""),
    ("ZeRO-3, accum 2", "dp=4", "data_parallel='zero3', grad_accum=2", ""),
    ("ZeRO-3, offload params", "dp=4", "data_parallel='zero3', offload_params=True", ""),
    ("ZeRO-3, offload activations", "dp=4", "data_parallel='zero3', offload_activations=True",
     ""),
    ("HSDP 2x2", "dp_replicate=2 dp=2", "data_parallel='zero3'", ""),
    ("local SGD 2x2, H=4", "dp_replicate=2 dp=2",
     "data_parallel='zero3', replica_sync='local_sgd', sync_every=4", ""),
    ("DiLoCo 2x2, H=4", "dp_replicate=2 dp=2",
     "data_parallel='zero3', replica_sync='diloco', sync_every=4", ""),
    ("TP2 x DP2", "dp=2 tp=2", "data_parallel='zero3', sequence_parallel=False", ""),
    ("TP2+SP x DP2", "dp=2 tp=2", "data_parallel='zero3'", ""),
    ("PP2 x DP2 (1F1B)", "pp=2 dp=2", "data_parallel='zero3', microbatches=2", ""),
    ("CP2 x DP2", "dp=2 cp=2", "data_parallel='zero3', seq_len=64", ""),
    ("EP4 (MoE)", "dp=4 ep=4", "data_parallel='none'", "n_experts=4"),
    ("DDP (MoE)", "dp=4", "data_parallel='ddp'", "n_experts=4"),
]

# One training step of the reference transformer under a plan, timed on every rank; the
# cell's value is the median step. The batches are made before the clock starts.
CELL = """
import statistics
from meshlab.mesh import axis_size
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.parallel.accumulate import micro_batches
from meshlab.parallel.context import sequence_slice
from meshlab.verify.compare import data_rank
from meshlab.measure.timing import step_times
cfg = ModelConfig({model})
plan = ParallelPlan({plan})
r, n = data_rank(mesh)
pp, cp = axis_size(mesh, "pp") > 1, axis_size(mesh, "cp") > 1
model = Transformer(cfg)
model = parallelize(model, mesh, plan)  # with pp: this rank's stages, model.pipeline runs them
opt = build_optimizer(model, mesh, plan)
batches = []
for step in range({steps} + 2):
    x, y = local_batch(step=step, batch={batch}, seq={seq}, vocab=cfg.vocab_size, rank=r, ranks=n)
    batches.append((sequence_slice(x, mesh), sequence_slice(y, mesh)) if cp else (x, y))
batches = iter(batches)

def train_step():
    x, y = next(batches)
    opt.zero_grad()
    if pp:
        model.pipeline.step(x, y)
    else:  # grad_accum micro-steps, the gradients reduced in the last
        for xs, ys in micro_batches(model, (x, y), plan.grad_accum):
            (loss_fn(model(xs), ys) / plan.grad_accum).backward()
    opt.step()

statistics.median(step_times(train_step, {steps}, warmup=2, before=dist.barrier,
                             after=dist.barrier))
"""


def step_seconds(cluster: Cluster, mesh: str, plan: str, model: str = "", *, steps: int,
                 batch: int = 8, seq: int = 64, timeout: float = 600) -> float:
    """Median step of the reference transformer (``ModelConfig(model)``) under
    ``ParallelPlan(plan)`` on ``mesh``, in seconds on the slowest rank; 2 warm-up steps."""
    cluster.init_mesh(mesh)
    result = cluster.run(CELL.format(model=model, plan=plan, steps=steps, batch=batch, seq=seq),
                         keep_values=True, timeout=timeout)
    return max(result.values.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    tokens = 8 * 64
    rows = []
    with Cluster(4) as cluster:
        for name, spec, plan, model in STRATEGIES:
            seconds = step_seconds(cluster, spec, plan, ", ".join(filter(None, (
                "max_seq_len=64", model))), steps=args.steps)
            rows.append((name, spec, seconds))
    base = {"": rows[0][2], "MoE": rows[-1][2]}
    print(f"{'strategy':<28} {'mesh':<20} {'step ms':>8} {'tokens/s':>9} {'time/DDP':>9}")
    for name, spec, seconds in rows:
        ref = base["MoE"] if "MoE" in name else base[""]
        print(f"{name:<28} {spec:<20} {seconds * 1e3:>8.1f} {tokens / seconds:>9.0f} "
              f"{seconds / ref:>9.2f}")


if __name__ == "__main__":
    main()
