"""The planner beside published large training runs: predicted vs published step time.

Each run (``meshlab.plan.published``: paper, table and row, what its figure counts, what the
paper leaves unsaid) is estimated with its stated layout, the unstated knobs at the
planner's fastest choice that fits. A published TFLOP/s or tokens/s figure becomes the step
time through the paper's own FLOP count, so Megatron's hardware FLOP/s (recompute counted)
and MFU compare like for like; the predicted run's model and hardware TFLOP/s, MFU and HFU
are printed beside. The runs are split once, by a hash of each name, into a development part
and a held-out part (``published.held_out``); both are printed, per family, then each run's
step time by term (``Estimate.terms``), and how the error moves along Megatron-Core's
strong scaling. No GPU needed.

$ python benchmarks/plan_vs_published.py            # every run, the parts, families, terms
$ python benchmarks/plan_vs_published.py --rank     # also where each published layout
                                                    # ranks in the planner's own search,
                                                    # on the run's own software
"""

from __future__ import annotations

import argparse
import statistics

from meshlab.plan import HARDWARE, MODELS, Layout, estimate, search
from meshlab.plan.estimate import Estimate, term_differences
from meshlab.plan.published import (
    DEVELOPMENT,
    HELD_OUT,
    RUNS,
    PublishedRun,
    by_family,
    predict,
)
from meshlab.plan.published.h100 import MCORE_STRONG_SCALING


def table(runs: list[PublishedRun], title: str, rank: bool
          ) -> tuple[dict[str, float], dict[str, Estimate]]:
    """Print one part's runs; their signed errors and estimates by name."""
    print(f"\n{title}")
    print(f"{'run':<38} {'published':>9} {'predicted':>9} {'error':>7} {'model TF':>8} "
          f"{'hw TF':>6} {'MFU':>5} {'HFU':>5} {'GiB':>4}  layout (free knobs chosen)"
          + ("   rank in search" if rank else ""))
    errors, found = {}, {}
    for run in runs:
        e, published = predict(run), run.published_step_s()
        if e is None:
            print(f"{run.name:<38} {published:>8.2f}s  does not fit: a run that ran")
            errors[run.name] = 1.0
            continue
        errors[run.name], found[run.name] = e.step_s / published - 1, e
        line = (f"{run.name:<38} {published:>8.2f}s {e.step_s:>8.2f}s "
                f"{errors[run.name]:>+7.1%} {e.tflops_per_gpu:>8.0f} {e.hw_tflops_per_gpu:>6.0f} "
                f"{e.mfu:>5.0%} {e.hfu:>5.0%} {e.memory['total'] / 2**30:>4.0f}  "
                f"{described(e.layout)}")
        if rank:
            line += "   " + _rank(run, e.tokens_per_s)
        print(line)
    absolute = [abs(x) for x in errors.values()]
    print(f"mean absolute error {statistics.mean(absolute):.1%}, worst {max(absolute):.1%}, "
          f"mean signed {statistics.mean(errors.values()):+.1%} ({len(runs)} runs)")
    return errors, found


def described(layout: Layout) -> str:
    """The layout as ``Layout.describe`` gives it, its precision named when not bf16."""
    return layout.describe() + ("" if layout.precision == "bf16"
                                else f" precision={layout.precision}")


TERMS = ("gemm", "attention", "memory", "host", "tp", "cp", "ep", "dp", "offload", "bubble",
         "optimizer")


def families(errors: dict[str, float]) -> None:
    """Each family's mean absolute and signed error (below zero: optimistic), per part."""
    print("\nper family: mean absolute error (mean signed; below zero the planner is "
          "optimistic), runs")
    print(f"{'family':<22} {'development':>22} {'held-out':>22} {'all':>22}")
    for family, row in by_family(errors).items():
        cells = []
        for part in ("development", "held-out", "all"):
            n = int(row.get(f"{part} runs", 0))
            cells.append(f"{row[f'{part} abs']:>5.1%} ({row[f'{part} signed']:+6.1%}) {n:>3}"
                         if n else "-")
        print(f"{family:<22} " + " ".join(f"{c:>22}" for c in cells))


def terms(found: dict[str, Estimate]) -> None:
    """Each run's step time by term (``Estimate.terms``), as shares of its step."""
    print("\nstep time by term, % of the predicted step (exposed communication only; pp "
          "hops are in the bubble)")
    print(f"{'run':<38} " + " ".join(f"{t[:6]:>6}" for t in TERMS))
    for name, e in found.items():
        parts = e.terms()
        print(f"{name:<38} " + " ".join(
            f"{parts.get(t, 0.0) / e.step_s:>6.1%}" if parts.get(t) else f"{'':>6}"
            for t in TERMS))


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


