"""``meshlab compare-losses A B [C ...]``: runs' losses (files LossLog wrote) side by side,
for a shell or CI: ``--assert-equal`` (or ``--tolerance T``) exits 1 at the first step where
a run differs from the first, as torchtitan's scripts/loss_compare.py does."""

from __future__ import annotations

import argparse
from typing import Any

from meshlab.verify.loss_curves import compare_losses, load_runs


def add_command(commands: Any) -> None:
    cmd = commands.add_parser(
        "compare-losses", help="two or more runs' losses side by side (files LossLog wrote)",
        description="Set runs' losses side by side, step by step, each named with its layout "
        "and code version; with --assert-equal or --tolerance, exit 1 at the first step where "
        "a run differs from the first.")
    cmd.add_argument("runs", nargs="+", metavar="RUN", help="a file LossLog or save_losses "
                     "wrote (two or more)")
    cmd.add_argument("--assert-equal", action="store_true",
                     help="exit 1 unless every run's loss equals the first's at every step")
    cmd.add_argument("--tolerance", type=float, metavar="T",
                     help="exit 1 where a loss differs from the first run's by more than T "
                     "(relative)")
    cmd.add_argument("--grad-norms", action="store_true",
                     help="also show each run's gradient norms")
    cmd.set_defaults(run=run)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if len(args.runs) < 2:
        parser.error(f"compare-losses: {len(args.runs)} run given ({args.runs[0]}): give two "
                     "or more files LossLog wrote")
    if args.assert_equal and args.tolerance is not None:
        parser.error("compare-losses: --assert-equal and --tolerance: give one (--assert-equal "
                     "is --tolerance 0)")
    if args.tolerance is not None and not args.tolerance >= 0:  # NaN too: it would pass all
        parser.error(f"compare-losses: --tolerance {args.tolerance}: a relative difference, "
                     "0 or more")
    try:
        runs = load_runs(args.runs)
    except ValueError as e:
        parser.error(f"compare-losses: {e}")
    comparison = compare_losses(runs, args.tolerance or 0.0)
    for r in runs:
        print(f"{r.name}: {r.layout}, code {r.code}, {r.versions}, {len(r.losses)} steps")
    width = max(12, *(len(n) for n in (r.name for r in runs)))
    print("step".rjust(6) + "".join(r.name.rjust(width + 2) for r in runs)
          + "largest difference".rjust(20))
    for row in comparison.rows():
        print(f"{row['step']:6d}" + "".join(f"{row[r.name]:{width + 2}.10g}" for r in runs)
              + f"{row['largest difference']:20.2e}")
        if args.grad_norms:
            norms = (r.grad_norms.get(row["step"]) for r in runs)
            print(" " * 6 + "".join(("-" if n is None else f"{n:.4g}").rjust(width + 2)
                                    for n in norms) + "  (grad norms)")
    print(comparison)
    asserted = args.assert_equal or args.tolerance is not None
    return 1 if asserted and not comparison.ok else 0
