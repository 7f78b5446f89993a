"""What `%%mesh --comms` costs: the same collective-heavy cell traced and untraced.

Both run on one cluster, interleaved in a shuffled order; the cell issues 200 small
all_reduces (where per-call overhead shows most) and one DTensor redistribution.

$ python benchmarks/comms.py                   # 4 ranks, 20 runs each
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

from meshlab import Cluster
from meshlab.measure.timing import interleaved_times

CELL = """
for _ in range(200):
    dist.all_reduce(torch.ones(1024))
full = w.redistribute(mesh, [Replicate(), Replicate()])
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    with Cluster(args.ranks) as cluster:
        cluster.init_mesh(f"dp={args.ranks // 2} tp=2")
        cluster.run("from torch.distributed.tensor import Replicate, Shard, distribute_tensor\n"
                    "w = distribute_tensor(torch.ones(64, 64), mesh, [Shard(0), Shard(1)])")
        samples = interleaved_times({traced: partial(cluster.run, CELL, comms=traced)
                                     for traced in (False, True)}, args.repeats, warmup=2)
    plain, traced = (statistics.median(samples[k]) * 1e3 for k in (False, True))
    print(f"median of {args.repeats}, {args.ranks} ranks, 201 collectives per cell")
    print(f"untraced {plain:7.1f} ms   --comms {traced:7.1f} ms   ratio {traced / plain:.2f}")


if __name__ == "__main__":
    main()
