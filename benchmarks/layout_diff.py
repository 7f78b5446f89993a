"""What the layout diff costs: ``diff_with_single_process`` beside the two runs it compares.

On N CPU ranks (gloo), for each layout: the two runs themselves (the model trained in one
process on the global batch, and trained under the layout on each rank's rows: SGD, the
same steps, nothing recorded), then the diff of the same (both runs recorded module by
module, every tensor gathered whole and set beside its part). Each timed on every rank,
rank 0's figure printed, the median of the rounds. The goal (issue 59): the diff at most 3x
the two runs.

$ python benchmarks/layout_diff.py                 # 4 ranks, 2 steps, 3 rounds
$ python benchmarks/layout_diff.py --dim 256 --layers 4 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics

from meshlab import Cluster

CELL = """
import time, torch, meshlab.mesh
from meshlab.models import ModelConfig, Transformer, global_batch, local_batch
from meshlab.parallel import ParallelPlan, parallelize
from meshlab.verify.comparison import data_rank
from meshlab.verify.layout_diff import diff_with_single_process
from meshlab.verify.training import next_token_loss

cfg = ModelConfig(dim={dim}, n_layers={layers}, n_heads=4, n_kv_heads=2, vocab_size=256,
                  ffn_hidden={ffn}, max_seq_len={seq})


def sgd(model, batches):
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for batch in batches:
        optimizer.zero_grad()
        next_token_loss(model, batch).backward()
        optimizer.step()


def two_runs(mesh, plan):
    torch.manual_seed(0)
    sgd(Transformer(cfg).double(), [global_batch(step=s, batch=8, seq={seq}, vocab=256)
                                    for s in range({steps})])
    rank, ranks = data_rank(mesh)
    torch.manual_seed(0)
    model = parallelize(Transformer(cfg).double(), mesh, plan)
    sgd(model, [local_batch(step=s, batch=8, seq={seq}, vocab=256, rank=rank, ranks=ranks)
                for s in range({steps})])


def timed(run):
    dist.barrier()
    start = time.perf_counter()
    run()
    dist.barrier()
    return time.perf_counter() - start


times = {{}}
for name, axes, plan in (("DDP dp={n}", "dp={n}", ParallelPlan(data_parallel="ddp")),
                         ("ZeRO-3 dp={n}", "dp={n}", ParallelPlan(data_parallel="zero3")),
                         ("TP+SP dp={half} tp=2", "dp={half} tp=2", ParallelPlan())):
    mesh = meshlab.mesh.build(axes)
    runs = timed(lambda: two_runs(mesh, plan))
    diffed = timed(lambda: diff_with_single_process(cfg, mesh, plan, steps={steps}, seq={seq}))
    times[name] = (runs, diffed)
times
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cluster = Cluster(args.ranks).start(progress=False)
    rounds: list[dict[str, tuple[float, float]]] = []
    try:
        cell = CELL.format(dim=args.dim, layers=args.layers, ffn=4 * args.dim, seq=args.seq,
                           steps=args.steps, n=args.ranks, half=args.ranks // 2)
        for _ in range(args.rounds):
            rounds.append(cluster.run(cell, keep_values=True, timeout=600).values[0])
    finally:
        cluster.stop()
    print(f"layout diff of {args.steps} steps beside the two runs it compares: "
          f"{args.ranks} CPU ranks, dim {args.dim}, {args.layers} layers, batch 8 x "
          f"{args.seq} tokens, float64, median of {args.rounds} rounds")
    print(f"{'layout':<22}{'two runs':>10}{'the diff':>10}{'ratio':>8}  goal <= 3x")
    for name in rounds[0]:
        runs = statistics.median(r[name][0] for r in rounds)
        diffed = statistics.median(r[name][1] for r in rounds)
        ratio = diffed / runs
        print(f"{name:<22}{runs:>9.2f}s{diffed:>9.2f}s{ratio:>7.2f}x  "
              f"{'met' if ratio <= 3 else 'NOT met'}")


if __name__ == "__main__":
    main()
