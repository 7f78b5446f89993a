"""Start-up: meshlab's Cluster against torchrun, from nothing to a finished all_reduce.

Both start N CPU ranks on gloo and time until an all_reduce across them has returned on
rank 0, interleaved (meshlab, torchrun, meshlab, ...) so drift hits both alike:

- meshlab:  `Cluster(N).start()` (controller, engines, process group) and one cell with an
            all_reduce; the phases of the start as the ready line gives them;
- magics:   a fresh interpreter, as a new notebook kernel is: IPython, `%load_ext meshlab`,
            `%mesh start N` and a `%%mesh` cell with an all_reduce, timed from launching the
            interpreter, as torchrun is (its interpreters import torch too);
- torchrun: `python -m torch.distributed.run --standalone --nproc-per-node N` of a script
            that imports torch, joins the group and all-reduces; rank 0 writes the time the
            all_reduce returned (the launcher's teardown is not counted);
- restart:  `Cluster.restart()` of a running cluster (what `%mesh restart` does before it
            replays the session) and one cell with an all_reduce.

$ python benchmarks/startup.py                  # 4 ranks, 3 rounds
$ python benchmarks/startup.py --ranks 8 --rounds 5
$ python benchmarks/startup.py --restart          # and `%mesh restart`'s fresh engines
$ python benchmarks/startup.py --ranks 4 --profile two-hosts.toml   # meshlab on a profile's
                                                                    # hosts; torchrun local
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from meshlab import Cluster

RANK_SCRIPT = """
import sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(repr(time.time()))
dist.destroy_process_group()
"""


def meshlab_start(n: int, profile: str = "local") -> tuple[float, str]:
    """Seconds from nothing to a finished all_reduce; the start's phases."""
    started = time.perf_counter()
    cluster = Cluster(n, profile=profile).start(progress=False)
    try:
        cluster.run("t = torch.ones(1)\ndist.all_reduce(t)")
        return time.perf_counter() - started, cluster.start_phases
    finally:
        cluster.stop()


def meshlab_restart(n: int, profile: str = "local") -> float:
    """Seconds from a running cluster's restart to a finished all_reduce on fresh engines."""
    cluster = Cluster(n, profile=profile).start(progress=False)
    try:
        started = time.perf_counter()
        cluster.restart(progress=False)
        cluster.run("t = torch.ones(1)\ndist.all_reduce(t)")
        return time.perf_counter() - started
    finally:
        cluster.stop()


MAGICS_SCRIPT = """
import sys, time
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "meshlab")
shell.run_line_magic("mesh", f"start {sys.argv[2]} --profile {sys.argv[3]}")
result = shell.run_cell("%%mesh\\nt = torch.ones(1)\\ndist.all_reduce(t)")
open(sys.argv[1], "w").write(repr(time.time()) if result.success else "failed")
shell.run_line_magic("mesh", "stop")
"""


def magics_start(n: int, profile: str, folder: Path) -> float:
    """Seconds from launching a fresh interpreter to its `%%mesh` all_reduce returning."""
    script, stamp = folder / "magics.py", folder / "magics-done"
    script.write_text(textwrap.dedent(MAGICS_SCRIPT))
    stamp.unlink(missing_ok=True)
    started = time.time()
    subprocess.run([sys.executable, str(script), str(stamp), str(n), profile], check=True,
                   capture_output=True)
    return float(stamp.read_text()) - started


def torchrun_start(n: int, folder: Path) -> float:
    """Seconds from launching torchrun to rank 0's all_reduce returning."""
    script, stamp = folder / "rank.py", folder / "done"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    stamp.unlink(missing_ok=True)
    started = time.time()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={n}", str(script), str(stamp)],
                   check=True, capture_output=True)
    return float(stamp.read_text()) - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="local",
                        help="meshlab's cluster profile (a name or a .toml path)")
    parser.add_argument("--restart", action="store_true",
                        help="also time Cluster.restart() of a running cluster each round")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"meshlab": [], "magics": [], "torchrun": [],
                                     "restart": []}
    with tempfile.TemporaryDirectory() as folder:
        for i in range(args.rounds):
            seconds, phases = meshlab_start(args.ranks, args.profile)
            times["meshlab"].append(seconds)
            times["magics"].append(magics_start(args.ranks, args.profile, Path(folder)))
            times["torchrun"].append(torchrun_start(args.ranks, Path(folder)))
            line = (f"round {i + 1}: meshlab {seconds:.2f} s ({phases}), magics from a fresh "
                    f"interpreter {times['magics'][-1]:.2f} s, "
                    f"torchrun {times['torchrun'][-1]:.2f} s")
            if args.restart:
                times["restart"].append(meshlab_restart(args.ranks, args.profile))
                line += f", meshlab restart {times['restart'][-1]:.2f} s"
            print(line, flush=True)
    mesh, magics, torchrun = (statistics.median(times[k])
                              for k in ("meshlab", "magics", "torchrun"))
    print(f"{args.ranks} ranks ({args.profile}) to a finished all_reduce, median of "
          f"{args.rounds}: "
          f"meshlab {mesh:.2f} s, torchrun {torchrun:.2f} s, ratio {mesh / torchrun:.2f}; "
          f"the magics from a fresh interpreter {magics:.2f} s, ratio {magics / torchrun:.2f}")
    if args.restart:
        again = statistics.median(times["restart"])
        print(f"restart of {args.ranks} ranks to a finished all_reduce: {again:.2f} s, "
              f"ratio to torchrun's start {again / torchrun:.2f}")


if __name__ == "__main__":
    main()
