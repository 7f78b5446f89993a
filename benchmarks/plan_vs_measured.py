"""The planner's step time beside the measured one, on the live 4-rank CPU cluster.

`%mesh calibrate` measures this cluster (matmul TFLOP/s, memory bandwidth, every
collective's latency and bandwidth) and writes a hardware profile; the planner predicts the
reference transformer's step time under several layouts from that profile alone; then each
layout trains the same model for a few steps and the median step is measured. Goal: every
ratio predicted / measured within 0.75-1.33. Then one more step of each layout is profiled
(``%%mesh --profile``) and each term the planner predicts (compute, host time, exposed
communication per mesh axis, bubble, optimizer) is set beside the same term measured
(meshlab.notebook.plan_vs_measured), with the ratio measured / predicted.

$ python benchmarks/plan_vs_measured.py            # 4 ranks, 6 timed steps per layout
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

# a sibling script (benchmarks/ is on sys.path when this one runs): the same timed step
from strategies import step_seconds

from meshlab import Cluster
from meshlab.notebook.calibrate import calibrate_profile
from meshlab.notebook.plan_vs_measured import plan_terms
from meshlab.plan import Layout, ModelShape, estimate

# The reference model, sized so that a step is mostly arithmetic rather than Python: ~3.5M
# parameters, 8 sequences of 128 tokens per step.
MODEL = "dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768, vocab_size=1024, " \
        "max_seq_len=128"
BATCH, SEQ = 8, 128

LAYOUTS = [  # (name, mesh, meshlab ParallelPlan, planner layout)
    ("dp4 (DDP)", "dp=4", "data_parallel='ddp'", "dp=4 zero=0 mbs=2 m=1"),
    ("zero3 x4", "dp=4", "data_parallel='zero3'", "dp=4 zero=3 mbs=2 m=1"),
    ("tp2+sp x dp2", "dp=2 tp=2", "data_parallel='zero3'", "dp=2 tp=2 zero=3 mbs=4 m=1"),
    ("pp2 x dp2 (1F1B)", "pp=2 dp=2", "data_parallel='zero3', microbatches=2",
     "pp=2 dp=2 zero=3 mbs=2 m=2"),
]

# Fresh batches for the profiled steps (the timed cell used its own up), as it made them.
BATCHES = """
batches = []
for step in range({steps}):
    x, y = local_batch(step=step, batch={batch}, seq={seq}, vocab=cfg.vocab_size, rank=r, ranks=n)
    batches.append((sequence_slice(x, mesh), sequence_slice(y, mesh)) if cp else (x, y))
batches = iter(batches)
"""
PROFILED_STEPS = 2


def shape() -> ModelShape:
    values = dict(item.split("=") for item in MODEL.replace(" ", "").split(","))
    return ModelShape(name="meshlab-bench", layers=int(values["n_layers"]),
                      hidden=int(values["dim"]), heads=int(values["n_heads"]),
                      kv_heads=int(values["n_kv_heads"]), ffn=int(values["ffn_hidden"]),
                      vocab=int(values["vocab_size"]), seq_len=SEQ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a quick calibration")
    args = parser.parse_args()
    rows, terms = [], []
    with Cluster(4) as cluster, tempfile.TemporaryDirectory() as folder:
        cluster.run("import torch; torch.set_num_threads(1)")  # 4 ranks on few cores
        cluster.init_mesh("dp=4")
        report = calibrate_profile(cluster, Path(folder) / "cpu.toml", name="this-cluster",
                                   quick=args.quick)
        print(report.describe())
        for name, spec, plan, layout in LAYOUTS:
            measured = step_seconds(cluster, spec, f"{plan}, seq_len={SEQ}", MODEL,
                                    steps=args.steps, batch=BATCH, seq=SEQ, timeout=900)
            predicted = estimate(shape(), Layout.parse(layout, precision="fp32"),
                                 report.hardware)
            rows.append((name, predicted, measured))
            cluster.run(BATCHES.format(steps=PROFILED_STEPS, batch=BATCH, seq=SEQ))
            profiled = cluster.run(f"for _ in range({PROFILED_STEPS}):\n    train_step()",
                                   profile=True, timeout=900)
            terms.append((name, plan_terms(profiled.profile, predicted,
                                           steps=PROFILED_STEPS)))
    print(f"\n{'layout':<18} {'predicted ms':>12} {'measured ms':>12} {'ratio':>6}  "
          "predicted: compute / pipeline / exposed comm")
    for name, e, measured in rows:
        critical = sum(c.seconds for c in e.collectives if not c.overlapped)
        print(f"{name:<18} {e.step_s * 1e3:>12.1f} {measured * 1e3:>12.1f} "
              f"{e.step_s / measured:>6.2f}  {e.compute_s * 1e3:.1f} / "
              f"{e.pipeline_s * 1e3:.1f} / {(e.exposed_comm_s + critical) * 1e3:.1f}")
    print(f"\nper term, {PROFILED_STEPS} profiled steps (ms per step, the mean of the ranks): "
          "predicted / measured (measured/predicted)")
    for name, found in terms:
        print(f"{name:<18} " + "; ".join(
            f"{t.name} {t.predicted_ms:.3g} / {t.measured_ms:.3g} ({t.ratio:.2f})"
            for t in found))


if __name__ == "__main__":
    main()
