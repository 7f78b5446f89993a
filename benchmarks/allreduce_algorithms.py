"""All-reduce algorithms side by side: ring, halving-doubling, tree and hierarchical
(``meshlab.measure.allreduce``, written on send/recv) beside the backend's own ``dist.all_reduce``,
over message sizes; each algorithm's time over the backend's and over ring's, and the size
below which each beats ring, measured and as the planner predicts it from the links a
calibration fits (the all-reduce on the mesh's axes, not these points).

$ python benchmarks/allreduce_algorithms.py            # 4 local gloo ranks, 4 KiB..16 MiB
$ python benchmarks/allreduce_algorithms.py --ranks 8 --reps 5
"""

from __future__ import annotations

import argparse

from meshlab import Cluster
from meshlab.calibrate.algorithms import SWEEP, AllreduceSweep
from meshlab.calibrate.collectives import parse_sizes
from meshlab.calibrate.result import allreduce_table

CELL = """
from meshlab.calibrate.algorithms import compare_allreduce
compare_allreduce(mesh, {sizes!r}, reps={reps})
"""


def ratios(sweep: AllreduceSweep) -> list[str]:
    """Each algorithm's time over the backend's and over ring's, per size."""
    names = sweep.algorithms
    out = [f"time / {sweep.backend}'s dist.all_reduce (time / ring)",
           f"{'bytes':>10}" + "".join(f"{n:>26}" for n in names)]
    for i, size in enumerate(sweep.nbytes):
        cells = [f"{sweep.seconds[n][i] / sweep.seconds[sweep.backend][i]:.2f} "
                 f"({sweep.seconds[n][i] / sweep.seconds['ring'][i]:.2f})" for n in names]
        out.append(f"{size:>10}" + "".join(f"{c:>26}" for c in cells))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--sizes", type=parse_sizes, default=list(SWEEP),
                        help="message sizes, e.g. 4K,64K,1M,16M")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per point")
    args = parser.parse_args()
    with Cluster(args.ranks) as cluster:
        cluster.init_mesh(f"dp={args.ranks // 2} tp=2")
        result = cluster.run(CELL.format(sizes=args.sizes, reps=args.reps), keep_values=True,
                             timeout=600)
    sweep: AllreduceSweep = result.values[0]
    print("\n".join(allreduce_table(sweep)))
    print()
    print("\n".join(ratios(sweep)))


if __name__ == "__main__":
    main()
