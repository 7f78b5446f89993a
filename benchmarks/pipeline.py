"""meshlab's pipeline executor beside torch's schedule classes, on the same model and ranks.

For each schedule, the same stage split runs a whole forward+backward step through torch's
class (ScheduleGPipe, Schedule1F1B, ...) and through meshlab's Executor, alternating, and the
medians are compared. Then the cost of stepping: one step advanced slot by slot from the
notebook side (one %mesh step 1 each: a round trip to every rank) against one advance.

$ python benchmarks/pipeline.py                 # 4 ranks, pp=4, 10 timed steps each
$ python benchmarks/pipeline.py --stepping-only # the cost of stepping alone
"""

from __future__ import annotations

import argparse
import statistics
import time

from meshlab import Cluster
from meshlab.measure.timing import step_times
from meshlab.notebook.stepping import SteppedPipeline
from meshlab.schedules import build

# every schedule meshlab builds (the executor is meshlab's one pipeline runtime), with torch's
# class for it; v: stages per rank for the looped ones
SCHEDULES = [("gpipe", 1, "ScheduleGPipe"), ("1f1b", 1, "Schedule1F1B"),
             ("interleaved_1f1b", 2, "ScheduleInterleaved1F1B"),
             ("looped_bfs", 2, "ScheduleLoopedBFS"),
             ("zb_h1", 1, "ScheduleInterleavedZeroBubble"),
             ("zbv", 1, "ScheduleZBVZeroBubble"), ("dualpipev", 1, "ScheduleDualPipeV")]

SETUP = """
import time, statistics, torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from meshlab.models import ModelConfig, Transformer, global_batch
from meshlab.models.llama import loss_fn
from meshlab.schedules import build
from meshlab.schedules.execute import bind, stage_modules
cfg = ModelConfig(n_layers=8, dim=128, n_heads=4, n_kv_heads=2, ffn_hidden=384,
                  max_seq_len=64)
batch = global_batch(step=0, batch=16, seq=64, vocab=cfg.vocab_size)
"""

COMPARE = """
schedule = build({name!r}, ranks=mesh["pp"].size(), microbatches={m}, virtual={v})
pp = mesh["pp"]
mine = schedule.stages_of(pp.get_local_rank())
ours = bind(Transformer(cfg), mesh, schedule, batch=batch)
twin = stage_modules(Transformer(cfg), mine, schedule.stages)
stages = [PipelineStage(twin[s], s, schedule.stages, torch.device("cpu"), group=pp.get_group())
          for s in mine]
cls = getattr(torch_schedules, {cls!r})
single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
theirs = cls(stages[0] if single else stages, n_microbatches={m}, loss_fn=loss_fn)
times = {{"torch": [], "meshlab": []}}
for i in range({steps} + 2):
    for who in ("torch", "meshlab"):
        dist.barrier()
        start = time.perf_counter()
        if who == "torch":
            theirs.step(*batch[:1], target=batch[1], losses=[])
        else:
            ours.step(*batch)
        dist.barrier()
        if i >= 2:  # warm-up
            times[who].append(time.perf_counter() - start)
(statistics.median(times["torch"]), statistics.median(times["meshlab"]))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--stepping-only", action="store_true",
                        help="skip the schedule comparison; time stepping alone")
    args = parser.parse_args()
    m = args.microbatches
    with Cluster(4) as cluster:
        cluster.init_mesh("pp=4")
        cluster.run(SETUP)
        print(f"{'schedule':<18} {'torch ms':>9} {'meshlab ms':>11} {'ratio':>6}")
        for name, v, cls in [] if args.stepping_only else SCHEDULES:
            result = cluster.run(COMPARE.format(name=name, m=m, v=v, cls=cls, steps=args.steps),
                                 keep_values=True, timeout=600)
            theirs, ours = result.values[0]
            print(f"{name:<18} {theirs * 1e3:9.1f} {ours * 1e3:11.1f} {ours / theirs:6.2f}")

        schedule = build("1f1b", ranks=4, microbatches=m)
        cluster.run("model = Transformer(cfg)")
        whole, stepped, slots = [], [], 0
        for _ in range(3):
            pipeline = SteppedPipeline(cluster, schedule, model="model")
            start = time.perf_counter()
            pipeline.step(None)
            whole.append(time.perf_counter() - start)
            pipeline = SteppedPipeline(cluster, schedule, model="model")
            start = time.perf_counter()
            while not pipeline.done:
                pipeline.step(1)
                slots += 1
            stepped.append(time.perf_counter() - start)
        slots //= 3
        extra = (statistics.median(stepped) - statistics.median(whole)) / slots
        floor = statistics.median(step_times(lambda: cluster.run("pass"), 20, warmup=3))
        print(f"\nstepping 1f1b (m={m}) from the notebook: whole step "
              f"{statistics.median(whole) * 1e3:.0f} ms in one %mesh step --all, "
              f"{statistics.median(stepped) * 1e3:.0f} ms as {slots} x %mesh step 1 "
              f"({extra * 1e3:.1f} ms per slot; a no-op cell's round trip: "
              f"{floor * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