# Llama 3's last batch, 16M tokens (2,048 sequences of 8,192), on 1,024 and 16,384 H100s; the
# layout a paper ran there, or the nearest published one with its data parallelism scaled
SEARCHES = [
    ("llama3-405b", 16384, "tp=8 pp=16 dp=128 zero=2 schedule=interleaved_1f1b v=4 mbs=1",
     "Llama 3 405B as run (Dubey et al. 2024, Table 4, row 2)"),
    ("llama3-405b", 1024, "tp=8 pp=8 dp=16 zero=3 schedule=interleaved_1f1b v=2 mbs=4 ac=full",
     "torchtitan's 405B layout (Table 5, interleaved), dp 8 -> 16"),
    ("llama3-70b", 1024, "tp=8 dp=128 zero=3 mbs=16 ac=full",
     "torchtitan's 70B layout (Table 4: FSDP 32, TP 8), dp 32 -> 128"),
    ("llama3-70b", 16384, "tp=8 pp=2 dp=1024 zero=2 mbs=1",
     "Megatron-Core's 70B row (tp 8, pp 2), dp 48 -> 1,024"),
]
SEARCH_BATCH = 2048


def searches() -> None:
    """The search's best layout beside the published one, and the terms that separate them."""
    hw = HARDWARE["h100-sxm"]
    print(f"\nthe search on H100s, {SEARCH_BATCH:,} sequences of 8,192 a step (Llama 3's 16M "
          "tokens), bf16: its best layout beside a published one")
    for name, gpus, stated, source in SEARCHES:
        model = MODELS[name]
        best = search(model, gpus=gpus, hardware=hw, global_batch=SEARCH_BATCH, top=1)
        found: Estimate = best["estimate"].iloc[0]
        lay = Layout.parse(stated)
        lay = Layout.parse(stated, microbatches=SEARCH_BATCH // (lay.dp * lay.micro_batch))
        ran = estimate(model, lay, hw)
        print(f"{name} on {gpus:,} GPUs")
        for label, e in (("search", found), ("published", ran)):
            gib = e.memory["total"] / 2**30
            print(f"  {label:<9} {e.step_s:6.2f} s  MFU {e.mfu:4.0%}  {gib:3.0f} GiB"
                  f"{'' if e.fits else ' (does not fit)'}  {described(e.layout)}"
                  + (f"   [{source}]" if label == "published" else ""))
        why = term_differences(found, ran)
        same = found.layout == ran.layout
        print("  why: " + ("the same layout" if same else ", ".join(
            f"{term} {diff:+.2f} s" for term, diff in why) or "within 2% on every term"))


def scaling() -> None:
    """Megatron-Core's strong scaling (its README's plot, not in the error tables): whether
    the planner's error moves as the same job spreads from 96 to 4,608 GPUs."""
    print("\nMegatron-Core's 177B at one batch (1,152) from 96 to 4,608 H100s, read off its "
          "README's plot: per-GPU throughput against the first dot's")
    print(f"{'GPUs':>6} {'published':>9} {'predicted':>9} {'error':>7}   per GPU: published "
          "predicted")
    first: tuple[float, float] | None = None
    for run in MCORE_STRONG_SCALING:
        e, published = predict(run), run.published_step_s()
        assert e is not None, run.name
        per_gpu = (1 / (published * run.gpus), 1 / (e.step_s * run.gpus))
        first = first or per_gpu
        print(f"{run.gpus:>6,} {published:>8.2f}s {e.step_s:>8.2f}s "
              f"{e.step_s / published - 1:>+7.1%}   {per_gpu[0] / first[0]:>18.1%} "
              f"{per_gpu[1] / first[1]:>9.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank", action="store_true",
                        help="also rank each published layout in the planner's search (slow)")
    args = parser.parse_args()
    for run in RUNS:
        assert run.source, run.name
    dev, dev_found = table(DEVELOPMENT, "development part (2 runs in 3, by a hash of the name)",
                           args.rank)
    held, held_found = table(HELD_OUT, "held-out part (1 run in 3, by a hash of the name)",
                             args.rank)
    families({**dev, **held})
    terms({**dev_found, **held_found})
    scaling()
    searches()


if __name__ == "__main__":
    main()
