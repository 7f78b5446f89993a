"""A dry run at full scale beside the planner: Llama-3 70B on 1,024 fake ranks and 405B on
16,384, one process each, no cluster; each in a fixed layout, and in the planner's first
choice for it (counting meshlab's code: whether that fits where it runs).

Each case runs in a child process (so its peak RSS is its own): meshlab.dry_run.run builds the
model on the meta device, parallelizes it for one representative rank per pipeline stage
and runs a step on fake tensors. Printed per case: the wall time and the most resident memory
the child and its workers held at once (sampled) beside the planner's time
to estimate the same layout (goals: 70B <= 30 s, 405B <= 120 s, <= 8 GiB), then each
rank's memory by category beside the planner's.

$ python benchmarks/dryrun.py                 # every case
$ python benchmarks/dryrun.py --case 70b      # one
$ python benchmarks/dryrun.py --profile 70b   # where a case's time goes (cProfile, top 25)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import threading
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
    from meshlab.dry_run.run import dryrun, planner_beside

    model, layout, _ = case_layout(case)
    sampler = ResidentSampler()
    sampler.start()
    started = time.perf_counter()
    run = dryrun(model, layout, hardware="h100-sxm", workers=os.cpu_count())  # a script: say so
    wall = time.perf_counter() - started
    sampler.stop()
    # the ranks run in worker processes forked from a server (meshlab.dry_run.run): the
    # host holds this process and all of them together; at least this process's own peak
    rss = max(sampler.peak, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    rows = [r.as_dict() for r in planner_beside(run) if r.what == "memory"]
    return {"wall_s": wall, "rss": rss, "ranks": [
        {"rank": r.rank, "role": r.role, "seconds": r.seconds, "memory": r.memory,
         "fits": r.fits} for r in run.ranks], "rows": rows}


class ResidentSampler(threading.Thread):
    """The most resident memory this process and its descendants held at once, sampled
    every 50 ms (a rusage figure cannot see the workers: they are a server's children)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self._done = 0, threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._done.wait(0.05):
            total = 0
            for p in [me, *me.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):  # gone since it was listed
                    total += p.memory_info().rss
            self.peak = max(self.peak, total)

    def stop(self) -> None:
        self._done.set()
        self.join()


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
