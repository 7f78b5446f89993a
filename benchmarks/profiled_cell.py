"""What `%%mesh --profile` costs, and how well it lines the ranks up on one clock.

1. Cost: ZeRO-3 x TP training steps of the reference transformer (dp=2 tp=2, 4 CPU ranks),
   one and three a %%mesh cell, unprofiled and profiled, alternating so both see the same
   machine. Printed: the median cell in each, their ratio (goal <= 1.5), and the first
   profiled cell alone (torch's profiler starts its tracer once per process). What profiling
   adds is mostly per cell (the trace written, read, cut into spans and sent), not per op.
2. Clocks: a cell of barriers (a short sleep between them) profiled on 2 and on 4 ranks. No
   rank can leave a barrier before the last one entered, so on a well-merged axis every rank's
   exit lands close to the others': printed, the spread of the exits per barrier (median and
   worst; goal <= 1 ms on one host). Also each rank's clock offset to the notebook's measured
   through the control channel (NTP's midpoint) with its error bound, which ranks on other
   machines use.

$ python benchmarks/profiled_cell.py                  # 5 rounds
$ python benchmarks/profiled_cell.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshlab import Cluster

SETUP = """
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import train
torch.set_num_threads(1)
cfg = ModelConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                  vocab_size=1024, max_seq_len=128)
plan = ParallelPlan(data_parallel="zero3")
model = parallelize(Transformer(cfg), mesh, plan)
opt = build_optimizer(model, mesh, plan)
batch = local_batch(step=0, batch=8, seq=128, vocab=cfg.vocab_size,
                    rank=mesh["dp"].get_local_rank(), ranks=2)
train(model, opt, [batch], average_over=mesh["dp"].get_group())
"""
STEP = 'train(model, opt, [batch], average_over=mesh["dp"].get_group())'
BARRIERS = "import time\nfor _ in range(20):\n    time.sleep(0.005)\n    dist.barrier()\n"


def seconds(cluster: Cluster, code: str, profile: bool) -> float:
    started = time.perf_counter()
    cluster.run(code, profile=profile)
    return time.perf_counter() - started


def cost(rounds: int) -> None:
    with Cluster(4) as cluster:
        cluster.init_mesh("dp=2 tp=2")
        cluster.run(SETUP)
        first = seconds(cluster, STEP, profile=True)
        print(f"first profiled cell {first * 1e3:,.0f} ms (the profiler's one-off start)")
        for steps in (1, 3):
            cell = "\n".join([STEP] * steps)
            plain, profiled = [], []
            for _ in range(rounds):
                plain.append(seconds(cluster, cell, profile=False))
                profiled.append(seconds(cluster, cell, profile=True))
            a, b = statistics.median(plain), statistics.median(profiled)
            print(f"ZeRO-3 x TP, {steps} step(s) a cell, 4 ranks: unprofiled {a * 1e3:,.0f} ms, "
                  f"profiled {b * 1e3:,.0f} ms (median of {rounds}): ratio {b / a:.2f} "
                  "(goal <= 1.5)")


def clocks(ranks: int) -> None:
    with Cluster(ranks) as cluster:
        cluster.run(BARRIERS, profile=True)  # the profiler's one-off start, not measured
        profile = cluster.run(BARRIERS, profile=True).profile
        assert profile is not None
        exits: dict[int, list[float]] = {}
        for r, p in profile.ranks.items():
            for c in p.collectives:
                if c.op == "barrier":
                    exits.setdefault(c.seq, []).append(profile._ms(r, c.done_ns))
        spreads = sorted(max(e) - min(e) for e in exits.values())
        measured = cluster.clocks(list(range(ranks)))
        worst_error = max(error for _, error in measured.values()) / 1e6
        worst_offset = max(abs(offset) for offset, _ in measured.values()) / 1e6
        print(f"{ranks} ranks, {len(spreads)} barriers: exits spread median "
              f"{statistics.median(spreads):.3f} ms, worst {spreads[-1]:.3f} ms (goal <= 1 ms); "
              f"clock offsets measured through the control channel: |offset| <= "
              f"{worst_offset:.3f} ms, error bound <= {worst_error:.3f} ms (true offset 0: "
              f"one machine)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cost(args.rounds)
    for ranks in (2, 4):
        clocks(ranks)


if __name__ == "__main__":
    main()
