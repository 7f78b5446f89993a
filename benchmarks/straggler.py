"""What a moving straggler costs synchronous data parallel beside local SGD, on 4 CPU ranks.

Each step one rank (a different one each step) computes 4 times slower (`meshlab.measure.throttle`).
Synchronous DP waits for it at every step's all-reduce; local SGD (H=4) meets only at every
4th step, by when the ranks' lags have evened out. Both run the same steps of the same MLP in
one session, alternating rounds, profiled (`%%mesh --profile`); printed per round: the time
the ranks waited for each other per step, in each, and their ratio (local SGD / sync DP). The
tests check the mechanism (tests/notebook/test_throttle.py); this is the speed.

$ python benchmarks/straggler.py               # 3 rounds of 8 steps
$ python benchmarks/straggler.py --rounds 5 --steps 16
"""

from __future__ import annotations

import argparse
import statistics

from meshlab import Session

SETUP = """
from contextlib import nullcontext
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.measure.throttle import throttle
torch.set_num_threads(1)
def prepare(sync):
    global model, opt, x
    torch.manual_seed(0)
    plan = ParallelPlan(data_parallel="ddp", replica_sync=sync,
                        **({"sync_every": 4} if sync != "every_step" else {}))
    model = parallelize(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                            torch.nn.Linear(512, 512)), mesh, plan)
    opt = build_optimizer(model, mesh, plan, lr=0.01, kind="sgd")
    x = torch.randn(256, 512)
    train(4)  # warm, and the syncs of local SGD fall on the same steps in every round
def train(steps, rotate=0):
    for i in range(steps):
        with throttle(rotate) if rotate and i % world_size == rank else nullcontext():
            model(x).square().mean().backward(); opt.step(); opt.zero_grad()
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="steps per run (a multiple of 4)")
    args = parser.parse_args()
    waited: dict[str, list[float]] = {"every_step": [], "local_sgd": []}
    with Session(4) as s:
        s.init("dp_replicate=4")
        s.run(SETUP)
        for r in range(args.rounds):
            for sync in waited:
                s.run(f"prepare({sync!r})")
                profile = s.run(f"train({args.steps}, rotate=4)", profile=True).profile
                assert profile is not None
                per_step = float(profile.summary()["waited for others"].sum()) / args.steps
                waited[sync].append(per_step)
            print(f"round {r + 1}: waited per step, all ranks: sync DP "
                  f"{waited['every_step'][-1]:.1f} ms, local SGD {waited['local_sgd'][-1]:.1f} ms")
    sync, local = (statistics.median(waited[k]) for k in ("every_step", "local_sgd"))
    print(f"median over {args.rounds} rounds: sync DP {sync:.1f} ms, local SGD {local:.1f} ms "
          f"per step; local SGD / sync DP = {local / sync:.2f}")


if __name__ == "__main__":
    main()
