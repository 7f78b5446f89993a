"""A dry run at full scale beside the planner: Llama-3 70B on 1,024 fake ranks and 405B on
16,384, one process each, no cluster; each in a fixed layout, and in the planner's first
choice for it (counting meshlab's code: whether that fits where it runs).

Each case runs in a child process (so its peak RSS is its own): meshlab.dry_run.run builds the
model on the meta device, parallelizes it for one representative rank per pipeline stage
and runs a step on fake tensors. Printed per case: the wall time and the child's peak
resident memory (with its workers, one per CPU, each at its peak) beside the planner's time
to estimate the same layout (goals: 70B <= 30 s, 405B <= 120 s, <= 8 GiB), then each
rank's memory by category beside the planner's.

$ python benchmarks/dryrun.py                 # every case
$ python benchmarks/dryrun.py --case 70b      # one
$ python benchmarks/dryrun.py --profile 70b   # where a case's time goes (cProfile, top 25)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

CASES: dict[str, tuple[str, str | int, float]] = {
    "70b": ("llama3-70b", "pp=4 dp_shard=32 tp=8 schedule=interleaved_1f1b v=2 m=8", 30),
    "405b": ("llama3-405b", "pp=16 dp=128 tp=8 m=16", 120),
    # the planner's first choice on that many GPUs, counting meshlab's code: does it fit?
    "70b-pick": ("llama3-70b", 1024, 30),
    "405b-pick": ("llama3-405b", 16384, 120),
}
GIB = 2**30


def case_layout(case: str) -> tuple[str, str, float]:
    """The case's model, layout (a pick's: the planner's first choice) and time goal."""
    model, layout, goal = CASES[case]
    if isinstance(layout, int):
        from meshlab.dry_run.plan import describe
        from meshlab.plan.report import plan

        layout = describe(plan(model, gpus=layout, top=1).best.layout)
    return model, layout, goal


def one(case: str) -> dict[str, object]:
    """Run one case here; what the parent prints."""
    from meshlab.dry_run.run import dryrun, planner_beside, processes_for

    model, layout, _ = case_layout(case)
    started = time.perf_counter()
    run = dryrun(model, layout, hardware="h100-sxm", workers=os.cpu_count())  # a script: say so
    wall = time.perf_counter() - started
    # the ranks run in worker processes (meshlab.dry_run.run's workers) beside this one: the
    # host holds this process and the workers together at most
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    worker = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    probed = [r for r in run.ranks if "composed from" not in r.role]
    rss = own + processes_for(len(probed), os.cpu_count() or 1) * worker
    rows = [r.as_dict() for r in planner_beside(run) if r.what == "memory"]
    return {"wall_s": wall, "rss": rss, "ranks": [
        {"rank": r.rank, "role": r.role, "seconds": r.seconds, "memory": r.memory,
         "fits": r.fits} for r in run.ranks], "rows": rows}


def planner_seconds(case: str) -> float:
    from meshlab.plan import HARDWARE, Layout, estimate, model_shape

    model, layout, _ = case_layout(case)
    shape, lay = model_shape(model), Layout.parse(layout)
    started = time.perf_counter()
    estimate(shape, lay, HARDWARE["h100-sxm"])
    return time.perf_counter() - started


def report(case: str, result: dict[str, object]) -> None:
    model, layout, goal = case_layout(case)
    wall, rss = float(result["wall_s"]), int(result["rss"])  # type: ignore[arg-type]
    plan_s = planner_seconds(case)
    print(f"\n{model} on {layout}")
    print(f"  dry run {wall:7.1f} s (goal {goal} s: {'met' if wall <= goal else 'MISSED'}), "
          f"peak RSS {rss / GIB:.2f} GiB, with its workers (goal 8: "
          f"{'met' if rss <= 8 * GIB else 'MISSED'}); planner {plan_s * 1e3:.1f} ms; "
          f"ratio {wall / plan_s:,.0f}x")
    print(f"  {'rank':>5} {'role':<42} {'s':>5} " + " ".join(
        f"{k:>11}" for k in ("params", "grads", "optimizer", "activations", "buffers",
                             "total")) + "  (GiB at the step's peak)")
    for r in result["ranks"]:  # type: ignore[attr-defined]
        mem = r["memory"]
        print(f"  {r['rank']:>5} {r['role'][:42]:<42} {r['seconds']:5.1f} " + " ".join(
            f"{mem[k] / GIB:11.2f}" for k in ("params", "grads", "optimizer", "activations",
                                               "buffers", "total"))
            + f"  fits: {r['fits']}")
    print("  planner beside (each category's own peak; the planner's busiest stage):")
    for row in result["rows"]:  # type: ignore[attr-defined]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}"
        error = ("not compared" if not row["comparable"] else "-" if row["error"] is None
                 else f"{row['error']:+.1%}")
        print(f"  {row['rank']:>5} {row['name']:<12} dry run {row['dry_run'] / GIB:8.2f} GiB "
              f"planner {row['planner'] / GIB:8.2f} GiB  planner/dry {ratio:>5}  with the "
              f"differences {row['explained'] / GIB:8.2f} GiB ({error})"
              + (f"  {row['difference']}" if row["difference"] else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=list(CASES))
    parser.add_argument("--one", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--profile", choices=list(CASES))
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one)))
        return
    if args.profile:
        import cProfile
        import pstats

        cProfile.runctx("one(args.profile)", globals(), {"one": one, "args": args},
                        "/tmp/dryrun.prof")
        pstats.Stats("/tmp/dryrun.prof").sort_stats("cumulative").print_stats(25)
        return
    for case in [args.case] if args.case else list(CASES):
        child = subprocess.run([sys.executable, __file__, "--one", case], capture_output=True,
                               text=True, check=False)
        if child.returncode:
            print(child.stderr[-3000:])
            raise SystemExit(f"{case}: the dry run failed ({child.returncode})")
        report(case, json.loads(child.stdout.strip().splitlines()[-1]))


if __name__ == "__main__":
    main()
