"""%mesh calibrate on the live ranks, then the planner's step time beside the measured one.

What benchmarks/plan_vs_measured.py does on the 4-rank CPU cluster, on the GPU ranks
(one per visible GPU unless --ranks): calibrate_profile (the code behind %mesh calibrate)
measures matmuls per dtype, the copy bandwidth, host time per layer and the collectives on
the mesh, and writes a hardware profile; the planner (meshlab.plan.estimate) predicts the
step of a few models from that profile alone; each model then trains on the ranks (model and
batches on the rank's device) and the median step is measured. Printed: predicted, measured,
ratio (goal 0.75-1.33, as on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from meshlab import Cluster
from meshlab.notebook.calibrate import calibrate_profile
from meshlab.plan import Layout, ModelShape, estimate
from meshlab.plan.hardware import Hardware

# (name, ModelConfig kwargs, local batch, seq, ParallelPlan extras, planner precision)
CASES = [
    ("small fp32", dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=768,
                        vocab_size=1024, max_seq_len=128), 8, 128, "", "fp32"),
    ("1B-ish bf16", dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
                         vocab_size=32000, max_seq_len=1024), 4, 1024,
     ", mixed_precision=True", "bf16"),
    ("1B-ish fp32", dict(dim=2048, n_layers=8, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
                         vocab_size=32000, max_seq_len=1024), 4, 1024, "", "fp32"),
]
SMALL_CASES = CASES[:1]  # on CPU ranks: the big ones would take minutes a step

CELL = """
import statistics
from meshlab.models import ModelConfig, Transformer, local_batch
from meshlab.models.llama import loss_fn
from meshlab.parallel import ParallelPlan, build_optimizer, parallelize
from meshlab.verify.compare import data_rank
from meshlab.measure.timing import step_times
cfg = ModelConfig(**{model})
plan = ParallelPlan(data_parallel="{dp}", seq_len={seq}{extra})
r, n = data_rank(mesh)
torch.manual_seed(0)
with torch.device(device):
    model = Transformer(cfg)
model = parallelize(model, mesh, plan)
opt = build_optimizer(model, mesh, plan)
batches = iter([tuple(t.to(device) for t in local_batch(step=s, batch={batch} * n, seq={seq},
                vocab=cfg.vocab_size, rank=r, ranks=n)) for s in range({steps} + 2)])

def train_step():
    x, y = next(batches)
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()

seconds = statistics.median(step_times(train_step, {steps}, warmup=2, before=dist.barrier,
                                       after=dist.barrier))
del model, opt, batches
import gc; gc.collect()
if device.type == "cuda":
    torch.cuda.empty_cache()
