"""From a killed rank to a restored session, beside a fresh `%mesh start`; checkpoint times.

A real IPython shell with `%load_ext meshlab` drives 4 CPU ranks: it builds the reference
transformer under DDP, trains, saves a checkpoint and trains on; then a rank is killed with
SIGKILL and the clock runs until `%mesh restart` has replayed the session (or
`%mesh restart --from-checkpoint` has loaded it). The baseline is a fresh `%mesh start 4` in
the same process. Printed: each time, the ratio to a fresh start, and checkpoint save (sync,
async until it returns, async until it is on disk) and load times.

$ python benchmarks/recovery.py               # 3 rounds
$ python benchmarks/recovery.py --rounds 1
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

SETUP = """%%mesh
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank, train

torch.manual_seed(0)
cfg = ModelConfig(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384)
plan = ParallelPlan(data_parallel="ddp")
model = parallelize(Transformer(cfg), mesh, plan)
optimizer = build_optimizer(model, mesh, plan, lr=1e-3)
step, losses = 0, []

def fit(n):
    global step
    dp_rank, dp_ranks = data_rank(mesh)
    batches = [local_batch(step=step + s, batch=8, seq=32, vocab=cfg.vocab_size, rank=dp_rank,
                           ranks=dp_ranks) for s in range(n)]
    losses.extend(train(model, optimizer, batches, average_over=mesh["dp"].get_group()))
    step += n
"""


def timed(shell: Any, text: str) -> float:
    start = time.perf_counter()
    cell(shell, text)
    return time.perf_counter() - start


def cell(shell: Any, text: str) -> None:
    with capture_output() as cap:
        result = shell.run_cell(text, store_history=True)
    if not result.success:
        raise SystemExit(f"{text.splitlines()[0]} failed:\n{cap.stdout}\n{cap.stderr}")


def kill_a_rank(session: Any) -> None:
    cluster = session.cluster
    os.kill(cluster._hosts[1]["pid"], signal.SIGKILL)
    while 1 not in cluster.dead():
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    shell = start_ipython()
    shell.run_line_magic("load_ext", "meshlab")
    session = shell.magics_manager.registry["MeshMagics"].session
    folder = Path(tempfile.mkdtemp(prefix="meshlab-recovery-"))
    times: dict[str, list[float]] = {k: [] for k in (
        "fresh start", "restart + replay", "restart from checkpoint", "checkpoint save",
        "async save (returns)", "async save (on disk)", "checkpoint load")}
    for n in range(args.rounds):
        if session.cluster is not None:
            cell(shell, "%mesh stop")
        times["fresh start"].append(timed(shell, f"%mesh start {args.ranks}"))
        cell(shell, f"%mesh init dp={args.ranks}")
        cell(shell, SETUP)
        cell(shell, "%%mesh\nfit(3)")
        ckpt = folder / f"round{n}"
        times["checkpoint save"].append(timed(shell, f"%mesh checkpoint save {ckpt}"))
        returned = timed(shell, f"%mesh checkpoint save {ckpt}-async --async")
        times["async save (returns)"].append(returned)
        times["async save (on disk)"].append(returned + timed(
            shell, "%%mesh\nimport meshlab.checkpoint.sharded\nmeshlab.checkpoint.sharded.wait()"))
        times["checkpoint load"].append(timed(shell, f"%mesh checkpoint load {ckpt}"))
        cell(shell, "%%mesh\nfit(2)")

        start = time.perf_counter()
        kill_a_rank(session)
        cell(shell, "%mesh restart")
        times["restart + replay"].append(time.perf_counter() - start)

        start = time.perf_counter()
        kill_a_rank(session)
        cell(shell, f"%mesh restart --from-checkpoint {ckpt}")
        times["restart from checkpoint"].append(time.perf_counter() - start)
    cell(shell, "%mesh stop")

    fresh = statistics.median(times["fresh start"])
    print(f"{args.ranks} CPU ranks, {args.rounds} rounds, medians:")
    for name, values in times.items():
        ratio = (f"  ({statistics.median(values) / fresh:.2f} x a fresh start)"
                 if "restart" in name else "")
        print(f"  {name:<24} {statistics.median(values) * 1000:9.1f} ms{ratio}")


if __name__ == "__main__":
    main()
