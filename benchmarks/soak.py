"""A long session: thousands of %%mesh cells, and whether anything grows.

A real IPython shell with `%load_ext meshlab` runs N cells (default 10,000) on R CPU ranks
(default 8), as a notebook would: a mix of no-ops, prints, an all_reduce and a value, a
failing rank every 100th cell, a flood past the output cap every 1,000th, a background
thread's line now and then. It reads the notebook's and every rank's resident memory, open
file descriptors and threads, and the cut-output folder's size, at the start, after the
warm-up and at the end, and prints them with the growth after the warm-up. Not a test: it
takes minutes.

$ python benchmarks/soak.py                       # 10,000 cells on 8 ranks
$ python benchmarks/soak.py --cells 2000 --ranks 4
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from IPython.core.displaypub import DisplayPublisher
from IPython.testing.globalipapp import start_ipython

from meshlab import Cluster

PROFILE = """
[cluster]
launcher = "local"
backend = "gloo"
pg_timeout = 60
start_timeout = 300
"""


class Discard(DisplayPublisher):
    """A front end that draws nothing: what the cells show is not what is measured."""

    def publish(self, *args: Any, **kwargs: Any) -> None:
        pass

    def clear_output(self, wait: bool = False) -> None:
        pass


def cell(i: int, ranks: int) -> str:
    """The i-th cell of the mix."""
    if i % 1000 == 999:
        return "for j in range(6000):\n    print('flood', j)"  # past the 5000-line cap
    if i % 100 == 99:
        return f"if rank == {i % ranks}:\n    raise ValueError('bad batch {i}')"
    if i % 250 == 125:  # a thread outside any cell prints once, shown with the next cell
        return "threading.Timer(0.01, print, ('from a timer',)).start()"
    return ["pass", f"print(rank, {i})", "dist.all_reduce(torch.ones(16))", "rank * 2"][i % 4]


def folder_bytes(folder: Path | None) -> int:
    if folder is None or not folder.exists():
        return 0
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def snapshot(cluster: Cluster) -> dict[str, float]:
    """RSS (MB), open descriptors and threads of the notebook and of the ranks (the largest
    of any rank), and the cut-output folder's size (MB)."""
    row: dict[str, float] = {}
    ranks = [psutil.Process(h["pid"]) for h in cluster._hosts]
    for who, procs in (("notebook", [psutil.Process()]), ("rank (max)", ranks)):
        row[f"{who} RSS MB"] = max(p.memory_info().rss for p in procs) / 2**20
        row[f"{who} fds"] = max(p.num_fds() for p in procs)
        row[f"{who} threads"] = max(p.num_threads() for p in procs)
    folder = cluster._cut_output
    row["cut-output MB"] = folder_bytes(folder) / 2**20
    row["cut-output cells"] = len(list(folder.glob("cell-*"))) if folder else 0
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=1000, help="cells before the baseline")
    parser.add_argument("--cut-output-budget", type=float, default=None, metavar="MB",
                        help="cluster.max_cut_output_bytes (default 1 GB), to watch it hold")
    args = parser.parse_args()
    profile = Path(tempfile.mkdtemp()) / "soak.toml"
    profile.write_text(PROFILE)
    shell = start_ipython()
    shell.run_line_magic("load_ext", "meshlab")
    shell.display_pub = Discard(shell=shell)
    session = shell.magics_manager.registry["MeshMagics"].session
    with Cluster(args.ranks, profile=profile) as cluster:
        session.cluster = cluster
        if args.cut_output_budget is not None:
            cluster.max_cut_output_bytes = int(args.cut_output_budget * 2**20)
        shell.run_cell("%%mesh\nimport threading")
        rows = {"start": snapshot(cluster)}
        failed, started = 0, time.perf_counter()
        for i in range(args.cells):
            with contextlib.redirect_stdout(io.StringIO()):  # the failing cells' tracebacks
                outcome = shell.run_cell(f"%%mesh\n{cell(i, args.ranks)}", silent=True)
            failed += not outcome.success
            if i + 1 == args.warmup:
                rows["after warm-up"] = snapshot(cluster)
        seconds = time.perf_counter() - started
        rows["end"] = snapshot(cluster)
        session.cluster = None
    expected = sum(1 for i in range(args.cells) if i % 100 == 99 and i % 1000 != 999)
    print(f"{args.cells:,} cells on {args.ranks} ranks in {seconds:.0f} s "
          f"({seconds / args.cells * 1000:.1f} ms a cell); {failed} failed "
          f"({expected} meant to)")
    base = rows.get("after warm-up", rows["start"])
    print(f"| {'':<20} | {' | '.join(f'{k:>13}' for k in rows)} | growth after warm-up |")
    print(f"|{'-' * 22}|{'|'.join('-' * 15 for _ in rows)}|{'-' * 22}|")
    for metric in rows["start"]:
        values = [rows[k][metric] for k in rows]
        growth = (rows["end"][metric] - base[metric]) / base[metric] * 100 if base[metric] else 0
        print(f"| {metric:<20} | {' | '.join(f'{v:>13.1f}' for v in values)} | "
              f"{growth:>19.1f}% |")


if __name__ == "__main__":
    main()