seconds
"""


def shape(name: str, model: dict, seq: int) -> ModelShape:
    return ModelShape(name=name, layers=model["n_layers"], hidden=model["dim"],
                      heads=model["n_heads"], kv_heads=model["n_kv_heads"],
                      ffn=model["ffn_hidden"], vocab=model["vocab_size"], seq_len=seq)


def one_rank_profile(cluster: Cluster, quick: bool) -> Hardware:
    """%mesh calibrate on one rank: Calibration.profile refuses it (no collective to time:
    "calibrate a cluster of at least 2 ranks"), so the profile is built here as profile()
    builds it, from everything measured, with the h100-sxm datasheet profile's links in
    place of the untimed collectives (a 1-rank step issues none)."""
    import dataclasses

    from meshlab.calibrate.result import summary
    from meshlab.notebook.calibrate import matmul_frame
    from meshlab.plan.hardware import HARDWARE

    result = cluster.run("from meshlab.calibrate import calibrate as _cal\n"
                         f"_cal(None, quick={quick!r})", keep_values=True, timeout=600)
    c = result.values[0]
    print(summary(c))
    print(matmul_frame(c).to_string(index=False))
    hw = dataclasses.replace(
        HARDWARE["h100-sxm"], name="gpu-pass (1 rank)", tflops=c.peaks(),
        **c.attention_fields(), matmul_efficiency=1.0, sms=c.sms,
        gemm_tile=c.gemm_tile, gemm_k0=c.gemm_k0, memory_gib=c.memory_gib,
        reserved_gib=c.reserved_gib, memory_bandwidth_gbs=c.memory_bandwidth_gbs,
        asynchronous=c.device == "cuda")
    hw = c._with_host_costs(hw)
    print(f"profile (1 rank, datasheet links): TFLOP/s {hw.tflops}, copy "
          f"{hw.memory_bandwidth_gbs:.0f} GB/s, {hw.layer_overhead_us:.0f} us host time/layer, "
          f"attention shares {hw.attention_efficiency} (auto: {hw.attention_default or '-'})")
    return hw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo", "auto"])
    parser.add_argument("--ranks", type=int, default=None)
    parser.add_argument("--profile", default="calibrated.toml")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--quick", action="store_true", help="a quick calibration")
    args = parser.parse_args()
    out: dict = {"cases": []}
    folder = Path(os.environ.get("GPU_PASS_RESULTS", "."))
    ok = True
    with Cluster(args.ranks, backend=args.backend) as cluster:
        world = cluster.world_size
        facts = cluster.run("(str(device), str(dist.get_backend()))", keep_values=True).values
        print(f"{world} rank(s): {facts}")
        gpu = all(d.startswith("cuda") for d, _ in facts.values())
        cluster.init_mesh(f"dp={world}")
        t0 = time.perf_counter()
        if world > 1:
            report = calibrate_profile(cluster, args.profile, name="gpu-pass",
                                       quick=args.quick)
            hardware = report.hardware
            print(f"calibrated in {time.perf_counter() - t0:.1f} s: {report.describe()}")
            print(report.matmul.to_string(index=False))
            print(report.collectives.to_string(index=False))
        else:
            hardware = one_rank_profile(cluster, args.quick)
        out["calibrate_s"] = time.perf_counter() - t0
        out["profile"] = {"tflops": hardware.tflops,
                          "memory_bandwidth_gbs": hardware.memory_bandwidth_gbs,
                          "layer_overhead_us": hardware.layer_overhead_us,
                          "gemm_k0": hardware.gemm_k0}
        dp = "ddp" if world > 1 else "none"
        for name, model, batch, seq, extra, precision in (CASES if gpu else SMALL_CASES):
            case = {"name": name, "precision": precision}
            try:
                cell = CELL.format(model=model, dp=dp, seq=seq, extra=extra, batch=batch,
                                   steps=args.steps)
                result = cluster.run(cell, keep_values=True, timeout=300)
                measured = max(result.values.values())
                layout = Layout.parse(f"dp={world} zero=0 mbs={batch} m=1", precision=precision)
                e = estimate(shape(name, model, seq), layout, hardware)
                case.update(predicted_s=e.step_s, measured_s=measured,
                            ratio=e.step_s / measured, compute_s=e.compute_s,
                            tokens_per_s=world * batch * seq / measured)
            except Exception as exc:
                case["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                ok = False
            out["cases"].append(case)
            print(case)
    print(f"\n{'model':<14} {'precision':<9} {'predicted ms':>12} {'measured ms':>12} "
          f"{'ratio':>6} {'tokens/s':>10}")
    for c in out["cases"]:
        if "error" in c:
            print(f"{c['name']:<14} {c['precision']:<9} error: {c['error'][:200]}")
            continue
        print(f"{c['name']:<14} {c['precision']:<9} {c['predicted_s'] * 1e3:>12.2f} "
              f"{c['measured_s'] * 1e3:>12.2f} {c['ratio']:>6.2f} {c['tokens_per_s']:>10.0f}")
    (folder / "calibrate.json").write_text(json.dumps(out, indent=1, default=str))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
