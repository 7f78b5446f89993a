"""The planner beside published large training runs: predicted vs published step time.

Each run (``meshlab.plan.published``: paper, table and row, what its figure counts, what the
paper leaves unsaid) is estimated with its stated layout, the unstated knobs at the
planner's fastest choice that fits. A published TFLOP/s figure becomes the step time through
the paper's own FLOP count, so Megatron's hardware FLOP/s (recompute counted) and Llama 3's
MFU compare like for like; the predicted run's model and hardware TFLOP/s, MFU and HFU are
printed beside. The development runs are what the model was built against; the held-out
runs were not looked at while it was. No GPU needed.

$ python benchmarks/plan_vs_published.py            # every run, both groups, the errors
$ python benchmarks/plan_vs_published.py --rank     # also where each published layout
                                                    # ranks in the planner's own search,
                                                    # on the run's own software
"""

from __future__ import annotations

import argparse
import statistics

from meshlab.plan import HARDWARE, search
from meshlab.plan.published import DEVELOPMENT, HELD_OUT, PublishedRun, predict


def table(runs: list[PublishedRun], title: str, rank: bool) -> list[float]:
    print(f"\n{title}")
    print(f"{'run':<36} {'published':>9} {'predicted':>9} {'error':>7} {'model TF':>8} "
          f"{'hw TF':>6} {'MFU':>5} {'HFU':>5} {'GiB':>4}  layout (free knobs chosen)"
          + ("   rank in search" if rank else ""))
    errors = []
    for run in runs:
        e, published = predict(run), run.published_step_s()
        if e is None:
            print(f"{run.name:<36} {published:>8.2f}s  does not fit: a run that ran")
            errors.append(1.0)
            continue
        error = e.step_s / published - 1
        errors.append(abs(error))
        line = (f"{run.name:<36} {published:>8.2f}s {e.step_s:>8.2f}s {error:>+7.1%} "
                f"{e.tflops_per_gpu:>8.0f} {e.hw_tflops_per_gpu:>6.0f} {e.mfu:>5.0%} "
                f"{e.hfu:>5.0%} {e.memory['total'] / 2**30:>4.0f}  {e.layout.describe()}")
        if rank:
            line += "   " + _rank(run, e.tokens_per_s)
        print(line)
    print(f"mean absolute error {statistics.mean(errors):.1%}, worst {max(errors):.1%} "
          f"({len(runs)} runs)")
    return errors


# what a run's software could do, held for every layout of its search: a 2021 run had no
# FlashAttention, no sequence parallelism, no overlapped gradient reduction, no distributed
# optimizer (its ZeRO stage is its framework's), and recomputed as its FLOP count says
SOFTWARE = ("flash_attention", "sequence_parallel", "overlap_grad_reduce", "shard_unit")


def _rank(run: PublishedRun, tokens_per_s: float) -> str:
    """Where the published layout's prediction ranks among every layout the planner's
    search tries for the same model, GPUs and batch on the same software (ZeRO stage and
    recompute as stated): the parallel layout is what is searched (top = fastest)."""
    stated = run.stated()
    pinned = f"zero={stated.zero}" + (
        "" if "recompute" in run.free else f" recompute={stated.recompute}")
    found = search(run.model, gpus=run.gpus, hardware=HARDWARE[run.hardware],
                   global_batch=run.batch, top=None, constraints=pinned,
                   settings={k: getattr(stated, k) for k in SOFTWARE})
    ahead = int((found["tokens_per_s"] > tokens_per_s * (1 + 1e-9)).sum())
    return f"{ahead + 1} of {len(found)} (top {(ahead + 1) / len(found):.1%})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", action="store_true",
                        help="also rank each published layout in the planner's search (slow)")
    args = parser.parse_args()
    for run in DEVELOPMENT + HELD_OUT:
        assert run.source, run.name
    table(DEVELOPMENT, "development runs (the model was built against these)", args.rank)
    table(HELD_OUT, "held-out runs (not looked at while the model was built)", args.rank)


if __name__ == "__main__":
    main()
